//! The chaos suite, once per combination of broker and partition
//! assignment that bagstore runs on (`bagstore_tests::chaos::matrix`, where
//! the matrix and the reason tansu runs leases only are written down):
//! indexer and writer `kill -9`, broker outages or kills, killed MySQL
//! connections and online shard moves, with the cleaner sweeping
//! throughout, and (on servers of its own, a replica per shard) primaries
//! killed and failed over, checked against Invariants W, I and R. The combinations
//! take turns (each wants the machine); `scripts/test` runs and times each
//! (`cargo test -p bagstore-tests --test chaos -- mock_leases` runs one).

use bagstore_tests::chaos::matrix;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_for_mock_group() {
    matrix::run("mock_group").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_for_mock_leases() {
    matrix::run("mock_leases").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_for_tansu_leases() {
    matrix::run("tansu_leases").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_for_mock_failover() {
    matrix::run("mock_failover").await;
}
