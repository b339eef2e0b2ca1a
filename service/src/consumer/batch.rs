//! What a consumer hands its worker: a batch of messages of partitions it
//! holds and has claimed, and how a batch is gathered.

use rdkafka::consumer::{ConsumerContext, StreamConsumer};
use rdkafka::message::{Message, OwnedMessage};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use storage::fences::Claim;

/// Messages to work on, in their partitions' order, all of partitions the
/// consumer holds and has claimed.
#[derive(Debug)]
pub struct Batch {
    pub messages: Vec<OwnedMessage>,
    /// The claims on the batch's partitions (`storage::fences`): every
    /// index write of the batch proves them in its own transaction.
    pub claims: Vec<Claim>,
    /// The claims made since the previous batch: their partitions were
    /// newly given to this consumer, so whatever the worker remembers of
    /// them is stale (a predecessor may have worked on them meanwhile,
    /// unless the claim's generation is right above the worker's own last
    /// claim on that partition).
    pub claimed: Vec<Claim>,
}

impl Batch {
    /// The partitions the batch's messages come from.
    pub fn partitions(&self) -> BTreeSet<i32> {
        self.messages.iter().map(|m| m.partition()).collect()
    }

    /// The offsets to store once the batch is done: partition → the offset
    /// after its last message.
    pub fn next_offsets(&self) -> BTreeMap<i32, i64> {
        next_offsets(&self.messages)
    }
}

/// Partition → the offset after its last message in `messages`.
pub fn next_offsets(messages: &[OwnedMessage]) -> BTreeMap<i32, i64> {
    let mut next = BTreeMap::new();
    for m in messages {
        let e = next.entry(m.partition()).or_insert(0);
        *e = (*e).max(m.offset() + 1);
    }
    next
}

/// Adds to `batch` what arrives within `wait` of now, up to `max`
/// messages (a zero wait takes only what is already fetched). A consumer
/// error ends the batch; the next receive reports it again if it lasts.
pub(super) async fn gather<C: ConsumerContext + 'static>(
    consumer: &StreamConsumer<C>,
    batch: &mut Vec<OwnedMessage>,
    max: usize,
    wait: Duration,
) {
    let until = tokio::time::Instant::now() + wait;
    while batch.len() < max {
        match tokio::time::timeout_at(until, consumer.recv()).await {
            Ok(Ok(m)) => batch.push(m.detach()),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "consumer error");
                break;
            }
            Err(_) => break,
        }
    }
}
