//! Answering commands once: replies and dead letters, each in the
//! partition of its command's partition with a header naming the command,
//! and the read-back that finds what a predecessor (or a send reported
//! failed) already put there (see the module above for why).

use futures::future::join_all;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use schemas::settings::KafkaSettings;
use schemas::{EntityId, Settings};
use serde_json::{json, Value as JsonValue};
use service::consumer::{FencedConsumer, Ownership};
use service::health::Health;
use service::http::Problem;
use service::kafka;
use service::serve::sleep_or_stop;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use storage::fences::Claim;
use tokio_util::sync::CancellationToken;

use super::command::{Item, Place};
use crate::Outcome;

/// The header on every reply and dead letter that names the command it
/// answers: `<topic>/<partition>/<offset>` of the command's message.
pub const SOURCE_HEADER: &str = "bagstore-ingest-source";

/// How many offsets of an answer partition are read back at a time.
const READ_BACK_WINDOW: i64 = 512;

/// Beyond the producer's message timeout, how long a partition given anew
/// by a member lease waits before it is read back: a produce request sent
/// before its message timed out may still be on its way to the broker.
const SETTLE_MARGIN: Duration = Duration::from_secs(1);

/// What became of a round's answers.
#[derive(Debug)]
pub(crate) enum Sent {
    /// Every answer the round owes is on its topic.
    Done,
    /// Stopped first.
    Stopped,
    /// The partitions are no longer this writer's (why): it answers
    /// nothing more of them, and its successor answers the round.
    Lost(String),
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

/// Which answer topic a message goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outlet {
    Reply,
    Dead,
}

/// The answer topics and their partition counts.
#[derive(Debug)]
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

/// One answer a round owes: its topic, its command's place, key and value.
#[derive(Debug)]
struct Owed {
    outlet: Outlet,
    place: Place,
    key: Vec<u8>,
    value: Vec<u8>,
}

/// The answering side of one writer's ingest.
pub(crate) struct Answers {
    producer: FutureProducer,
    outlets: Outlets,
    kafka: KafkaSettings,
    /// The ingest topic (answers name their commands on it).
    source: String,
    /// The kept client the read-back uses (`kafka::read_backwards`).
    reader: String,
    health: Health,
    /// Per ingest partition held: what its answer partitions already hold.
    answered: BTreeMap<i32, Answered>,
    /// How long a partition given anew waits before it is read back (see
    /// [`Answers::settled`]).
    settle: Duration,
    /// Partitions given anew and not read back yet, since when.
    taken: BTreeMap<i32, Instant>,
    /// This process's last claim on each partition it was given (its
    /// generation), kept across the consumers it rebuilds.
    gens: BTreeMap<i32, u64>,
}

impl std::fmt::Debug for Answers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Answers").field("outlets", &self.outlets).field("source", &self.source).finish()
    }
}

