//! The ingest loop: rounds of commands from the shared fenced consumer
//! (`service::consumer`), applied through the write path, answered, and
//! only then committed.

use futures::future::join_all;
use rdkafka::message::{Message, OwnedMessage};
use schemas::settings::FETCH_WAIT_MS;
use schemas::EntityId;
use service::consumer::{Batch, FencedConsumer, Next, Observer, Options};
use service::http::Problem;
use service::kafka;
use service::serve::sleep_or_stop;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::answers::{Answers, Sent};
use super::command::{parse, Item, Place};
use crate::http::write_problem;
use crate::{Change, Precondition};
use crate::{Outcome, WriteError, Writer};

/// How often the ingest group's lag is read for the gauge.
const LAG_EVERY: Duration = Duration::from_secs(2);

/// The ingest's name in `/health/ready`.
const PART: &str = "ingest";

/// The ingest partitions this writer holds, for the gauge.
#[derive(Debug)]
struct Held(prometheus::IntGauge);

impl Observer for Held {
    fn holds(&self, partitions: usize) {
        self.0.set(partitions as i64);
    }
}

impl Writer {
    /// Starts the ingest consumer when `ingest.enabled`; it stops at
    /// `shutdown` after the round in hand.
    pub fn spawn_ingest(&self, tracker: &TaskTracker, shutdown: CancellationToken) {
        if !self.settings().ingest.enabled {
            return;
        }
        let writer = self.clone();
        tracker.spawn(async move {
            if let Err(e) = run(&writer, shutdown).await {
                writer.inner.health.report(PART, Err(format!("stopped: {e:#}")));
                tracing::error!(error = %format!("{e:#}"), "Kafka ingest stopped");
            }
        });
    }
}

/// Runs the ingest until `shutdown`; an error when it cannot start, or
/// when another process took this one's member name.
async fn run(writer: &Writer, shutdown: CancellationToken) -> anyhow::Result<()> {
    let s = writer.settings();
    let mut answers = Answers::open(s, writer.inner.health.clone()).await?;
    let options = Options {
        part: PART.into(),
        group: s.kafka.ingest_group(),
        topic: s.ingest.topic.clone(),
        fetch_wait_ms: FETCH_WAIT_MS,
        member: s.ingest.member.clone(),
        member_setting: "ingest.member",
        batch_max: s.ingest.batch,
        // What is already fetched joins the round, without waiting.
        batch_wait: Duration::ZERO,
        gates_readiness: false,
    };
    let held = Arc::new(Held(writer.inner.metrics.ingest_partitions.clone()));
    let health = writer.inner.health.clone();
    let mut consumer = FencedConsumer::new(s.kafka.clone(), writer.shards().clone(), health, options, held);
    let mut lag_at: Option<Instant> = None;
    loop {
        if lag_at.is_none_or(|t| t.elapsed() >= LAG_EVERY) {
            lag_at = Some(Instant::now());
            report_lag(writer).await;
        }
        match consumer.next(&shutdown).await? {
            Next::Batch(batch) => {
                if !round(writer, &mut consumer, &mut answers, batch, &shutdown).await {
                    break;
                }
            }
            Next::Idle => {}
            Next::Stop => break,
            Next::Taken(why) => anyhow::bail!("Kafka ingest: {why}"),
        }
    }
    answers.flush();
    consumer.close().await;
    tracing::info!("Kafka ingest stopped");
    Ok(())
}

/// One round: apply its commands (one entity's in their order, different
/// entities at once), answer them, and only then store and commit its
/// offsets. False when stopped mid-round: its offsets were not earned, and
/// a successor replays it (each command's guard makes that safe).
async fn round(
    writer: &Writer,
    consumer: &mut FencedConsumer,
    answers: &mut Answers,
    batch: Batch,
    shutdown: &CancellationToken,
) -> bool {
    // Partitions given anew: their answer partitions are read back anew.
    answers.taken(&batch.claimed);
    let offsets = batch.next_offsets();
    let Some(items) = apply_round(writer, batch.messages, shutdown).await else { return false };
    // Applied (each command once, whoever else applies it: its guard);
    // answered only while the partitions are still ours.
    match answers.send(&items, consumer, shutdown).await {
        Sent::Done => {}
        Sent::Stopped => return false,
        Sent::Lost(why) => {
            tracing::info!(%why, "the round's partitions are no longer this writer's; its successor answers");
            return true;
        }
    }
    consumer.store(&offsets);
    // Committed now, not at the next auto-commit: a crash between a
    // round's replies and its commit sends those replies again, so that
    // window is kept to one request.
    consumer.commit(&offsets);
    consumer.report(Ok(()));
    true
}

