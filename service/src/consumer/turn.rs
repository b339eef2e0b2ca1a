//! One consumer (one group member) and a turn of its loop: a batch, an
//! idle tick, or a finding that it must be replaced.

use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::{Offset, TopicPartitionList};
use schemas::settings::KafkaSettings;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use storage::fences::Claim;
use storage::{Shards, StoreError};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::batch::{self, Batch};
use super::leased::{self, Follow, Leased};
use super::spec::{Next, Observer, Options};
use crate::claims::Claims;
use crate::health::Health;
use crate::leases::View;
use crate::serve::sleep_or_stop;

/// How long an idle consumer waits for a message before it checks its
/// leases and claims and reports.
const IDLE_TICK: Duration = Duration::from_millis(250);

/// How often an idle consumer compares its partitions' claims (a busy one
/// compares them before every batch).
const CLAIMS_EVERY: Duration = Duration::from_secs(1);

/// How long a consumer may keep receiving events of partitions it does not
/// hold before it is taken as confused and rebuilt.
const STRAYS_FOR: Duration = Duration::from_secs(2);

/// How long a consumer error keeps the consumer reported failing when
/// nothing was worked on since (errors come every few hundred ms while the
/// broker is away, idle ticks in between).
const ERRORS_STAND_FOR: Duration = Duration::from_secs(5);

/// What every consumer of one fenced consumer shares.
pub(super) struct Ctx {
    pub(super) kafka: KafkaSettings,
    pub(super) shards: Shards,
    pub(super) health: Health,
    pub(super) options: Options,
    pub(super) observer: Arc<dyn Observer>,
    /// Whether it has held its partitions once (readiness, see
    /// [`Options::gates_readiness`]).
    pub(super) started: AtomicBool,
}

/// One rdkafka consumer (one member) and what its loop keeps.
pub(super) struct Live {
    pub(super) consumer: StreamConsumer<Claims>,
    /// Wakes the loop when the members change.
    pub(super) lease_changes: watch::Receiver<View>,
    pub(super) strays_since: Option<Instant>,
    pub(super) claims_checked: Option<Instant>,
    pub(super) last_error: Option<Instant>,
    /// Why the partitions are known lost, once the worker found them so
    /// (or `still_ours` did): the next turn rebuilds.
    pub(super) lost: Option<String>,
    /// Claims made since the last batch.
    pub(super) claimed: Vec<Claim>,
}

/// What one turn of the loop came to.
pub(super) enum Step {
    Yield(Next),
    Again,
    Rebuild(Rebuild),
    Taken(String),
}

/// Why a consumer is replaced.
pub(super) enum Rebuild {
    /// Its partitions are no longer its own; why.
    Lost(String),
    /// Its lease's share changed; a new consumer takes the new one.
    Reshared,
}