impl Answers {
    /// A producer, and the answer topics with their partition counts (both
    /// must exist).
    pub(crate) async fn open(settings: &Settings, health: Health) -> Result<Answers, KafkaError> {
        let k = settings.kafka.clone();
        let producer: FutureProducer = kafka::create(&kafka::producer_config(&k))?;
        let (reply, dead) = (settings.ingest.reply_topic.clone(), settings.ingest.dlq_topic());
        let count_on = k.clone();
        let outlets = tokio::task::spawn_blocking(move || {
            let count = |topic: &str| -> Result<i32, KafkaError> {
                match kafka::partition_count(&count_on, topic)? {
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
        .unwrap_or(Err(KafkaError::Canceled))?;
        let reader = format!("{}.read-back", k.ingest_group());
        let source = settings.ingest.topic.clone();
        let settle = Duration::from_millis(k.message_timeout_ms) + SETTLE_MARGIN;
        let (answered, taken, gens) = (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
        Ok(Answers { producer, outlets, kafka: k, source, reader, health, answered, settle, taken, gens })
    }

    /// Partitions given to this member anew (its claims on them): what it
    /// knew of their answer partitions is stale, and they are read back
    /// before the next answer. A claim right above this process's own last
    /// one had no holder in between but this process, whose round in hand
    /// ended before its consumer was replaced, and the first claim ever
    /// had no holder before it: nothing to wait out.
    pub(crate) fn taken(&mut self, claims: &[Claim]) {
        for c in claims {
            self.answered.remove(&c.partition);
            if !no_other_holder_before(self.gens.insert(c.partition, c.gen), c) {
                self.taken.insert(c.partition, Instant::now());
            }
        }
    }

    /// Waits until partition `p`, if given anew, may be read back (false
    /// when stopped first). A member lease gives it at once, while its previous
    /// holder may be sending the answers of a round it checked its claims
    /// for just before this member claimed it. Those sends end (land or
    /// fail) within the producer's message timeout, and a failed one is
    /// not sent again without a new check, which the claim now fails; so a
    /// read-back that waits that long after the claim sees every answer
    /// the previous holder will ever send.
    async fn settled(&mut self, p: i32, shutdown: &CancellationToken) -> bool {
        let Some(since) = self.taken.remove(&p) else { return true };
        let left = (since + self.settle).saturating_duration_since(Instant::now());
        if !left.is_zero() {
            tracing::info!(
                partition = p,
                wait_ms = left.as_millis() as u64,
                "waiting out the previous holder's answers before reading back"
            );
        }
        sleep_or_stop(shutdown, left).await
    }

    /// Whether `partitions` are still this member's, asked right before
    /// answers are sent; while the claims cannot be compared, nothing is
    /// sent (tried again).
    async fn ours(
        &self,
        consumer: &mut FencedConsumer,
        partitions: &BTreeSet<i32>,
        shutdown: &CancellationToken,
    ) -> Sent {
        let mut backoff = Duration::from_millis(100);
        loop {
            match consumer.still_ours(partitions).await {
                Ownership::Ours => return Sent::Done,
                Ownership::Lost(why) => return Sent::Lost(why),
                Ownership::Unknown(why) => {
                    tracing::warn!(%why, "not answering until the partition claims can be compared");
                    self.health.report("ingest", Err(why));
                }
            }
            if !sleep_or_stop(shutdown, backoff).await {
                return Sent::Stopped;
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// Waits (a while) for every answer sent to be on its topic: nothing
    /// of this member's may land after a successor read back.
    pub(crate) fn flush(&self) {
        if let Err(e) = self.producer.flush(Duration::from_secs(5)) {
            tracing::warn!(error = %e, "ingest answers still unsent at stop");
        }
    }

    /// Sends the round's dead letters and replies that are not on their
    /// topics yet, and waits for Kafka to acknowledge them all; after a
    /// failed send, reads back which landed and sends the rest. Each send
    /// goes only while the round's partitions are still this member's
    /// (`consumer`'s claims, compared right before it): a member the group
    /// replaced without telling it, or whose lease's share moved, stops
    /// here, and its successor, which claimed them first, answers.
    pub(crate) async fn send(
        &mut self,
        items: &[Item],
        consumer: &mut FencedConsumer,
        shutdown: &CancellationToken,
    ) -> Sent {
        // Where this round resumes each partition: answers from there on
        // may already be on the topics.
        let mut resumes: BTreeMap<i32, i64> = BTreeMap::new();
        for item in items {
            let e = resumes.entry(item.msg.partition()).or_insert(i64::MAX);
            *e = (*e).min(item.msg.offset());
        }
        let partitions: BTreeSet<i32> = resumes.keys().copied().collect();
        let mut owed = self.owed(items);
        let mut backoff = Duration::from_millis(100);
        loop {
            for (&p, &from) in &resumes {
                if !self.answered.contains_key(&p) {
                    if !self.settled(p, shutdown).await {
                        return Sent::Stopped;
                    }
                    let Some(found) = self.read_back(p, from, shutdown).await else { return Sent::Stopped };
                    self.answered.insert(p, found);
                }
            }
            owed.retain(|o| !self.answered[&o.place.partition].at.contains(&(o.outlet, o.place.offset)));
            if owed.is_empty() {
                break;
            }
            match self.ours(consumer, &partitions, shutdown).await {
                Sent::Done => {}
                other => return other,
            }
            let Some(failed) = self.send_owed(&owed, shutdown).await else { return Sent::Stopped };
            if failed.is_empty() {
                break;
            }
            // A send reported failed may still have landed: read back.
            for p in &failed {
                self.answered.remove(p);
            }
            tracing::warn!(
                partitions = ?failed,
                "Kafka did not take some ingest replies or dead letters; reading back what landed, then sending the rest"
            );
            let why = format!("Kafka did not take the answers of ingest partitions {failed:?}");
            self.health.report("ingest", Err(why));
            if !sleep_or_stop(shutdown, backoff).await {
                return Sent::Stopped;
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
            if let Some(a) = self.answered.get_mut(&p) {
                a.at.retain(|(_, offset)| *offset > end);
            }
        }
        Sent::Done
    }

    /// Every answer a round owes: a dead letter per refused or malformed
    /// command, a reply per command with a correlation id (when replies
    /// are on).
    fn owed(&self, items: &[Item]) -> Vec<Owed> {
        let mut owed = Vec::new();
        for item in items {
            let result = item.result.as_ref().expect("every command has a result");
            let place = Place::of(&item.msg);
            if let Err(p) = result {
                let value = dead_letter(p, &place, item.msg.payload()).to_string().into_bytes();
                let key = item.msg.key().unwrap_or_default().to_vec();
                owed.push(Owed { outlet: Outlet::Dead, place: place.clone(), key, value });
            }
            if let (Some(c), Some(_)) = (&item.command.correlation_id, &self.outlets.reply) {
                let value = reply(c, item.command.id, result).to_string().into_bytes();
                owed.push(Owed { outlet: Outlet::Reply, place, key: c.clone().into_bytes(), value });
            }
        }
        owed
    }

    /// Sends `owed` at once; the ingest partitions whose answers Kafka did
    /// not take (None when stopped first).
    async fn send_owed(&self, owed: &[Owed], shutdown: &CancellationToken) -> Option<BTreeSet<i32>> {
        let sends = owed.iter().map(|o| {
            let (topic, partitions) = self.outlets.of(o.outlet).expect("owed only where it goes");
            let header = o.place.header();
            let record = FutureRecord::to(topic)
                .partition(answer_partition(o.place.partition, *partitions))
                .key(&o.key)
                .payload(&o.value)
                .headers(OwnedHeaders::new().insert(Header { key: SOURCE_HEADER, value: Some(&header) }));
            self.producer.send(record, Duration::from_secs(1))
        });
        let results = tokio::select! {
            r = join_all(sends) => r,
            _ = shutdown.cancelled() => return None,
        };
        Some(owed.iter().zip(&results).filter(|(_, r)| r.is_err()).map(|(o, _)| o.place.partition).collect())
    }

    /// What the answer partitions of ingest partition `p` hold for its
    /// offsets from `from` on (tried until it reads, or None when stopped).
    /// Answers for offsets before a committed offset all precede answers
    /// for offsets after it (a round's answers are acknowledged before its
    /// offsets are committed), so the read stops at the first older answer
    /// it meets.
    async fn read_back(&self, p: i32, from: i64, shutdown: &CancellationToken) -> Option<Answered> {
        let mut backoff = Duration::from_millis(100);
        loop {
            let (k, reader, source) = (self.kafka.clone(), self.reader.clone(), self.source.clone());
            let targets: Vec<(Outlet, String, i32)> = [Outlet::Reply, Outlet::Dead]
                .into_iter()
                .filter_map(|o| self.outlets.of(o).map(|(t, n)| (o, t.clone(), answer_partition(p, *n))))
                .collect();
            let read = tokio::task::spawn_blocking(move || -> Result<Answered, KafkaError> {
                let mut answered = Answered::default();
                for (outlet, topic, partition) in targets {
                    kafka::read_backwards(&k, &reader, &topic, partition, READ_BACK_WINDOW, |msgs| {
                        let mut older = false;
                        for place in msgs.iter().filter_map(source_of) {
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
                    self.health.report("ingest", Err(format!("cannot read back the answers: {e}")));
                }
            }
            if !sleep_or_stop(shutdown, backoff).await {
                return None;
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }
}

/// Whether no other member can have held `claim`'s partition before it:
/// it is the first claim ever on the partition (generation 1), or the next
/// after `last`, this process's own last claim on it.
fn no_other_holder_before(last: Option<u64>, claim: &Claim) -> bool {
    claim.gen == 1 || last.is_some_and(|g| g + 1 == claim.gen)
}

/// The command an answer names in its [`SOURCE_HEADER`].
fn source_of(msg: &OwnedMessage) -> Option<Place> {
    let headers = msg.headers()?;
    headers.iter().find(|h| h.key == SOURCE_HEADER).and_then(|h| h.value).and_then(Place::from_header)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_first_claim_or_one_right_after_our_own_has_no_previous_holder_to_wait_out() {
        let claim = Claim { partition: 2, gen: 8 };
        assert!(no_other_holder_before(Some(7), &claim));
        // Someone claimed it between our claims, or we never held it.
        assert!(!no_other_holder_before(Some(6), &claim));
        assert!(!no_other_holder_before(None, &claim));
        assert!(!no_other_holder_before(Some(8), &claim));
        // Nobody ever claimed it before.
        assert!(no_other_holder_before(None, &Claim { partition: 2, gen: 1 }));
    }

    #[test]
    fn every_answer_partition_is_in_range_whatever_the_counts() {
        assert_eq!((answer_partition(5, 4), answer_partition(3, 8), answer_partition(2, 0)), (1, 3, 0));
    }

    #[test]
    fn a_refusal_is_answered_with_its_problem_and_a_dead_letter_names_its_command() {
        let p = Problem::bad_request("bad-command", "no such op");
        let id = EntityId([7; 16]);
        let r = reply("c1", Some(id), &Err(p.clone()));
        assert_eq!((r["ok"].clone(), r["id"].clone()), (json!(false), json!(id.to_hex())));
        assert_eq!(r["problem"]["detail"], "no such op");
        let place = Place { topic: "t".into(), partition: 3, offset: 9 };
        let d = dead_letter(&p, &place, Some(b"{\"op\": 1}"));
        assert_eq!(d["reason"], "no such op");
        assert_eq!(d["source"], json!({"topic": "t", "partition": 3, "offset": 9}));
        assert_eq!(d["command"], "{\"op\": 1}");
    }
}