/// Applies a round's commands (one entity's in their order, different
/// entities at once); None when stopped before the round was done.
async fn apply_round(
    writer: &Writer,
    messages: Vec<OwnedMessage>,
    shutdown: &CancellationToken,
) -> Option<Vec<Item>> {
    let max = writer.settings().writer.max_body_bytes;
    let mut items: Vec<Item> = messages
        .into_iter()
        .map(|msg| {
            let command = parse(msg.payload(), &Place::of(&msg), max);
            Item { msg, command, result: None }
        })
        .collect();
    let mut chains: BTreeMap<EntityId, Vec<usize>> = BTreeMap::new();
    for (i, item) in items.iter_mut().enumerate() {
        match (&item.command.action, item.command.id) {
            (Ok(_), Some(id)) => chains.entry(id).or_default().push(i),
            (Err(p), _) => {
                writer.inner.metrics.ingest_commands.with_label_values(&["malformed"]).inc();
                item.result = Some(Err(p.clone()));
            }
            (Ok(_), None) => unreachable!("a command that parses names its entity"),
        }
    }
    let items_ref = &items;
    let applied = join_all(chains.into_iter().map(|(id, idx)| async move {
        let mut out = Vec::with_capacity(idx.len());
        for i in idx {
            let Ok((change, pre)) = &items_ref[i].command.action else { unreachable!() };
            out.push((i, apply_command(writer, id, change.clone(), *pre, shutdown).await?));
        }
        Some(out)
    }))
    .await;
    for chain in applied {
        for (i, r) in chain? {
            items[i].result = Some(r);
        }
    }
    Some(items)
}

/// One command through the write path: its outcome, or its problem when
/// it is refused. Transient failures (a shard down, overload) are tried
/// again until they pass; None when stopped meanwhile.
async fn apply_command(
    writer: &Writer,
    id: EntityId,
    change: Change,
    pre: Precondition,
    shutdown: &CancellationToken,
) -> Option<Result<Outcome, Problem>> {
    let mut backoff = Duration::from_millis(50);
    loop {
        if shutdown.is_cancelled() {
            return None;
        }
        let result = match writer.admit(1) {
            None => None,
            Some(_admitted) => Some(writer.write_one(id, change.clone(), pre).await),
        };
        let transient = match &result {
            None => true,
            Some(Err(WriteError::Store(e))) => e.is_transient(),
            Some(Err(WriteError::ShardFailed { source, .. })) => source.is_transient(),
            // Every command carries a guard: the retry learns the outcome.
            Some(Err(WriteError::OutcomeUnknown { .. })) => true,
            Some(_) => false,
        };
        if !transient {
            let r = result.expect("not transient, so written or refused");
            let kind = match &r {
                Ok(o) if o.replayed => "duplicate",
                Ok(_) => "applied",
                Err(_) => "refused",
            };
            writer.inner.metrics.ingest_commands.with_label_values(&[kind]).inc();
            return Some(r.map_err(write_problem));
        }
        tracing::debug!(id = %id, "ingest command met a transient failure; trying again");
        if !sleep_or_stop(shutdown, backoff).await {
            return None;
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Reads the ingest group's lag for the gauge.
async fn report_lag(writer: &Writer) {
    let s = writer.settings();
    match kafka::group_lag_on(&s.kafka, &s.kafka.ingest_group(), &s.ingest.topic).await {
        Ok(parts) => writer.inner.metrics.ingest_lag.set(parts.iter().map(|p| p.lag()).sum()),
        Err(e) => tracing::debug!(error = %e, "ingest lag not read"),
    }
}
