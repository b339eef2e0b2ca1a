//! The chaos suite, once per combination of broker and replication
//! (`bagstore_tests::chaos::matrix`, where the matrix is written down):
//! indexer and writer `kill -9`, broker outages or kills, killed MySQL
//! connections and online shard moves, with the cleaner sweeping
//! throughout, and (on servers of its own, a replica per shard) primaries
//! killed and failed over, checked against Invariants W, I and R. The combinations
//! take turns (each wants the machine); `scripts/test` runs and times each
//! (`cargo test -p bagstore-tests --test chaos -- invariants_hold_for_tansu`
//! runs one).

use bagstore_tests::chaos::matrix;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_for_mock() {
    matrix::run("mock").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_for_tansu() {
    matrix::run("tansu").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_for_failover() {
    matrix::run("failover").await;
}
