//! The member lease a consumer follows, and the topic's partition count
//! its share is computed over.

use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::{Offset, TopicPartitionList};
use schemas::settings::KafkaSettings;
use std::collections::BTreeSet;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use crate::claims::Claims;
use crate::kafka;
use crate::leases::Lease;
use crate::serve::sleep_or_stop;

/// The member lease, kept across the consumers it outlives (a rebuilt
/// consumer follows the same lease), and the partitions it shares out.
#[derive(Debug)]
pub(super) struct Leased {
    pub(super) lease: Lease,
    pub(super) partitions: usize,
}

/// What following the lease asks of the consumer.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Follow {
    /// It holds its share (or could not take it yet: tried again).
    Holds,
    /// It held nothing and was just given these.
    Assigned(BTreeSet<i32>),
    /// It holds partitions that are no longer its share: a new consumer
    /// takes the new share.
    Reshare,
}

/// Gives a consumer that holds nothing this member's share (see
/// [`crate::leases`]), from the group's committed offsets; each partition
/// is claimed before anything of it is handed out. A consumer that holds
/// partitions and whose share changed is replaced instead: changing a live
/// consumer's assignment piecemeal (`incremental_assign` and
/// `incremental_unassign` around a broker outage) once left a consumer
/// fetching nothing for good. An error once another process took the
/// member name.
pub(super) fn follow(consumer: &StreamConsumer<Claims>, l: &Leased, topic: &str) -> Result<Follow, String> {
    let want = l.lease.share(l.partitions)?;
    let watch = consumer.context();
    let held = watch.held(consumer);
    if want == held {
        if want.is_empty() && l.lease.is_live() && !watch.settled() {
            // An empty share of a live lease is this member's assignment
            // too (more members than partitions).
            watch.assigned(Vec::new());
        }
        return Ok(Follow::Holds);
    }
    if !held.is_empty() {
        return Ok(Follow::Reshare);
    }
    let mut tpl = TopicPartitionList::new();
    for p in &want {
        let _ = tpl.add_partition_offset(topic, *p, Offset::Stored);
    }
    if let Err(e) = consumer.assign(&tpl) {
        tracing::warn!(%topic, error = %e, "cannot take the lease's partitions; retrying");
        return Ok(Follow::Holds);
    }
    watch.assigned(want.iter().copied().collect());
    Ok(Follow::Assigned(want))
}

/// `topic`'s partition count, asked of the broker until it answers (None:
/// shutdown came first); `failing` hears why it did not. The leases split
/// this many.
pub(super) async fn partition_count(
    k: &KafkaSettings,
    topic: &str,
    shutdown: &CancellationToken,
    failing: impl Fn(String),
) -> Option<usize> {
    let mut backoff = Duration::from_millis(100);
    loop {
        let (k, t) = (k.clone(), topic.to_string());
        let why = match tokio::task::spawn_blocking(move || kafka::partition_count(&k, &t)).await {
            Ok(Ok(n)) if n > 0 => return Some(n),
            Ok(Ok(_)) => format!("topic {topic} has no partitions yet"),
            Ok(Err(e)) => format!("cannot read the partitions of topic {topic}: {e}"),
            Err(e) => format!("cannot read the partitions of topic {topic}: {e}"),
        };
        tracing::warn!(%why, "retrying");
        failing(why);
        if !sleep_or_stop(shutdown, backoff).await {
            return None;
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}
