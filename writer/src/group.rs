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

use schemas::EntityId;
use std::sync::{Arc, Weak};
use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::write::{per_item, Change, Outcome, Precondition, WriteError};
use crate::{Inner, Writer};

/// A single write waiting for its shard's next transaction.
#[derive(Debug)]
pub(crate) struct Pending {
    pub id: EntityId,
    pub change: Change,
    pub pre: Precondition,
    pub answer: oneshot::Sender<Result<Outcome, WriteError>>,
}

/// The sending side of one shard's queue.
pub(crate) type Queue = mpsc::UnboundedSender<Pending>;

/// The queue of physical shard `shard`, made (with its dispatcher task)
/// the first time a write goes there: shards added online get theirs
/// without a restart. A dispatcher holds only a weak reference to the
/// writer, and ends once the writer (and with it the queue's sender) is
/// dropped.
pub(crate) fn queue(inner: &Arc<Inner>, shard: usize) -> &Queue {
    inner.queues[shard].get_or_init(|| {
        let (tx, rx) = mpsc::unbounded_channel();
        let slots = inner.settings.writer.commit_slots;
        let max = inner.settings.writer.max_batch;
        tokio::spawn(dispatch(shard, Arc::downgrade(inner), rx, Arc::new(Semaphore::new(slots)), max));
        tx
    })
}

/// Waits for a write, then for a free slot, then takes everything queued
/// meanwhile into one transaction run in its own task.
async fn dispatch(
    shard: usize,
    writer: Weak<Inner>,
    mut rx: mpsc::UnboundedReceiver<Pending>,
    slots: Arc<Semaphore>,
    max: usize,
) {
    while let Some(first) = rx.recv().await {
        let Ok(slot) = slots.clone().acquire_owned().await else { return };
        let mut group = vec![first];
        while group.len() < max {
            match rx.try_recv() {
                Ok(p) => group.push(p),
                Err(_) => break,
            }
        }
        let Some(inner) = writer.upgrade() else { return };
        let w = Writer { inner };
        w.inner.metrics.queued.with_label_values(&[&shard.to_string()]).sub(group.len() as i64);
        tokio::spawn(async move {
            w.commit_group(shard, group).await;
            drop(slot);
        });
    }
}

impl Writer {
    /// Queues one write on the shard that owns it and waits for its answer.
    /// When that shard turns out not to own it any more (a move completed
    /// since the map was loaded, or is in its cutover), the map is reloaded
    /// and the write goes to the new owner: it waits, it does not fail.
    pub(crate) async fn write_one(
        &self,
        id: EntityId,
        change: Change,
        pre: Precondition,
    ) -> Result<Outcome, WriteError> {
        let mut stale = crate::StaleMapRetry::new();
        loop {
            let shard = self.shards().of_id(&id);
            let (answer, rx) = oneshot::channel();
            self.inner.metrics.queued.with_label_values(&[&shard.to_string()]).inc();
            queue(&self.inner, shard)
                .send(Pending { id, change: change.clone(), pre, answer })
                .expect("a shard's dispatcher lives as long as the writer");
            let result = rx.await.expect("every queued write is answered");
            match result {
                Err(e) if e.is_stale_map() && stale.again(self.shards(), &self.inner.metrics).await => {}
                other => return other,
            }
        }
    }

    async fn commit_group(&self, shard: usize, group: Vec<Pending>) {
        self.inner.metrics.group_size.with_label_values(&[&shard.to_string()]).observe(group.len() as f64);
        let (items, answers): (Vec<_>, Vec<_>) =
            group.into_iter().map(|p| ((p.id, p.change, p.pre), p.answer)).unzip();
        let result = self.transaction_with_retries(shard, &items).await;
        for (answer, r) in answers.into_iter().zip(per_item(shard, result, items.len())) {
            // A closed receiver is a client that went away.
            let _ = answer.send(r);
        }
    }
}
