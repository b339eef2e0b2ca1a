//! One fenced Kafka consumer for every part of bagstore that consumes a
//! topic as a group and must never work on a partition it no longer owns:
//! the index consumers (`indexer`) and the writers' Kafka ingest
//! (`writer::ingest`). Each keeps only its own work (applying index rows;
//! applying commands and answering them); [`FencedConsumer`] owns the rest:
//!
//! - **Assignment.** By member leases on the metadata shard
//!   ([`crate::leases`]): the consumer never joins the broker's group, it
//!   assigns itself its lease's share and commits its offsets under the
//!   group's id.
//! - **Claims before work.** Each partition given is claimed on the
//!   metadata shard (`storage::fences`) before anything of it is handed to
//!   the worker; a [`Batch`] carries the claims of its partitions, which
//!   every index write proves in its own transaction.
//! - **Loss.** Before every batch (and once a second while idle): whether
//!   another member claimed one of the partitions since ([`Claims`]).
//!   Events of partitions not held (strays) are never handed out; if they
//!   keep coming the consumer is confused. The worker may ask again
//!   ([`FencedConsumer::still_ours`]) or report a loss it found itself
//!   ([`FencedConsumer::lose`]). Whatever the sign, the consumer is closed
//!   and a new one takes the lease's share afresh, holding nothing until
//!   it has claimed it.
//! - **Readiness.** With [`Options::gates_readiness`], the process is not
//!   ready ([`Health::starting`]) until the consumer holds its first
//!   assignment with every partition of it claimed, so what is written
//!   once it is ready is applied as fast as in steady state.
//! - **Offsets.** Stored only when the worker says a batch is done
//!   ([`FencedConsumer::store`]); librdkafka's auto-commit commits what was
//!   stored (rust-rdkafka's `at_least_once` example). [`FencedConsumer::close`]
//!   commits synchronously, then ends the lease.
//!
//! A worker's loop:
//!
//! ```text
//! loop {
//!     match consumer.next(&shutdown).await? {
//!         Next::Batch(batch) => { work on it; consumer.store(&batch.next_offsets()) }
//!         Next::Idle => { periodic work }
//!         Next::Stop => break,
//!         Next::Taken(why) => return Err(why),
//!     }
//! }
//! consumer.close().await;
//! ```

mod batch;
mod leased;
mod spec;
mod turn;

pub use batch::{next_offsets, Batch};
pub use spec::{Next, Observer, Options, Ownership, Unobserved};

use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use schemas::settings::KafkaSettings;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;
use storage::Shards;
use tokio_util::sync::CancellationToken;

use crate::claims::Claims;
use crate::health::Health;
use crate::kafka;
use crate::leases::Lease;
use leased::Leased;
use turn::{Ctx, Live, Rebuild, Step};

/// A group member's consumer of one topic, fenced by partition claims and
/// rebuilt whenever its partitions turn out to be someone else's.
pub struct FencedConsumer {
    ctx: Ctx,
    /// The member lease, kept across the consumers it outlives; None until
    /// the first [`FencedConsumer::next`].
    leased: Option<Leased>,
    /// The consumer now; None until the first [`FencedConsumer::next`] and
    /// between a loss and the rebuild.
    live: Option<Live>,
}

impl std::fmt::Debug for FencedConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FencedConsumer")
            .field("part", &self.ctx.options.part)
            .field("group", &self.ctx.options.group)
            .field("leased", &self.leased)
            .field("connected", &self.live.is_some())
            .finish()
    }
}

impl FencedConsumer {
    /// A consumer by `options`; it connects at the first
    /// [`FencedConsumer::next`]. With `gates_readiness` the process is not
    /// ready from now until it holds its partitions.
    pub fn new(
        kafka: KafkaSettings,
        shards: Shards,
        health: Health,
        options: Options,
        observer: Arc<dyn Observer>,
    ) -> FencedConsumer {
        if options.gates_readiness {
            health.starting(&options.part);
        }
        let ctx = Ctx { kafka, shards, health, options, observer, started: AtomicBool::new(false) };
        FencedConsumer { ctx, leased: None, live: None }
    }

