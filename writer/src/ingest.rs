//! Kafka ingest: producers write JSON commands to `ingest.topic`; every
//! writer process is a member of one consumer group (`bagstore-ingest`)
//! and applies each command through the same write path as HTTP.
//!
//! A command (README "Kafka ingest (for producers)"):
//! `{"op": "put" | "patch" | "delete", "id": "<32 hex>", "properties": {…}
//! (put), "patch": {…} (patch: a merge patch, or `$`-operators), "upsert":
//! bool (patch), "if_match": N, "idempotency_key": "…", "correlation_id":
//! "…"}`.
//!
//! Exactly once in effect: every command is a guarded write (see
//! `storage::idempotency`), its record committed in the transaction of the
//! write. The guard's key is the command's `idempotency_key` when it has
//! one (a producer's resend of a command is then applied once), else the
//! message's place (topic, partition, offset: a redelivery after a crash or
//! a rebalance is applied once). A replay answers what the first apply did.
//!
//! A round: take up to `ingest.batch` messages, apply them (one entity's
//! commands in their order, different entities at once), send each refused
//! or malformed command to `<topic>.dlq` with its reason and each outcome
//! to the reply topic (keyed by `correlation_id`, when the command has
//! one), await those acknowledgements, and only then store the offsets
//! (librdkafka's auto-commit commits what was stored). A crash anywhere
//! replays at most the round in hand, and the replay writes nothing new.
//!
//! Answered once: a replayed round must not answer again what its first
//! try already put on the reply or dead-letter topic. Kafka's own answer,
//! a transaction over the answers and the offsets, needs a broker that
//! hides aborted messages from `read_committed` readers, and neither
//! broker bagstore is tested on does (tansu 0.6 and librdkafka's mock
//! cluster answer every fetch with an empty aborted-transactions list). So
//! each answer goes to the partition of its command's partition (modulo
//! the answer topic's partitions) with a header naming its command
//! ([`SOURCE_HEADER`]), and a member that is given a partition first reads
//! that answer partition back from its end, down to an answer for an
//! offset before where it resumes: everything after that is the answers a
//! predecessor sent but never committed, and they are not sent again.
//! Answers for offsets before a committed offset all precede answers for
//! offsets after it (a round's answers are acknowledged before its offsets
//! are committed), so the read stops at the first older answer it meets.
//! The same read, after a round's sends failed, finds which of them landed.
//! A revocation waits for the round in hand (librdkafka runs the rebalance
//! inside `recv`, which a round does not call), and a member that was killed
//! loses its partitions only after the session timeout, so its answers have
//! landed before its successor reads.
//!
//! One member the group replaced without telling it (a broker that goes on
//! taking its heartbeats, see [`service::membership`]) would go on applying
//! and answering beside its successor. Its applies are harmless (each
//! command's guard: the second try finds the first's record), its answers
//! are not. So each member records a claim on every partition it is given
//! before it applies anything of it (`storage::fences`, the indexers'
//! claims), and compares the claims after applying a round and before
//! answering it: a member that finds a newer claim answers nothing more
//! and rejoins as a new member. What is left is a race of milliseconds: an
//! answer sent right after a comparison that a successor's claim and read
//! back then overtake.

use futures::future::join_all;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{Offset, TopicPartitionList};
use schemas::{idempotency, patch, EntityId};
use serde_json::{json, Map, Value as JsonValue};
use service::http::Problem;
use service::kafka;
use service::membership::Membership;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::http::{entity_body, write_problem};
use crate::{Change, Guard, Outcome, Precondition, WriteError, Writer};

/// How often the ingest group's lag is read for the gauge.
const LAG_EVERY: Duration = Duration::from_secs(2);

/// How long a consumer error keeps an idle ingest reported as failing.
const ERRORS_STAND_FOR: Duration = Duration::from_secs(10);

/// Longest accepted `correlation_id`.
pub const MAX_CORRELATION_ID_BYTES: usize = 255;

/// The header on every reply and dead letter that names the command it
/// answers: `<topic>/<partition>/<offset>` of the command's message.
pub const SOURCE_HEADER: &str = "bagstore-ingest-source";

/// How many offsets of an answer partition are read back at a time.
const READ_BACK_WINDOW: i64 = 512;

/// Where a message was read: the default guard of a command without an
/// `idempotency_key`, and the dead-letter record's `source`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
}

impl Place {
    /// The [`SOURCE_HEADER`] value naming this place.
    pub fn header(&self) -> String {
        format!("{}/{}/{}", self.topic, self.partition, self.offset)
    }

