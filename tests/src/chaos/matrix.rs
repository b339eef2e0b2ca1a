//! The combinations the chaos suite runs, one test each in
//! `tests/tests/chaos.rs`: a broker (librdkafka's mock cluster, or a
//! standalone tansu process that can be killed), and whether each shard
//! has a replica to fail over to. The consumers take their partitions by
//! member leases on the metadata shard, the one way bagstore has (the
//! broker's group protocol was a combination of its own until it was
//! removed; docs/design-notes.md, "Levers tried and removed").

use futures::FutureExt;

use super::{ChaosConfig, Fault};
use crate::{TestEnv, STANDARD_INDEXES};

/// Where the suite's Kafka comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Broker {
    /// librdkafka's mock cluster, in the test process (fault: the broker
    /// down for a while).
    Mock,
    /// A tansu 0.6.0 process on PostgreSQL storage (fault: `kill -9` and a
    /// restart on its data).
    Tansu,
}

/// One cell of the matrix.
#[derive(Debug, Clone, Copy)]
pub struct Combination {
    /// The test's name suffix and the databases' and topics' prefix.
    pub name: &'static str,
    pub broker: Broker,
    pub faults: &'static [Fault],
    /// Faults of each kind (`BAGSTORE_CHAOS_FAULTS` overrides it).
    pub per_kind: usize,
    /// Semi-sync replicas per physical shard, the metadata shard's
    /// included (0: the shared servers; otherwise each shard on servers
    /// of the run's own, see `replicated::Cluster`).
    pub replicas: u32,
}

/// Every fault the mock cluster can take. Moves run on the mock cluster
/// only: they exercise MySQL, not the broker, and once is enough per run of
/// the matrix's time budget.
const MOCK_FAULTS: &[Fault] =
    &[Fault::IndexerKill, Fault::WriterKill, Fault::BrokerOutage, Fault::MysqlKill, Fault::Move];
/// With a replica per shard, the mock cluster's faults and failovers.
const FAILOVER_FAULTS: &[Fault] = &[
    Fault::Failover,
    Fault::IndexerKill,
    Fault::WriterKill,
    Fault::BrokerOutage,
    Fault::MysqlKill,
    Fault::Move,
];
const TANSU_FAULTS: &[Fault] = &[Fault::BrokerKill, Fault::IndexerKill, Fault::WriterKill, Fault::MysqlKill];

/// The matrix. Each combination is a test of its own in
/// `tests/tests/chaos.rs` (`scripts/test` times each).
pub const MATRIX: [Combination; 3] = [
    Combination { name: "mock", broker: Broker::Mock, faults: MOCK_FAULTS, per_kind: 5, replicas: 0 },
    Combination { name: "tansu", broker: Broker::Tansu, faults: TANSU_FAULTS, per_kind: 3, replicas: 0 },
    // Failovers want servers of their own, each shard a primary and a
    // replica: a combination of its own.
    Combination { name: "failover", broker: Broker::Mock, faults: FAILOVER_FAULTS, per_kind: 3, replicas: 1 },
];

/// One chaos run at a time in a test process: each wants the machine
/// (its timings are real), and a test binary runs its tests in parallel.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs the suite for the combination called `name`.
pub async fn run(name: &str) {
    let c = MATRIX.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no combination {name:?}"));
    let _turn = ONE_AT_A_TIME.lock().await;
    let mut toml = STANDARD_INDEXES.to_string();
    if c.broker == Broker::Mock {
        // librdkafka's mock broker sometimes holds a group's OffsetCommit
        // response while that group rebalances; the member's later
        // requests queue behind it until the client's socket timeout (60 s
        // by default) fails it. A 10 s timeout keeps a rebalance under
        // ~20 s here; a real broker answers such a commit at once
        // (REBALANCE_IN_PROGRESS).
        toml.push_str("\n[kafka.options]\n\"socket.timeout.ms\" = \"10000\"\n");
    }
    let test_name = format!("chaos{}", c.name.replace('_', ""));
    let mut env = match c.broker {
        Broker::Mock => TestEnv::new(&test_name, &toml).await,
        Broker::Tansu => TestEnv::with_tansu(&test_name, &toml).await,
    };
    eprintln!("chaos combination {}: {:?} broker, {} replica(s) per shard", c.name, c.broker, c.replicas);
    let mut cfg = ChaosConfig::from_env(c.faults, c.per_kind);
    cfg.replicas = c.replicas;
    let dir = env.dir.path().to_path_buf();
    let ran = std::panic::AssertUnwindSafe(super::run(&mut env, cfg)).catch_unwind().await;
    if let Err(panic) = ran {
        // A CI log may keep only the backtrace's end: the reason goes to
        // the run's directory too, which the unwinding keeps.
        let why = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic without a message".into());
        std::fs::write(dir.join("chaos-panic.txt"), format!("{why}\n")).ok();
        std::panic::resume_unwind(panic);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_combination_is_named_once() {
        let mut names: Vec<&str> = MATRIX.iter().map(|c| c.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), MATRIX.len());
    }
}