    /// Its name in `/health/ready`.
    pub fn part(&self) -> &str {
        &self.ctx.options.part
    }

    /// Reports how the worker is doing under this consumer's part.
    pub fn report(&self, outcome: Result<(), String>) {
        self.ctx.health.report(&self.ctx.options.part, outcome);
    }

    /// The next batch of messages of partitions this consumer holds and
    /// has claimed, an idle tick, or the end. Rebuilds the consumer as a
    /// new member whenever its partitions turn out to be lost; an error
    /// only when a consumer cannot be made at all (its configuration).
    pub async fn next(&mut self, shutdown: &CancellationToken) -> Result<Next, KafkaError> {
        loop {
            if self.live.is_none() {
                match self.connect(shutdown).await {
                    Ok(true) => {}
                    Ok(false) => return Ok(Next::Stop),
                    Err(e) => {
                        self.give_up(format!("cannot make a consumer: {e}"));
                        return Err(e);
                    }
                }
            }
            let live = self.live.as_mut().expect("connected");
            let leased = self.leased.as_ref().expect("a lease is made before the first consumer");
            match self.ctx.step(live, leased, shutdown).await {
                Step::Yield(next) => return Ok(next),
                Step::Again => {}
                Step::Rebuild(why) => self.rebuild(why),
                Step::Taken(why) => {
                    self.give_up(why.clone());
                    if let Some(live) = self.live.take() {
                        // Its stored offsets are the new holder's to replay.
                        tokio::task::spawn_blocking(move || drop(live));
                    }
                    return Ok(Next::Taken(why));
                }
            }
        }
    }

    /// Why the partitions are known lost, if the worker or
    /// [`FencedConsumer::still_ours`] found them so (no I/O: cheap enough
    /// before every attempt of a write).
    pub fn lost(&self) -> Option<String> {
        self.live.as_ref()?.lost.clone()
    }

    /// The worker found the partitions lost (a write refused by a newer
    /// claim's fence): nothing more is handed out of this consumer, and
    /// the next [`FencedConsumer::next`] rebuilds it.
    pub fn lose(&mut self, why: String) {
        if let Some(live) = self.live.as_mut() {
            live.lost.get_or_insert(why);
        }
    }

    /// Whether `partitions` are still this consumer's: not found lost, and
    /// no newer claim by another member since. Unlike the comparison
    /// before a batch, a metadata shard that does not answer leaves it
    /// [`Ownership::Unknown`]: a worker about to do what cannot be undone
    /// (send answers) waits rather than guess. Once lost, the next
    /// [`FencedConsumer::next`] rebuilds the consumer.
    pub async fn still_ours(&mut self, partitions: &BTreeSet<i32>) -> Ownership {
        let Some(live) = self.live.as_mut() else { return Ownership::Lost("the consumer is closed".into()) };
        let why = match live.lost.clone() {
            Some(why) => why,
            None => match self.ctx.compare_claims(live, partitions).await {
                Ok(None) => return Ownership::Ours,
                Ok(Some(why)) => why,
                Err(e) => return Ownership::Unknown(format!("cannot compare partition claims: {e}")),
            },
        };
        live.lost.get_or_insert(why.clone());
        Ownership::Lost(why)
    }

    /// Stores `offsets` (partition → the next offset to read): the work
    /// before them is durable. librdkafka's auto-commit commits them; a
    /// partition revoked meanwhile refuses them, and its new owner replays
    /// from the committed offset, which is safe.
    pub fn store(&self, offsets: &BTreeMap<i32, i64>) {
        let Some(live) = self.live.as_ref() else { return };
        if let Err(e) = live.consumer.store_offsets(&self.ctx.tpl(offsets)) {
            tracing::debug!(consumer = %self.ctx.options.part, error = %e, "offset store refused");
        }
        let held = live.consumer.context().held(&live.consumer);
        self.ctx.observer.holds(held.len());
    }

