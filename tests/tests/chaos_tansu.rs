//! The chaos suite against a standalone broker process that is killed with
//! `kill -9` and restarted on its data (tansu 0.6.0, sqlite storage), with
//! indexer and writer crashes and killed MySQL connections in between. See
//! `bagstore_tests::chaos`.

use bagstore_tests::chaos::{self, ChaosConfig, Fault};
use bagstore_tests::{TestEnv, STANDARD_INDEXES};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_when_the_broker_process_is_killed_and_restarted() {
    let env = TestEnv::with_tansu("chaostansu", STANDARD_INDEXES).await;
    let faults = [Fault::BrokerKill, Fault::IndexerKill, Fault::WriterKill, Fault::MysqlKill];
    chaos::run(&env, ChaosConfig::from_env(&faults, 3)).await;
}
