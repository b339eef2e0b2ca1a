//! No partition is fetched and applied by two indexers after a mock-broker
//! outage longer than the session timeout (issue 17). The same scenario
//! against the standalone broker is in `chaos_tansu.rs`.

use bagstore_tests::membership::{no_partition_is_worked_twice_after_an_outage, OUTAGE};
use bagstore_tests::{TestEnv, STANDARD_INDEXES};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_outage_past_the_session_timeout_each_partition_has_one_worker() {
    let env = TestEnv::new("overlap", STANDARD_INDEXES).await;
    let outcome = no_partition_is_worked_twice_after_an_outage(&env, || async {
        env.kafka.broker_down(1).expect("broker down");
        tokio::time::sleep(OUTAGE).await;
        env.kafka.broker_up(1).expect("broker up");
    })
    .await;
    eprintln!("mock broker: {outcome}");
}