    /// Reads a [`SOURCE_HEADER`] value (topic names cannot hold `/`).
    pub fn from_header(value: &[u8]) -> Option<Place> {
        let text = std::str::from_utf8(value).ok()?;
        let mut parts = text.rsplitn(3, '/');
        let offset = parts.next()?.parse().ok()?;
        let partition = parts.next()?.parse().ok()?;
        let topic = parts.next().filter(|t| !t.is_empty())?.to_string();
        Some(Place { topic, partition, offset })
    }
}

/// A command as read from the topic: what to apply, or why not.
#[derive(Debug)]
pub struct Command {
    pub correlation_id: Option<String>,
    /// The entity, when the command names one that parses.
    pub id: Option<EntityId>,
    pub action: Result<(Change, Precondition), Problem>,
}

fn malformed(detail: impl Into<String>) -> Problem {
    Problem::bad_request("bad-command", detail)
}

/// Reads one message's payload as a command. Never fails: a command that
/// cannot be applied carries its problem (what the dead-letter topic and
/// the reply say).
pub fn parse(payload: Option<&[u8]>, place: &Place, max_body_bytes: usize) -> Command {
    let doc: JsonValue = match payload.map(serde_json::from_slice) {
        None => return refused(None, None, malformed("the message has no value")),
        Some(Err(e)) => return refused(None, None, malformed(format!("the message is not JSON: {e}"))),
        Some(Ok(doc)) => doc,
    };
    let JsonValue::Object(mut map) = doc else {
        return refused(None, None, malformed("a command must be a JSON object"));
    };
    // Read first, so even a command refused for another reason is answered.
    let correlation_id = match map.remove("correlation_id") {
        None => None,
        Some(JsonValue::String(c)) if !c.is_empty() && c.len() <= MAX_CORRELATION_ID_BYTES => Some(c),
        Some(_) => {
            return refused(
                None,
                None,
                malformed(format!(
                    "\"correlation_id\" must be a string of 1 to {MAX_CORRELATION_ID_BYTES} bytes"
                )),
            )
        }
    };
    let id = match map.get("id") {
        Some(JsonValue::String(s)) => EntityId::parse(s).ok(),
        _ => None,
    };
    let action = action(&map, place, max_body_bytes);
    Command { correlation_id, id, action }
}

fn refused(correlation_id: Option<String>, id: Option<EntityId>, p: Problem) -> Command {
    Command { correlation_id, id, action: Err(p) }
}

/// The command's change and precondition (with its guard), from its
/// fields other than `correlation_id`.
fn action(
    map: &Map<String, JsonValue>,
    place: &Place,
    max_body_bytes: usize,
) -> Result<(Change, Precondition), Problem> {
    const FIELDS: [&str; 7] = ["op", "id", "properties", "patch", "upsert", "if_match", "idempotency_key"];
    if let Some(unknown) = map.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(malformed(format!("unknown field {unknown:?} (a command has {})", FIELDS.join(", "))));
    }
    let op = match map.get("op") {
        Some(JsonValue::String(op)) => op.as_str(),
        _ => return Err(malformed("\"op\" must be \"put\", \"patch\" or \"delete\"")),
    };
    match map.get("id") {
        Some(JsonValue::String(s)) => {
            EntityId::parse(s).map_err(|e| Problem::bad_request("bad-id", format!("\"id\": {e}")))?;
        }
        _ => return Err(Problem::bad_request("bad-id", "\"id\" must be a string of 32 hex digits")),
    }
    let mut pre = Precondition::default();
    match map.get("if_match") {
        None | Some(JsonValue::Null) => {}
        Some(v) => {
            pre.if_version =
                Some(v.as_u64().ok_or_else(|| malformed("\"if_match\" must be a version number"))?)
        }
    }
    let only = |allowed: &[&str]| -> Result<(), Problem> {
        for field in ["properties", "patch", "upsert"] {
            if map.contains_key(field) && !allowed.contains(&field) {
                return Err(malformed(format!("a {op} command has no {field:?}")));
            }
        }
        Ok(())
    };
    let change = match op {
        "put" => {
            only(&["properties"])?;
            let props =
                map.get("properties").cloned().ok_or_else(|| malformed("a put needs \"properties\""))?;
            if props.as_object().is_some_and(|o| o.contains_key("id")) {
                return Err(malformed(
                    "\"properties\" may not hold \"id\" (the command's \"id\" names the entity)",
                ));
            }
            let (_, bag) = entity_body(props, Some(max_body_bytes))?;
            Change::Put(bag)
        }
        "patch" => {
            only(&["patch", "upsert"])?;
            let doc = map.get("patch").ok_or_else(|| malformed("a patch needs \"patch\""))?;
            let upsert = match map.get("upsert") {
                None => false,
                Some(JsonValue::Bool(b)) => *b,
                Some(_) => return Err(malformed("\"upsert\" must be true or false")),
            };
            let parsed = match operator_form(doc)? {
                true => patch::parse_operators(doc),
                false => patch::parse_merge(doc),
            };
            let parsed = parsed.map_err(|e| Problem::bad_request("bad-patch", e.to_string()))?;
            Change::Patch { patch: std::sync::Arc::new(parsed), upsert }
        }
        "delete" => {
            only(&[])?;
            Change::Delete
        }
        other => return Err(malformed(format!("unknown op {other:?}: \"put\", \"patch\" or \"delete\""))),
    };
    let key = match map.get("idempotency_key") {
        None | Some(JsonValue::Null) => format!("@{}/{}/{}", place.topic, place.partition, place.offset),
        Some(JsonValue::String(k)) => {
            idempotency::check_key(k).map_err(|e| Problem::bad_request("bad-idempotency-key", e))?;
            format!("key:{k}")
        }
        Some(_) => {
            return Err(Problem::bad_request("bad-idempotency-key", "\"idempotency_key\" must be a string"))
        }
    };
    // The request under the key: the command without its correlation id
    // (a producer's resend may carry a new one), in canonical JSON.
    let body = serde_json::to_vec(map).unwrap_or_default();
    pre.guard = Some(Guard {
        key: idempotency::key_hash(&format!("kafka ingest {key}")),
        request: idempotency::request_hash("INGEST", &body),
    });
    Ok((change, pre))
}

