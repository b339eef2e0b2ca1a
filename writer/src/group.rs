//! Group commit: concurrent single writes to one shard share a transaction.
//!
//! A single `PUT`/`DELETE` does not open a transaction of its own. It joins
//! its shard's queue. Each shard has at most `writer.commit_slots`
//! transactions in flight, and a slot that comes free takes every write
//! waiting in the queue (up to `writer.max_batch`) into one transaction:
//! under load, N concurrent writes cost one locking read, one entity write,
//! one outbox insert and one commit (one redo-log flush) instead of N of
//! each. At low load a write finds a slot free and commits alone at once;
//! nothing ever waits on a timer.
//!
//! Each write keeps its own answer. The transaction decides item by item in
//! arrival order, so a failed precondition skips only that write, and a
//! later write of the same id sees the earlier one. A deadlock or a lost race
//! to create an id reruns the whole group, as it would rerun a lone write.
//! Answers are sent only after the commit, so an acknowledged write is as
//! durable as before. A write whose client went away is still committed (its
//! outcome was unknown to that client either way).
//!
//! A write whose shard turned out not to own it (a move completed since
//! the map was loaded, or is in its cutover) is queued again on the owner
//! the reloaded map names: it waits, it does not fail.

use schemas::EntityId;
use schemas::Settings;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use storage::shards::MAX_PHYSICAL;
use storage::write::{Change, Item, Outcome, Precondition, WriteError};
use storage::{Shards, StaleMapRetry};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};

use crate::commit::{Commit, STALE_MAP_WAIT};
use crate::metrics::Metrics;

/// A single write waiting for its shard's next transaction.
#[derive(Debug)]
struct Pending {
    item: Item,
    answer: oneshot::Sender<Result<Outcome, WriteError>>,
}

/// The sending side of one shard's queue.
type Queue = mpsc::UnboundedSender<Pending>;

/// Every shard's queue of single writes.
#[derive(Debug)]
pub(crate) struct Group {
    shards: Shards,
    commit: Arc<Commit>,
    metrics: Metrics,
    /// By physical id: single writes waiting for a commit slot (made when
    /// first used, see [`Group::queue`]).
    queues: Vec<OnceLock<Queue>>,
    /// `writer.commit_slots`: transactions in flight per shard (on the
    /// server it is on, see [`Slots`]).
    slots: usize,
    /// `writer.max_batch`: the most writes one transaction takes.
    max: usize,
    /// `writer.commit_timeout_ms`: how long a write waits for its answer.
    commit_timeout: Duration,
}

impl Group {
    pub(crate) fn new(settings: &Settings, commit: Arc<Commit>, metrics: Metrics) -> Group {
        Group {
            shards: commit.context().shards().clone(),
            commit,
            metrics,
            queues: (0..MAX_PHYSICAL).map(|_| OnceLock::new()).collect(),
            slots: settings.writer.commit_slots,
            max: settings.writer.max_batch,
            commit_timeout: Duration::from_millis(settings.writer.commit_timeout_ms),
        }
    }

    /// Queues one write on the shard that owns it and waits for its answer;
    /// after a stale map, on the new owner, for up to [`STALE_MAP_WAIT`].
    pub(crate) async fn write(
        &self,
        id: EntityId,
        change: Change,
        pre: Precondition,
    ) -> Result<Outcome, WriteError> {
        let mut stale = StaleMapRetry::new(STALE_MAP_WAIT);
        loop {
            let shard = self.shards.of_id(&id);
            let (answer, rx) = oneshot::channel();
            self.metrics.queued.with_label_values(&[&shard.to_string()]).inc();
            let item = Item { id, change: change.clone(), pre };
            self.queue(shard)
                .send(Pending { item, answer })
                .expect("a shard's dispatcher lives as long as its queue");
            // The commit runs in its dispatcher's task: past the timeout the
            // client is answered, and the commit goes on.
            let Ok(answer) = tokio::time::timeout(self.commit_timeout, rx).await else {
                self.metrics.outcome_unknown.inc();
                return Err(WriteError::OutcomeUnknown { waited_ms: self.commit_timeout.as_millis() as u64 });
            };
            match answer.expect("every queued write is answered") {
                Err(e) if e.is_stale_map() && stale.again(&self.shards).await => {
                    self.metrics.stale_map_retries.inc();
                }
                other => return other,
            }
        }
    }

    /// The queue of physical shard `shard`, made (with its dispatcher task)
    /// the first time a write goes there: shards added online get theirs
    /// without a restart. A dispatcher ends once its queue's sender is
    /// dropped with the writer.
    fn queue(&self, shard: usize) -> &Queue {
        self.queues[shard].get_or_init(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(dispatch(
                shard,
                self.commit.clone(),
                self.metrics.clone(),
                rx,
                self.slots,
                self.max,
            ));
            tx
        })
    }
}

/// One server's commit slots: `writer.commit_slots` transactions in flight
/// on the server the shard is on.
struct Slots {
    /// The shard's server generation they are for (`Shards::generation`).
    generation: usize,
    semaphore: Arc<Semaphore>,
}

impl Slots {
    /// A free slot on the server `shard` is on now. Slots held by
    /// transactions on a server the shard has left (a frozen or cut-off
    /// old primary never answers them) do not count: after a failover or a
    /// switchover the shard's writes get fresh slots on its new server.
    async fn acquire(&mut self, shards: &Shards, shard: usize, per_server: usize) -> OwnedSemaphorePermit {
        loop {
            let now = shards.generation(shard);
            if now != self.generation {
                *self = Slots { generation: now, semaphore: Arc::new(Semaphore::new(per_server)) };
            }
            tokio::select! {
                permit = self.semaphore.clone().acquire_owned() => {
                    return permit.expect("a dispatcher's semaphore is never closed");
                }
                _ = shards.moved(shard, now) => {}
            }
        }
    }
}

/// Waits for a write, then for a free slot, then takes everything queued
/// meanwhile into one transaction run in its own task.
async fn dispatch(
    shard: usize,
    commit: Arc<Commit>,
    metrics: Metrics,
    mut rx: mpsc::UnboundedReceiver<Pending>,
    per_server: usize,
    max: usize,
) {
    let label = shard.to_string();
    let shards = commit.context().shards().clone();
    let mut slots =
        Slots { generation: shards.generation(shard), semaphore: Arc::new(Semaphore::new(per_server)) };
    while let Some(first) = rx.recv().await {
        let slot = slots.acquire(&shards, shard, per_server).await;
        let mut group = vec![first];
        while group.len() < max {
            match rx.try_recv() {
                Ok(p) => group.push(p),
                Err(_) => break,
            }
        }
        metrics.queued.with_label_values(&[&label]).sub(group.len() as i64);
        metrics.group_size.with_label_values(&[&label]).observe(group.len() as f64);
        let commit = commit.clone();
        tokio::spawn(async move {
            let (items, answers): (Vec<_>, Vec<_>) = group.into_iter().map(|p| (p.item, p.answer)).unzip();
            for (answer, r) in answers.into_iter().zip(commit.on_shard(shard, &items).await) {
                // A closed receiver is a client that went away.
                let _ = answer.send(r);
            }
            drop(slot);
        });
    }
}
