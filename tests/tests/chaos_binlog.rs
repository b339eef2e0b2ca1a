//! The chaos suite against librdkafka's mock cluster, as `chaos.rs`, with
//! the writers' outbox in the binary log (`writer.outbox = "binlog"`, see
//! `storage::relay_log`): the relay reads the events back from the log over
//! a replication connection, which the killed-connections fault kills too,
//! and every fault of `chaos.rs` still must keep Invariants W, I and R.

use bagstore_tests::chaos::{self, ChaosConfig, Fault};
use bagstore_tests::{TestEnv, STANDARD_INDEXES};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_with_the_binlog_outbox_under_crashes_broker_outages_and_killed_connections() {
    // The same broker option as chaos.rs.
    let toml = format!("{STANDARD_INDEXES}\n[kafka.options]\n\"socket.timeout.ms\" = \"10000\"\n");
    let mut env = TestEnv::with_binlog_outbox("chaosbinlog", &toml).await;
    let faults = [Fault::IndexerKill, Fault::WriterKill, Fault::BrokerOutage, Fault::MysqlKill, Fault::Move];
    chaos::run(&mut env, ChaosConfig::from_env(&faults, 5)).await;
}