/// Whether a patch document is in operator form (every key starts with
/// `$`) or a merge patch (none does); a mix is refused.
fn operator_form(doc: &JsonValue) -> Result<bool, Problem> {
    let Some(obj) = doc.as_object() else {
        return Err(Problem::bad_request("bad-patch", "\"patch\" must be a JSON object"));
    };
    let operators = obj.keys().filter(|k| k.starts_with('$')).count();
    match operators {
        0 => Ok(false),
        n if n == obj.len() => Ok(true),
        _ => Err(Problem::bad_request(
            "bad-patch",
            "\"patch\" mixes $-operators with property names: use one form (a merge patch, or operators)",
        )),
    }
}

/// The reply to a command: its outcome, keyed by its correlation id. A
/// replay answers exactly as the first apply did (a redelivered message
/// must not get a different answer), so a producer's resend of a keyed
/// command is known by its version, the first one's.
pub fn reply(correlation_id: &str, id: Option<EntityId>, result: &Result<Outcome, Problem>) -> JsonValue {
    match result {
        Ok(o) => json!({
            "correlation_id": correlation_id, "ok": true, "id": o.id.to_hex(), "version": o.version,
            "created": o.created,
        }),
        Err(p) => json!({
            "correlation_id": correlation_id, "ok": false, "id": id.map(|i| i.to_hex()), "problem": p.to_json(),
        }),
    }
}

/// A dead-letter record: the reason, where the command was, and the
/// command as it was sent.
pub fn dead_letter(problem: &Problem, place: &Place, payload: Option<&[u8]>) -> JsonValue {
    json!({
        "reason": problem.detail,
        "problem": problem.to_json(),
        "source": {"topic": place.topic, "partition": place.partition, "offset": place.offset},
        "command": payload.map(|p| String::from_utf8_lossy(p).into_owned()),
    })
}

/// One message of a round and what became of it.
struct Item {
    msg: OwnedMessage,
    command: Command,
    result: Option<Result<Outcome, Problem>>,
}

/// Which answer topic a message goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outlet {
    Reply,
    Dead,
}

/// The answer topics and their partition counts.
struct Outlets {
    reply: Option<(String, i32)>,
    dead: (String, i32),
}

impl Outlets {
    fn of(&self, outlet: Outlet) -> Option<&(String, i32)> {
        match outlet {
            Outlet::Reply => self.reply.as_ref(),
            Outlet::Dead => Some(&self.dead),
        }
    }
}

/// The answer partition of a command's partition: a command's answers
/// always go to one partition, so one member writes it at a time.
fn answer_partition(partition: i32, partitions: i32) -> i32 {
    partition.rem_euclid(partitions.max(1))
}

