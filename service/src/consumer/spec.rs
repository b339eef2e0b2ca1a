//! What a fenced consumer is for ([`Options`]), what it hands its worker
//! ([`Next`]), and what the worker counts of it ([`Observer`]).

use std::time::Duration;

use super::batch::Batch;

/// What a consumer is for, and how it takes its partitions.
#[derive(Debug, Clone)]
pub struct Options {
    /// Its name in `/health/ready` and the log (`consumer index_foo`,
    /// `ingest`).
    pub part: String,
    pub group: String,
    pub topic: String,
    /// Its `fetch.wait.max.ms` (see `schemas::settings::FETCH_WAIT_MS`).
    pub fetch_wait_ms: u64,
    /// Its member name, under which its lease takes a share of the
    /// partitions (None: one of its own per process).
    pub member: Option<String>,
    /// The setting that names the member (`indexer.member`), for the error
    /// when two processes share a name.
    pub member_setting: &'static str,
    /// Most messages in a batch.
    pub batch_max: usize,
    /// How long a batch waits for more once a message arrived (zero: only
    /// what is already fetched joins it).
    pub batch_wait: Duration,
    /// Whether the process is ready only once this consumer holds its
    /// partitions (see `Health::starting`).
    pub gates_readiness: bool,
}

/// What a worker counts of its consumer (default: nothing).
pub trait Observer: Send + Sync {
    /// A message of `partition` was fetched, held or not.
    fn fetched(&self, _partition: i32) {}
    /// The consumer holds this many partitions.
    fn holds(&self, _partitions: usize) {}
    /// The consumer lost its partitions and was replaced by a new one.
    fn rebuilt(&self) {}
}

/// An [`Observer`] that counts nothing.
#[derive(Debug, Clone, Copy)]
pub struct Unobserved;

impl Observer for Unobserved {}

/// What `FencedConsumer::next` has for the worker.
#[derive(Debug)]
pub enum Next {
    /// Messages to work on; `FencedConsumer::store` once they are done.
    Batch(Batch),
    /// Nothing arrived for a while (a chance for periodic work).
    Idle,
    /// Shutdown was asked: finish, then `FencedConsumer::close`.
    Stop,
    /// Another process took this member's name, and this
    /// consumer holds nothing any more (why).
    Taken(String),
}

/// Whether partitions are still a consumer's (`FencedConsumer::still_ours`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ownership {
    Ours,
    /// Another member has them now (why); the consumer is rebuilt.
    Lost(String),
    /// Not known now (the metadata shard does not answer; why).
    Unknown(String),
}