    /// Commits `offsets` now rather than at the next auto-commit (not
    /// waited for).
    pub fn commit(&self, offsets: &BTreeMap<i32, i64>) {
        let Some(live) = self.live.as_ref() else { return };
        if let Err(e) = live.consumer.commit(&self.ctx.tpl(offsets), CommitMode::Async) {
            tracing::debug!(consumer = %self.ctx.options.part, error = %e, "offset commit not sent");
        }
    }

    /// Commits the stored offsets synchronously and ends the lease, so the
    /// others take the partitions at once. The process's
    /// readiness no longer waits for it.
    pub async fn close(mut self) {
        self.ctx.health.started(&self.ctx.options.part);
        if let Some(live) = self.live.take() {
            if let Err(e) = live.consumer.commit_consumer_state(CommitMode::Sync) {
                tracing::debug!(consumer = %self.ctx.options.part, error = %e,
                    "final commit had nothing to commit or failed");
            }
            // Closing may wait on a broker.
            let _ = tokio::task::spawn_blocking(move || drop(live)).await;
        }
        if let Some(l) = self.leased.take() {
            l.lease.leave().await;
        }
        self.ctx.observer.holds(0);
        tracing::info!(consumer = %self.ctx.options.part, "consumer stopped");
    }

    /// Makes a consumer (and, the first time, the lease): false when
    /// shutdown came first.
    async fn connect(&mut self, shutdown: &CancellationToken) -> Result<bool, KafkaError> {
        let (k, o) = (&self.ctx.kafka, &self.ctx.options);
        let session = Duration::from_millis(k.session_timeout_ms);
        if self.leased.is_none() {
            let failing = |why: String| self.ctx.health.report(&o.part, Err(why));
            let Some(partitions) = leased::partition_count(k, &o.topic, shutdown, failing).await else {
                return Ok(false);
            };
            let member = o.member.clone().unwrap_or_else(crate::cluster::process_id);
            let lease =
                Lease::start(self.ctx.shards.clone(), o.group.clone(), member, session, o.member_setting);
            self.leased = Some(Leased { lease, partitions });
        }
        let leased = self.leased.as_ref().expect("made above");
        let config = kafka::consumer_config(k, &o.group, o.fetch_wait_ms);
        let consumer: StreamConsumer<Claims> = kafka::create_with(&config, Claims::new(&o.topic))?;
        tracing::info!(consumer = %o.part, group = %o.group, topic = %o.topic,
            member = %leased.lease.member(), partitions = leased.partitions, fetch_wait_ms = o.fetch_wait_ms,
            "assigning its partitions by member leases");
        let lease_changes = leased.lease.changes();
        self.live = Some(Live {
            consumer,
            lease_changes,
            strays_since: None,
            claims_checked: None,
            last_error: None,
            lost: None,
            claimed: Vec::new(),
        });
        Ok(true)
    }

    /// The consumer ends for good: it reports why, holds nothing, and the
    /// process's readiness no longer waits for it (it is failing instead).
    fn give_up(&self, why: String) {
        let part = &self.ctx.options.part;
        self.ctx.health.report(part, Err(why));
        self.ctx.health.started(part);
        self.ctx.observer.holds(0);
    }

    /// Closes the consumer; the next turn makes a new one.
    fn rebuild(&mut self, why: Rebuild) {
        let Some(live) = self.live.take() else { return };
        let part = &self.ctx.options.part;
        self.ctx.observer.holds(0);
        match why {
            Rebuild::Lost(why) => {
                self.ctx.health.report(part, Err(format!("taking its lease's share again: {why}")));
                tracing::warn!(consumer = %part, %why,
                    "this consumer no longer owns its partitions; it stops working on them and is replaced by a new one");
                self.ctx.observer.rebuilt();
            }
            Rebuild::Reshared => {
                tracing::info!(consumer = %part, "the member lease's share changed; a new consumer takes it")
            }
        }
        // Closing stops its fetchers and commits the offsets stored, which
        // may wait on a broker: not on a runtime thread, and not waited for.
        tokio::task::spawn_blocking(move || drop(live));
    }
}