impl Ctx {
    /// One turn of the consumer loop: a batch, an idle tick, or a finding.
    pub(super) async fn step(&self, live: &mut Live, leased: &Leased, shutdown: &CancellationToken) -> Step {
        if let Some(why) = live.lost.take() {
            return Step::Rebuild(Rebuild::Lost(why));
        }
        match leased::follow(&live.consumer, leased, &self.options.topic) {
            Ok(Follow::Holds) => {}
            Ok(Follow::Assigned(partitions)) => {
                tracing::info!(consumer = %self.options.part, member = %leased.lease.member(), ?partitions,
                    "applying the member lease's share");
                self.observer.holds(partitions.len());
            }
            Ok(Follow::Reshare) => return Step::Rebuild(Rebuild::Reshared),
            Err(why) => return Step::Taken(why),
        }
        let first = {
            let Live { consumer, lease_changes, .. } = &mut *live;
            tokio::select! {
                m = consumer.recv() => m.map(|m| m.detach()),
                _ = shutdown.cancelled() => return Step::Yield(Next::Stop),
                // Newly assigned partitions are claimed at once: nothing of
                // theirs is handed out before, and the process may be
                // waiting for them to be ready.
                _ = consumer.context().assignment() => {
                    self.record_claims(live).await;
                    return Step::Again;
                }
                Ok(()) = lease_changes.changed() => return Step::Again,
                _ = tokio::time::sleep(IDLE_TICK) => return self.idle(live).await,
            }
        };
        let first = match first {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(consumer = %self.options.part, error = %e, "consumer error");
                self.health.report(&self.options.part, Err(format!("consumer error: {e}")));
                live.last_error = Some(Instant::now());
                return Step::Again;
            }
        };
        let mut messages = vec![first];
        batch::gather(&live.consumer, &mut messages, self.options.batch_max, self.options.batch_wait).await;
        for m in &messages {
            self.observer.fetched(m.partition());
        }
        let held = live.consumer.context().held(&live.consumer);
        if let Some(step) = self.drop_strays(live, &mut messages, &held) {
            return step;
        }
        let partitions: BTreeSet<i32> = messages.iter().map(|m| m.partition()).collect();
        match self.claims_for_batch(live, &held, &partitions, shutdown).await {
            Ok(claims) => {
                let claimed = std::mem::take(&mut live.claimed);
                Step::Yield(Next::Batch(Batch { messages, claims, claimed }))
            }
            Err(step) => step,
        }
    }

    /// Nothing arrived: the claims are compared, and an idle consumer with
    /// no consumer error for a while reports itself well.
    async fn idle(&self, live: &mut Live) -> Step {
        let held = live.consumer.context().held(&live.consumer);
        if let Some(why) = self.fence(live, &held, false).await {
            return Step::Rebuild(Rebuild::Lost(why));
        }
        if live.last_error.is_none_or(|t| t.elapsed() > ERRORS_STAND_FOR) {
            self.health.report(&self.options.part, Ok(()));
        }
        self.observer.holds(held.len());
        Step::Yield(Next::Idle)
    }

    /// Never hands out a partition this consumer does not hold. A batch can
    /// straddle a revocation (those events are the new owner's now);
    /// strays that keep coming mean the consumer fetches what it no longer
    /// owns, and it is rebuilt. Some step when the batch is not handed out.
    fn drop_strays(
        &self,
        live: &mut Live,
        messages: &mut Vec<OwnedMessage>,
        held: &BTreeSet<i32>,
    ) -> Option<Step> {
        let before = messages.len();
        messages.retain(|m| held.contains(&m.partition()));
        if messages.len() == before {
            live.strays_since = None;
            return None;
        }
        let since = *live.strays_since.get_or_insert_with(Instant::now);
        tracing::debug!(consumer = %self.options.part, dropped = before - messages.len(), ?held,
            "events of partitions not held; not handed out");
        if since.elapsed() > STRAYS_FOR {
            return Some(Step::Rebuild(Rebuild::Lost(format!(
                "it has been given events of partitions it does not hold for {STRAYS_FOR:?} (it holds {held:?})"
            ))));
        }
        messages.is_empty().then_some(Step::Again)
    }

    /// The claims on a batch's `partitions`, compared first: a consumer
    /// replaced by another stops within one batch, so a stale consumer
    /// cannot apply old events after the new owner applied newer ones
    /// (which would bring back an index row a newer event deleted) for
    /// longer than a batch takes. Nothing is handed out without this
    /// consumer's claims on its partitions: while the metadata shard does
    /// not take them, it waits.
    async fn claims_for_batch(
        &self,
        live: &mut Live,
        held: &BTreeSet<i32>,
        partitions: &BTreeSet<i32>,
        shutdown: &CancellationToken,
    ) -> Result<Vec<Claim>, Step> {
        let mut backoff = Duration::from_millis(50);
        loop {
            if let Some(why) = self.fence(live, held, true).await {
                return Err(Step::Rebuild(Rebuild::Lost(why)));
            }
            if let Some(claims) = live.consumer.context().claims_for(partitions) {
                return Ok(claims);
            }
            self.health.report(&self.options.part, Err("cannot record partition claims".into()));
            if !sleep_or_stop(shutdown, backoff).await {
                return Err(Step::Yield(Next::Stop));
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// The partition claims (see [`crate::claims`]): records this
    /// consumer's new assignments, then (every time when `always`, else at
    /// most once per CLAIMS_EVERY) whether another consumer has claimed one
    /// of `held` since. A metadata shard that does not answer decides
    /// nothing: the claims are written and compared at the next chance.
    async fn fence(&self, live: &mut Live, held: &BTreeSet<i32>, always: bool) -> Option<String> {
        if !self.record_claims(live).await {
            return None;
        }
        if (!always && live.claims_checked.is_some_and(|t| t.elapsed() < CLAIMS_EVERY)) || held.is_empty() {
            return None;
        }
        let why = self.claimed_by_others(live, held).await;
        if why.is_none() {
            live.claims_checked = Some(Instant::now());
        }
        why
    }

    /// Why `partitions` are another member's now, if one claimed them
    /// since (None too when the metadata shard does not answer).
    async fn claimed_by_others(&self, live: &Live, partitions: &BTreeSet<i32>) -> Option<String> {
        match self.compare_claims(live, partitions).await {
            Ok(why) => why,
            Err(e) => {
                tracing::debug!(consumer = %self.options.part, error = %e, "cannot compare partition claims");
                None
            }
        }
    }

    /// Why `partitions` are another member's now, if one claimed them
    /// since; an error when the metadata shard does not answer.
    pub(super) async fn compare_claims(
        &self,
        live: &Live,
        partitions: &BTreeSet<i32>,
    ) -> Result<Option<String>, StoreError> {
        let watch = live.consumer.context();
        watch.claimed_by_others(&self.shards, &self.options.group, partitions).await
    }

    /// Records claims on the partitions assigned since the last call;
    /// false if the metadata shard did not take them (tried again later).
    /// The first time the consumer holds its assignment, claimed, the
    /// process's readiness stops waiting for it.
    async fn record_claims(&self, live: &mut Live) -> bool {
        let watch = live.consumer.context();
        match watch.record_claims(&self.shards, &self.options.group).await {
            Ok(new) => {
                let fresh = !new.is_empty();
                live.claimed.extend(new);
                let starts = self.options.gates_readiness
                    && watch.settled()
                    && !self.started.swap(true, Ordering::Relaxed);
                if fresh || starts {
                    // Counted before the process says it is ready.
                    self.observer.holds(watch.held(&live.consumer).len());
                }
                if starts {
                    let held = watch.held(&live.consumer);
                    tracing::info!(consumer = %self.options.part, partitions = ?held, "holds its partitions");
                    self.health.started(&self.options.part);
                }
                true
            }
            Err(e) => {
                tracing::debug!(consumer = %self.options.part, error = %e, "cannot record partition claims yet");
                false
            }
        }
    }

    /// `offsets` as a partition list of this consumer's topic.
    pub(super) fn tpl(&self, offsets: &BTreeMap<i32, i64>) -> TopicPartitionList {
        let mut tpl = TopicPartitionList::new();
        for (p, o) in offsets {
            let _ = tpl.add_partition_offset(&self.options.topic, *p, Offset::Offset(*o));
        }
        tpl
    }
}
