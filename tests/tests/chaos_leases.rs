//! The chaos suite against librdkafka's mock cluster, as `chaos.rs`, with
//! the indexers assigning partitions among themselves by member leases
//! (`indexer.assignment = "leases"`, see `service::leases`) instead of
//! the broker's group protocol: a killed indexer comes back under its
//! slot's member name and takes its own partitions back, and every fault
//! of `chaos.rs` still must keep Invariants W, I and R.

use bagstore_tests::chaos::{self, ChaosConfig, Fault};
use bagstore_tests::{TestEnv, STANDARD_INDEXES};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_with_member_leases_under_crashes_broker_outages_and_killed_connections() {
    // The same broker option as chaos.rs (no member commits here, but the
    // writers' and the cleaner's clients see the same broker).
    let toml = format!(
        "{STANDARD_INDEXES}\n[kafka.options]\n\"socket.timeout.ms\" = \"10000\"\n\n[indexer]\nassignment = \"leases\"\n"
    );
    let mut env = TestEnv::new("chaosleases", &toml).await;
    let faults = [Fault::IndexerKill, Fault::WriterKill, Fault::BrokerOutage, Fault::MysqlKill, Fault::Move];
    chaos::run(&mut env, ChaosConfig::from_env(&faults, 5)).await;
}
