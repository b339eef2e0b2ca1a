//! The chaos suite against librdkafka's mock cluster: indexer and writer
//! `kill -9`, broker outages, killed MySQL connections and online shard
//! moves (some killed mid-copy or mid-cutover), five of each, with the
//! cleaner sweeping throughout. See `bagstore_tests::chaos`.

use bagstore_tests::chaos::{self, ChaosConfig, Fault};
use bagstore_tests::{TestEnv, STANDARD_INDEXES};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_under_crashes_broker_outages_and_killed_connections() {
    // librdkafka's mock broker sometimes holds a group's OffsetCommit
    // response while that group rebalances; the member's later requests
    // queue behind it until the client's socket timeout (60 s by default)
    // fails it. A 10 s timeout keeps a rebalance under ~20 s here; a real
    // broker answers such a commit at once (REBALANCE_IN_PROGRESS).
    let toml = format!("{STANDARD_INDEXES}\n[kafka.options]\n\"socket.timeout.ms\" = \"10000\"\n");
    let mut env = TestEnv::new("chaos", &toml).await;
    let faults = [Fault::IndexerKill, Fault::WriterKill, Fault::BrokerOutage, Fault::MysqlKill, Fault::Move];
    chaos::run(&mut env, ChaosConfig::from_env(&faults, 5)).await;
}