/// The offsets, from where this member resumed one ingest partition, whose
/// reply or dead letter is already on its topic: answers a predecessor (or
/// a failed send of this member's) put there.
#[derive(Debug, Default)]
struct Answered {
    at: BTreeSet<(Outlet, i64)>,
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
            if let Err(e) = writer.ingest(shutdown).await {
                writer.inner.health.report("ingest", Err(format!("cannot start: {e}")));
                tracing::error!(error = %e, "Kafka ingest could not start");
            }
        });
    }

    /// Runs the ingest consumer until `shutdown`. A consumer that lost its
    /// partitions (see [`service::membership`]) is closed, and a new one
    /// joins in its place.
    async fn ingest(&self, shutdown: CancellationToken) -> Result<(), rdkafka::error::KafkaError> {
        let s = self.settings();
        let (k, topic) = (&s.kafka, &s.ingest.topic);
        let group = k.ingest_group();
        let producer: FutureProducer = kafka::create(&kafka::producer_config(k))?;
        let outlets = self.outlets().await?;
        loop {
            let mut config = kafka::consumer_config(k, &group, schemas::settings::FETCH_WAIT_MS);
            // The statistics feed the membership watch.
            config.set("statistics.interval.ms", "1000");
            let watch = Membership::new(Duration::from_millis(k.session_timeout_ms), topic);
            let consumer: StreamConsumer<Membership> = kafka::create_with(&config, watch)?;
            consumer.subscribe(&[topic])?;
            tracing::info!(%topic, %group, "Kafka ingest joined its group");
            match self.consume_ingest(&consumer, &producer, &outlets, &group, &shutdown).await {
                None => break,
                Some(why) => {
                    self.inner.health.report("ingest", Err(format!("rejoining its group: {why}")));
                    tracing::warn!(%why,
                        "the Kafka ingest no longer owns its partitions; it stops applying them and rejoins as a new member");
                    // Closing leaves the group, which may wait on a broker:
                    // not on a runtime thread, and not waited for.
                    tokio::task::spawn_blocking(move || drop(consumer));
                }
            }
        }
        // Nothing of this member's may land after a successor read back.
        if let Err(e) = producer.flush(Duration::from_secs(5)) {
            tracing::warn!(error = %e, "ingest answers still unsent at stop");
        }
        tracing::info!("Kafka ingest stopped");
        Ok(())
    }

    /// The consumer loop, until `shutdown` (None, after the final commit)
    /// or until `consumer` is found to have lost its partitions (why).
    async fn consume_ingest(
        &self,
        consumer: &StreamConsumer<Membership>,
        producer: &FutureProducer,
        outlets: &Outlets,
        group: &str,
        shutdown: &CancellationToken,
    ) -> Option<String> {
        let s = self.settings();
        let topic = &s.ingest.topic;
        // Per ingest partition held: what its answer partitions already hold.
        let mut answered: BTreeMap<i32, Answered> = BTreeMap::new();
        let mut lag_at: Option<Instant> = None;
        let mut last_error: Option<Instant> = None;
        loop {
            if lag_at.is_none_or(|t| t.elapsed() >= LAG_EVERY) {
                lag_at = Some(Instant::now());
                self.report_ingest_lag(group).await;
            }
            let first = tokio::select! {
                m = consumer.recv() => m,
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(LAG_EVERY) => {
                    let Some(fresh) = self.claim_assigned(consumer, group, shutdown).await else { break };
                    for p in fresh {
                        answered.remove(&p);
                    }
                    let held = consumer.context().held(consumer);
                    if let Some(why) = self.ingest_lost(consumer, group, &held).await {
                        return Some(why);
                    }
                    // Idle, and no consumer error for a while: well.
                    if last_error.is_none_or(|t| t.elapsed() > ERRORS_STAND_FOR) {
                        self.inner.health.report("ingest", Ok(()));
                    }
                    continue;
                }
            };
            let mut batch = match first {
                Ok(m) => vec![m.detach()],
                Err(e) => {
                    last_error = Some(Instant::now());
                    self.inner.health.report("ingest", Err(format!("consumer error: {e}")));
                    tracing::warn!(error = %e, "ingest consumer error");
                    continue;
                }
            };
            // What is already fetched joins the round, without waiting.
            while batch.len() < s.ingest.batch {
                match tokio::time::timeout(Duration::ZERO, consumer.recv()).await {
                    Ok(Ok(m)) => batch.push(m.detach()),
                    _ => break,
                }
            }
            // A round can straddle a revocation: those commands are the new
            // owner's now (it replays them; their guards make that safe).
            let held = consumer.context().held(consumer);
            batch.retain(|m| held.contains(&m.partition()));
            // Newly assigned partitions are claimed before anything of
            // theirs is applied, and their answer partitions read back anew.
            let Some(fresh) = self.claim_assigned(consumer, group, shutdown).await else { break };
            for p in fresh {
                answered.remove(&p);
            }
            if batch.is_empty() {
                continue;
            }
            // Stopped mid-round: its offsets were not earned.
            let Some(items) = self.apply_round(batch, shutdown).await else { break };
            // Applied (each command once, whoever else applies it: its
            // guard). Answered only while the partitions are still ours: a
            // member the group replaced without telling it stops here, and
            // its successor, which claimed them first, answers.
            let round: BTreeSet<i32> = items.iter().map(|i| i.msg.partition()).collect();
            if let Some(why) = self.ingest_lost(consumer, group, &round).await {
                return Some(why);
            }
            if self.send_outcomes(&items, producer, outlets, &mut answered, shutdown).await.is_none() {
                break;
            }
            let mut tpl = TopicPartitionList::new();
            for (p, o) in next_offsets(&items) {
                let _ = tpl.add_partition_offset(topic, p, Offset::Offset(o));
            }
            if let Err(e) = consumer.store_offsets(&tpl) {
                tracing::debug!(error = %e, "ingest offset store refused (a partition was revoked)");
            }
            // Committed now, not at the next auto-commit: a crash between a
            // round's replies and its commit sends those replies again, so
            // that window is kept to one request.
            if let Err(e) = consumer.commit(&tpl, CommitMode::Async) {
                tracing::debug!(error = %e, "ingest offset commit not sent");
            }
            self.inner.health.report("ingest", Ok(()));
        }
        if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
            tracing::debug!(error = %e, "final ingest commit had nothing to commit or failed");
        }
        consumer.unsubscribe();
        None
    }

    /// Records claims on the partitions assigned since the last call (tried
    /// again until the metadata shard takes them); the partitions claimed,
    /// or None when stopped first.
    async fn claim_assigned(
        &self,
        consumer: &StreamConsumer<Membership>,
        group: &str,
        shutdown: &CancellationToken,
    ) -> Option<Vec<i32>> {
        let mut backoff = Duration::from_millis(100);
        loop {
            match consumer.context().record_claims(self.shards(), group).await {
                Ok(claimed) => return Some(claimed),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot record the ingest partition claims yet");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = shutdown.cancelled() => return None,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// Why `consumer` no longer owns `partitions`, if it does not: what
    /// librdkafka's signs say ([`Membership::lost`]), or another member's
    /// newer claim. A metadata shard that does not answer decides nothing.
    async fn ingest_lost(
        &self,
        consumer: &StreamConsumer<Membership>,
        group: &str,
        partitions: &BTreeSet<i32>,
    ) -> Option<String> {
        if let Some(why) = consumer.context().lost(consumer) {
            return Some(why);
        }
        match consumer.context().claimed_by_others(self.shards(), group, partitions).await {
            Ok(why) => why,
            Err(e) => {
                tracing::debug!(error = %e, "cannot compare the ingest partition claims");
                None
            }
        }
    }

    /// Applies a round's commands (one entity's in their order, different
    /// entities at once); None when stopped before the round was done.
    async fn apply_round(&self, batch: Vec<OwnedMessage>, shutdown: &CancellationToken) -> Option<Vec<Item>> {
        let max = self.settings().writer.max_body_bytes;
        let mut items: Vec<Item> = batch
            .into_iter()
            .map(|msg| {
                let place = place_of(&msg);
                let command = parse(msg.payload(), &place, max);
                Item { msg, command, result: None }
            })
            .collect();
        let mut chains: BTreeMap<EntityId, Vec<usize>> = BTreeMap::new();
        for (i, item) in items.iter_mut().enumerate() {
            match (&item.command.action, item.command.id) {
                (Ok(_), Some(id)) => chains.entry(id).or_default().push(i),
                (Err(p), _) => item.result = Some(Err(p.clone())),
                (Ok(_), None) => unreachable!("a command that parses names its entity"),
            }
        }
        let items_ref = &items;
        let applied = join_all(chains.into_iter().map(|(id, idx)| async move {
            let mut out = Vec::with_capacity(idx.len());
            for i in idx {
                let Ok((change, pre)) = &items_ref[i].command.action else { unreachable!() };
                match self.apply_command(id, change.clone(), *pre, shutdown).await {
                    Some(r) => out.push((i, r)),
                    None => return None,
                }
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
        &self,
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
            let result = match self.admit(1) {
                None => None,
                Some(_admitted) => Some(self.write_one(id, change.clone(), pre).await),
            };
            let transient = match &result {
                None => true,
                Some(Err(WriteError::Store(e))) => e.is_transient(),
                Some(Err(WriteError::ShardFailed { source, .. })) => source.is_transient(),
                Some(_) => false,
            };
            if !transient {
                let r = result.expect("not transient, so written or refused");
                let kind = match &r {
                    Ok(o) if o.replayed => "duplicate",
                    Ok(_) => "applied",
                    Err(_) => "refused",
                };
                self.inner.metrics.ingest_commands.with_label_values(&[kind]).inc();
                return Some(r.map_err(write_problem));
            }
            tracing::debug!(id = %id, "ingest command met a transient failure; trying again");
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = shutdown.cancelled() => return None,
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// Sends the round's dead letters and replies that are not on their
    /// topics yet, and waits for Kafka to acknowledge them all; after a
    /// failed send, reads back which landed and sends the rest. None when
    /// stopped first.
    async fn send_outcomes(
        &self,
        items: &[Item],
        producer: &FutureProducer,
        outlets: &Outlets,
        answered: &mut BTreeMap<i32, Answered>,
        shutdown: &CancellationToken,
    ) -> Option<()> {
        // Where this round resumes each partition: answers from there on
        // may already be on the topics.
        let mut resumes: BTreeMap<i32, i64> = BTreeMap::new();
        for item in items {
            let e = resumes.entry(item.msg.partition()).or_insert(i64::MAX);
            *e = (*e).min(item.msg.offset());
        }
        // (outlet, place, key, value) of every answer the round owes.
        let mut owed: Vec<(Outlet, Place, Vec<u8>, Vec<u8>)> = Vec::new();
        for item in items {
            let result = item.result.as_ref().expect("every command has a result");
            let place = place_of(&item.msg);
            if let Err(p) = result {
                if item.command.action.is_err() {
                    self.inner.metrics.ingest_commands.with_label_values(&["malformed"]).inc();
                }
                let value = dead_letter(p, &place, item.msg.payload());
                let key = item.msg.key().unwrap_or_default().to_vec();
                owed.push((Outlet::Dead, place.clone(), key, value.to_string().into_bytes()));
            }
            if let (Some(c), Some(_)) = (&item.command.correlation_id, &outlets.reply) {
                let value = reply(c, item.command.id, result);
                owed.push((Outlet::Reply, place, c.clone().into_bytes(), value.to_string().into_bytes()));
            }
        }
        let mut backoff = Duration::from_millis(100);
        loop {
            for (&p, &from) in &resumes {
                if let std::collections::btree_map::Entry::Vacant(e) = answered.entry(p) {
                    e.insert(self.read_back(outlets, p, from, shutdown).await?);
                }
            }
            owed.retain(|(outlet, place, _, _)| {
                !answered[&place.partition].at.contains(&(*outlet, place.offset))
            });
            if owed.is_empty() {
                break;
            }
            let sends = owed.iter().map(|(outlet, place, key, value)| {
                let (topic, partitions) = outlets.of(*outlet).expect("owed only where it goes");
                let header = place.header();
                let record = FutureRecord::to(topic)
                    .partition(answer_partition(place.partition, *partitions))
                    .key(key)
                    .payload(value)
                    .headers(OwnedHeaders::new().insert(Header { key: SOURCE_HEADER, value: Some(&header) }));
                producer.send(record, Duration::from_secs(1))
            });
            let results = tokio::select! {
                r = join_all(sends) => r,
                _ = shutdown.cancelled() => return None,
            };
            let failed: BTreeSet<i32> = owed
                .iter()
                .zip(&results)
                .filter(|(_, r)| r.is_err())
                .map(|((_, place, _, _), _)| place.partition)
                .collect();
            if failed.is_empty() {
                break;
            }
            // A send reported failed may still have landed: read back.
            for p in &failed {
                answered.remove(p);
            }
            tracing::warn!(
                partitions = ?failed,
                "Kafka did not take some ingest replies or dead letters; reading back what landed, then sending the rest"
            );
            self.inner.health.report(
                "ingest",
                Err(format!("Kafka did not take the answers of ingest partitions {failed:?}")),
            );
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = shutdown.cancelled() => return None,
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
        // The round is answered, and its offsets are committed next: what
        // is kept is for the later rounds (a predecessor may have answered
        // further than this round reaches).
        let mut ends: BTreeMap<i32, i64> = BTreeMap::new();
        for item in items {
            let e = ends.entry(item.msg.partition()).or_default();
            *e = (*e).max(item.msg.offset());
        }
        for (p, end) in ends {
            if let Some(a) = answered.get_mut(&p) {
                a.at.retain(|(_, offset)| *offset > end);
            }
        }
        Some(())
    }

    /// What the answer partitions of ingest partition `p` hold for its
    /// offsets from `from` on (tried until it reads, or None when stopped).
    async fn read_back(
        &self,
        outlets: &Outlets,
        p: i32,
        from: i64,
        shutdown: &CancellationToken,
    ) -> Option<Answered> {
        let mut backoff = Duration::from_millis(100);
        loop {
            let s = self.settings();
            let k = s.kafka.clone();
            let source = s.ingest.topic.clone();
            let reader = format!("{}.read-back", k.ingest_group());
            let targets: Vec<(Outlet, String, i32)> = [Outlet::Reply, Outlet::Dead]
                .into_iter()
                .filter_map(|o| outlets.of(o).map(|(t, n)| (o, t.clone(), answer_partition(p, *n))))
                .collect();
            let read = tokio::task::spawn_blocking(move || -> Result<Answered, KafkaError> {
                let mut answered = Answered::default();
                for (outlet, topic, partition) in targets {
                    kafka::read_backwards(&k, &reader, &topic, partition, READ_BACK_WINDOW, |msgs| {
                        let mut older = false;
                        for m in msgs {
                            let Some(place) = source_of(m) else { continue };
                            if place.topic != source || place.partition != p {
                                continue;
                            }
                            if place.offset >= from {
                                answered.at.insert((outlet, place.offset));
                            } else {
                                older = true;
                            }
                        }
                        !older
                    })?;
                }
                Ok(answered)
            })
            .await
            .unwrap_or(Err(KafkaError::Canceled));
            match read {
                Ok(answered) => {
                    if !answered.at.is_empty() {
                        tracing::info!(
                            partition = p,
                            from,
                            found = answered.at.len(),
                            "ingest answers already on the topics are not sent again"
                        );
                    }
                    return Some(answered);
                }
                Err(e) => {
                    tracing::warn!(error = %e, partition = p, "reading back the ingest answers failed; trying again");
                    self.inner.health.report("ingest", Err(format!("cannot read back the answers: {e}")));
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = shutdown.cancelled() => return None,
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// The answer topics, with their partition counts (both must exist).
    async fn outlets(&self) -> Result<Outlets, KafkaError> {
        let s = self.settings();
        let k = s.kafka.clone();
        let (reply, dead) = (s.ingest.reply_topic.clone(), s.ingest.dlq_topic());
        tokio::task::spawn_blocking(move || {
            let count = |topic: &str| -> Result<i32, KafkaError> {
                match kafka::partition_count(&k, topic)? {
                    0 => Err(KafkaError::MetadataFetch(rdkafka::types::RDKafkaErrorCode::UnknownTopic)),
                    n => Ok(n as i32),
                }
            };
            let reply = match reply.is_empty() {
                true => None,
                false => Some((reply.clone(), count(&reply)?)),
            };
            Ok(Outlets { reply, dead: (dead.clone(), count(&dead)?) })
        })
        .await
        .unwrap_or(Err(KafkaError::Canceled))
    }

    async fn report_ingest_lag(&self, group: &str) {
        let s = self.settings();
        match kafka::group_lag_on(&s.kafka, group, &s.ingest.topic).await {
            Ok(parts) => self.inner.metrics.ingest_lag.set(parts.iter().map(|p| p.lag()).sum()),
            Err(e) => tracing::debug!(error = %e, "ingest lag not read"),
        }
    }
}

/// The offsets to store after a round: partition → the offset after its
/// last command.
fn next_offsets(items: &[Item]) -> BTreeMap<i32, i64> {
    let mut next = BTreeMap::new();
    for item in items {
        let e = next.entry(item.msg.partition()).or_insert(0);
        *e = (*e).max(item.msg.offset() + 1);
    }
    next
}

fn place_of(msg: &OwnedMessage) -> Place {
    Place { topic: msg.topic().to_string(), partition: msg.partition(), offset: msg.offset() }
}

/// The command an answer names in its [`SOURCE_HEADER`].
fn source_of(msg: &OwnedMessage) -> Option<Place> {
    let headers = msg.headers()?;
    headers.iter().find(|h| h.key == SOURCE_HEADER).and_then(|h| h.value).and_then(Place::from_header)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(offset: i64) -> Place {
        Place { topic: "bagstore.ingest.v1".into(), partition: 2, offset }
    }

    fn command(doc: JsonValue, offset: i64) -> Command {
        parse(Some(doc.to_string().as_bytes()), &place(offset), 1 << 20)
    }

    const ID: &str = "000102030405060708090a0b0c0d0e0f";

    #[test]
    fn each_op_parses_with_its_fields_and_the_correlation_id_is_kept() {
        let c = command(json!({"op": "put", "id": ID, "properties": {"a": 1}, "correlation_id": "c1"}), 7);
        assert_eq!(c.correlation_id.as_deref(), Some("c1"));
        assert_eq!(c.id.map(|i| i.to_hex()).as_deref(), Some(ID));
        assert!(matches!(c.action, Ok((Change::Put(_), _))));
        let c = command(json!({"op": "patch", "id": ID, "patch": {"$inc": {"n": 1}}, "if_match": 3}), 8);
        let Ok((Change::Patch { upsert: false, .. }, pre)) = c.action else { panic!("{:?}", c.action) };
        assert_eq!(pre.if_version, Some(3));
        let c = command(json!({"op": "patch", "id": ID, "patch": {"a": null}, "upsert": true}), 9);
        assert!(matches!(c.action, Ok((Change::Patch { upsert: true, .. }, _))));
        let c = command(json!({"op": "delete", "id": ID}), 10);
        assert!(matches!(c.action, Ok((Change::Delete, _))));
    }

    #[test]
    fn the_guard_is_the_key_when_given_else_the_place() {
        let guard = |doc: JsonValue, offset| command(doc, offset).action.unwrap().1.guard.unwrap();
        let keyed = json!({"op": "delete", "id": ID, "idempotency_key": "k1"});
        // Same key, resent elsewhere with another correlation id: one guard.
        let mut resent = keyed.clone();
        resent["correlation_id"] = json!("again");
        assert_eq!(guard(keyed.clone(), 1), guard(resent, 99));
        // No key: the place is the key, so a redelivery shares it.
        let plain = json!({"op": "delete", "id": ID});
        assert_eq!(guard(plain.clone(), 5), guard(plain.clone(), 5));
        assert_ne!(guard(plain.clone(), 5).key, guard(plain, 6).key);
        // Same key, another command: same key, another request (a 422).
        let other = json!({"op": "put", "id": ID, "properties": {}, "idempotency_key": "k1"});
        let (a, b) = (guard(keyed, 1), guard(other, 2));
        assert_eq!(a.key, b.key);
        assert_ne!(a.request, b.request);
    }

    #[test]
    fn malformed_commands_say_why_and_keep_what_can_be_answered() {
        let cases: Vec<(Option<&[u8]>, &str)> = vec![
            (None, "no value"),
            (Some(b"{not json"), "not JSON"),
            (Some(b"[1]"), "JSON object"),
            (Some(br#"{"op": "put", "id": "xyz", "properties": {}, "correlation_id": "c"}"#), "\"id\""),
            (Some(br#"{"op": "upsert", "id": "000102030405060708090a0b0c0d0e0f"}"#), "unknown op"),
            (Some(br#"{"op": "put", "id": "000102030405060708090a0b0c0d0e0f"}"#), "needs \"properties\""),
            (Some(br#"{"op": "delete", "id": "000102030405060708090a0b0c0d0e0f", "properties": {}}"#), "no \"properties\""),
            (Some(br#"{"op": "put", "id": "000102030405060708090a0b0c0d0e0f", "properties": {}, "extra": 1}"#), "unknown field"),
            (Some(br#"{"op": "patch", "id": "000102030405060708090a0b0c0d0e0f", "patch": {"$inc": {"n": 1}, "a": 2}}"#), "mixes"),
            (Some(br#"{"op": "patch", "id": "000102030405060708090a0b0c0d0e0f", "patch": {"$frob": {}}}"#), "$frob"),
            (Some(br#"{"op": "delete", "id": "000102030405060708090a0b0c0d0e0f", "if_match": -1}"#), "if_match"),
            (Some(br#"{"op": "delete", "id": "000102030405060708090a0b0c0d0e0f", "idempotency_key": ""}"#), "Idempotency-Key"),
        ];
        for (payload, why) in cases {
            let c = parse(payload, &place(1), 1 << 20);
            let Err(p) = &c.action else { panic!("{payload:?} was accepted") };
            assert!(p.detail.contains(why), "{payload:?}: {:?} does not say {why:?}", p.detail);
            assert_eq!(p.status.as_u16(), 400);
        }
        let c = parse(Some(br#"{"op": "nope", "id": "x", "correlation_id": "c9"}"#), &place(1), 1 << 20);
        assert_eq!(c.correlation_id.as_deref(), Some("c9"), "a refused command is still answered");
    }

    #[test]
    fn a_source_header_names_its_place_and_bad_ones_name_none() {
        let p = place(41);
        assert_eq!(p.header(), "bagstore.ingest.v1/2/41");
        assert_eq!(Place::from_header(p.header().as_bytes()), Some(p));
        for bad in ["", "x/1", "/1/2", "t/x/2", "t/1/y", "t/1/2/3x"] {
            assert_eq!(Place::from_header(bad.as_bytes()), None, "{bad:?}");
        }
        // Every answer topic partition is in range, whatever the counts.
        assert_eq!((answer_partition(5, 4), answer_partition(3, 8), answer_partition(2, 0)), (1, 3, 0));
    }

    #[test]
    fn a_put_over_the_size_limit_is_refused() {
        let c = parse(
            Some(json!({"op": "put", "id": ID, "properties": {"s": "x".repeat(200)}}).to_string().as_bytes()),
            &place(1),
            100,
        );
        assert_eq!(c.action.unwrap_err().status.as_u16(), 413);
    }
}
