//! The sections of the configuration file, with their defaults.

use serde::{Deserialize, Serialize};
use std::fmt;

use super::secrets::{is_secret_kafka_option, secrets_list_or_csv, Secret};

/// Optional bearer tokens per role. A role with no tokens is open; admin
/// tokens are accepted everywhere.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthSettings {
    /// Writes: `POST/PUT/DELETE /v1/entities…`.
    #[serde(deserialize_with = "secrets_list_or_csv")]
    pub write_tokens: Vec<Secret>,
    /// Reads: entity gets, queries, the index list, lag and shards.
    #[serde(deserialize_with = "secrets_list_or_csv")]
    pub read_tokens: Vec<Secret>,
    /// Index administration (`DELETE /v1/indexes/{table}`), and everything else.
    #[serde(deserialize_with = "secrets_list_or_csv")]
    pub admin_tokens: Vec<Secret>,
    /// Require a read token for `/metrics` too.
    pub protect_metrics: bool,
}

/// The Kafka cluster every process talks to, and the internal change topic
/// (bagstore's own events, lz4 + bincode). Secret `options` never appear in
/// logs or Debug output (see [`is_secret_kafka_option`]).
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaSettings {
    /// Bootstrap servers, `host:port` comma-separated (librdkafka's
    /// `bootstrap.servers`). Every service needs it; `bagstore dev` runs an
    /// embedded broker when it is empty.
    pub brokers: String,
    /// The change-event topic; undecodable events go to `<topic>.dlq`.
    pub topic: String,
    /// Partitions `bagstore migrate` creates the topic with.
    pub partitions: i32,
    /// Replicas `bagstore migrate` creates the topics with: 3, what a
    /// production Kafka cluster needs to lose a broker without losing
    /// events; a single-broker cluster (`dev`, the example compose) sets 1.
    /// `migrate` says so when the cluster has fewer brokers.
    pub replication_factor: i32,
    /// Put before every consumer group id (`<prefix>bagstore-index-<table>`,
    /// `<prefix>bagstore-ingest`), so environments that share a Kafka
    /// cluster keep their groups apart. At most 100 of `a-z`, `A-Z`, `0-9`,
    /// `.`, `_` and `-`.
    pub group_prefix: String,
    /// The member lease's length: how long a dead indexer (or ingest
    /// consumer) holds its partitions before the others take them. Measured
    /// recovery after a `kill -9`: about this.
    pub session_timeout_ms: u64,
    /// How long the relay waits for a round's acknowledgements before it
    /// drops its producer and sends the unacknowledged rows again with a new
    /// one (librdkafka itself never times a message out: a later version
    /// could then overtake it).
    pub message_timeout_ms: u64,
    /// Extra librdkafka properties for every client (e.g. `security.protocol`,
    /// `ssl.ca.location`, `sasl.password`, `debug`), applied last. This is
    /// how TLS and SASL reach every producer, consumer and admin client.
    pub options: std::collections::BTreeMap<String, String>,
}

impl fmt::Debug for KafkaSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Destructured so a new field cannot be forgotten here.
        let KafkaSettings {
            brokers,
            topic,
            partitions,
            replication_factor,
            group_prefix,
            session_timeout_ms,
            message_timeout_ms,
            options,
        } = self;
        let options: std::collections::BTreeMap<&str, &str> = options
            .iter()
            .map(|(k, v)| (k.as_str(), if is_secret_kafka_option(k) { "***" } else { v.as_str() }))
            .collect();
        f.debug_struct("KafkaSettings")
            .field("brokers", brokers)
            .field("topic", topic)
            .field("partitions", partitions)
            .field("replication_factor", replication_factor)
            .field("group_prefix", group_prefix)
            .field("session_timeout_ms", session_timeout_ms)
            .field("message_timeout_ms", message_timeout_ms)
            .field("options", &options)
            .finish()
    }
}

impl KafkaSettings {
    pub fn dlq_topic(&self) -> String {
        format!("{}.dlq", self.topic)
    }

    /// The consumer group of an index's indexers.
    pub fn group_for(&self, table: &str) -> String {
        format!("{}bagstore-index-{table}", self.group_prefix)
    }

    /// The consumer group of the writers' Kafka ingest.
    pub fn ingest_group(&self) -> String {
        format!("{}bagstore-ingest", self.group_prefix)
    }
}

impl Default for KafkaSettings {
    fn default() -> Self {
        KafkaSettings {
            brokers: String::new(),
            topic: "bagstore.entity-changes".into(),
            partitions: 8,
            replication_factor: 3,
            group_prefix: String::new(),
            session_timeout_ms: 10_000,
            message_timeout_ms: 10_000,
            options: Default::default(),
        }
    }
}

/// Every process's HTTP listener: the API, `/metrics`, `/health` and the
/// operator console.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpSettings {
    /// Listen address, `host:port` (`--http` on the command line overrides it).
    pub addr: String,
    /// How long a stopping server waits for requests in flight; the relays
    /// drain the outbox for half of it.
    pub shutdown_grace_ms: u64,
    /// How long a client may take to send a request body, counted from the
    /// end of its headers. A slower (or stalled) client gets 408 and its
    /// connection is closed, so it cannot hold a task and a socket forever.
    pub request_timeout_ms: u64,
}

impl HttpSettings {
    pub fn request_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.request_timeout_ms)
    }
}

impl Default for HttpSettings {
    fn default() -> Self {
        HttpSettings { addr: "127.0.0.1:8080".into(), shutdown_grace_ms: 10_000, request_timeout_ms: 30_000 }
    }
}

/// The writer: the write API, group commit, the outbox relay and Kafka
/// ingest.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct WriterSettings {
    /// Largest accepted request body (and so entity), bytes.
    pub max_body_bytes: usize,
    /// Most entities in one batch request.
    pub max_batch: usize,
    /// Outbox rows the relay publishes per round.
    pub relay_batch: usize,
    /// How often a relay looks at its outbox without being woken, and how
    /// often a follower tries to become leader.
    pub relay_poll_ms: u64,
    /// Transactions in flight per shard for single writes; a slot that comes
    /// free commits every single write queued meanwhile in one transaction
    /// (group commit). 1 makes bigger groups; 4 measured 2× slower on two
    /// cores.
    pub commit_slots: usize,
    /// Most writes (a batch counts each entity) this process holds at once,
    /// queued or committing; beyond it a write is answered 429 with
    /// `Retry-After`, so a flood costs bounded memory. At least
    /// `writer.max_batch`.
    pub max_pending_writes: usize,
    /// How long an `Idempotency-Key` is remembered: a retry within it gets
    /// the first answer and writes nothing. The cleaner purges older
    /// records once a minute.
    pub idempotency_window_secs: u64,
    /// How long a write waits for its commit's answer before it is answered
    /// 503 `outcome-unknown` (`Retry-After: 1`): the commit goes on (one
    /// waiting for a replica's acknowledgement is never killed, see
    /// docs/operations.md, "Replicas"), and a retry with the same
    /// `Idempotency-Key` learns its outcome.
    pub commit_timeout_ms: u64,
    /// Test drill: exit the process right after committing a write that
    /// carries an `Idempotency-Key`, before answering (a crash between
    /// commit and answer). Never set it in production.
    pub drill_exit_after_commit: bool,
    /// How long a write's reservation of a unique key is its own: a
    /// reservation whose writer died (or stalled) longer than this is
    /// taken over by the next writer of the key, so an orphan blocks a key
    /// at most this long. At most 10 000.
    pub unique_reservation_ms: u64,
    /// Test drill: exit the process right after reserving a unique key,
    /// before the write's transaction (a crash between reserving and
    /// committing). Never set it in production.
    pub drill_exit_after_reserve: bool,
}

impl Default for WriterSettings {
    fn default() -> Self {
        WriterSettings {
            max_body_bytes: 1 << 20,
            max_batch: 1000,
            relay_batch: 500,
            relay_poll_ms: 200,
            commit_slots: 2,
            max_pending_writes: 10_000,
            idempotency_window_secs: 86_400,
            commit_timeout_ms: 10_000,
            drill_exit_after_commit: false,
            unique_reservation_ms: 5_000,
            drill_exit_after_reserve: false,
        }
    }
}

/// Index maintenance: the indexers of an index consume the change topic as
/// one consumer group, `<kafka.group_prefix>bagstore-index-<table>`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct IndexerSettings {
    /// Most events applied in one round (one transaction per shard).
    pub batch_max: usize,
    /// How long to wait for more events once one has arrived.
    pub batch_wait_ms: u64,
    /// Ceiling of the retry backoff after a database error.
    pub retry_max_ms: u64,
    /// The index consumers' `fetch.wait.max.ms`: how long a broker may hold
    /// a fetch that found nothing. Unset: 5 ms on `bagstore dev`'s embedded
    /// broker ([`EMBEDDED_FETCH_WAIT_MS`]), 20 ms on any other
    /// ([`FETCH_WAIT_MS`]). librdkafka's mock cluster and tansu 0.6 hold
    /// every fetch for the whole wait, so there index lag includes it;
    /// Apache Kafka answers as soon as data arrives, so there it only sets
    /// how often an idle consumer asks.
    pub fetch_wait_ms: Option<u64>,
    /// This indexer's member name, stable across restarts (Kubernetes: the
    /// pod's name). An index's consumers split its topic's partitions by
    /// member leases on the metadata shard (`service::leases`). A process that starts under a name
    /// takes its partitions at once. Unset: a name of its own per process,
    /// so a restarted one is a new member. 1 to 255 printable characters,
    /// unique among live processes: a second process under a taken name
    /// takes it, and the first stops applying and reports not ready.
    pub member: Option<String>,
}

/// The index consumers' fetch wait on a broker that answers a fetch as soon
/// as data arrives (Apache Kafka): there it sets only how often an idle
/// consumer asks, and lag does not depend on it. tansu 0.6 and librdkafka's
/// mock cluster hold every fetch for the whole wait, found data or not, so
/// there it is paid on every event: see [`EMBEDDED_FETCH_WAIT_MS`].
pub const FETCH_WAIT_MS: u64 = 20;

/// The index consumers' fetch wait on `bagstore dev`'s embedded broker
/// (librdkafka's mock cluster), where index lag is the wait plus the apply.
/// Measured side by side (BENCHMARKS.md, run B6, lag at 50% of the max put
/// rate): p50 19.0 / p99 42.4 ms at 5 ms against 33.1 / 72.4 at 20 ms. The
/// price is four times the idle fetches. On tansu each fetch runs a
/// PostgreSQL query per partition, and at 5 ms the two-core test machine's
/// tansu fell behind its consumers' session timeouts (issue 20's note), so
/// this is not the default for other brokers.
pub const EMBEDDED_FETCH_WAIT_MS: u64 = 5;

impl IndexerSettings {
    /// The index consumers' fetch wait (see [`IndexerSettings::fetch_wait_ms`]).
    pub fn fetch_wait_ms(&self) -> u64 {
        self.fetch_wait_ms.unwrap_or(FETCH_WAIT_MS)
    }
}

impl Default for IndexerSettings {
    fn default() -> Self {
        IndexerSettings {
            batch_max: 500,
            batch_wait_ms: 5,
            retry_max_ms: 5_000,
            fetch_wait_ms: None,
            member: None,
        }
    }
}

/// The reader: point reads, batch gets and queries.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReaderSettings {
    /// Page size of a query that gives no `limit`.
    pub default_limit: usize,
    /// Largest `limit` a query may ask for (more is a 400).
    pub max_limit: usize,
    /// Most values in one `in` list, and most index keys one query may
    /// expand to (more is a 400).
    pub max_in: usize,
    /// Most ids in one `POST /v1/entities/get` (more is a 400).
    pub max_batch_get: usize,
    /// Longest a query may take, including a `consistent_with` wait (then
    /// 504).
    pub query_timeout_ms: u64,
    /// Entity locations (id → the row's clustered key) remembered, so a
    /// fetch by id takes one B-tree descent instead of two; about 40 bytes
    /// each (0: off). Queries take locations from the index rows instead.
    pub location_cache: usize,
    /// Most reads (gets, batch gets, queries) served at once; beyond it a
    /// read is answered 429 with `Retry-After`.
    pub max_concurrent: usize,
    /// Where gets, batch gets and queries (index scans and entity fetches)
    /// read: `"primary"`, each shard's primary; or `"replicas"`, a replica
    /// of the shard whose data is at most `max_replica_lag_ms` old, else
    /// the primary. A write token (`consistent_with`) keeps
    /// read-your-writes exactly either way.
    pub read_from: ReadFrom,
    /// With `read_from = "replicas"`: how old a replica's data may be (ms)
    /// for reads to go to it, measured as how long ago the primary last
    /// held nothing the replica lacks. A replica past it, or down, is
    /// skipped until it catches up.
    pub max_replica_lag_ms: u64,
}

/// Which servers of a shard the reader reads (`reader.read_from`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReadFrom {
    /// The shard's primary: every answer is as fresh as the shard.
    #[default]
    Primary,
    /// A replica within `reader.max_replica_lag_ms`, else the primary: an
    /// answer without a write token may be that much older.
    Replicas,
}

impl Default for ReaderSettings {
    fn default() -> Self {
        ReaderSettings {
            default_limit: 100,
            max_limit: 1000,
            max_in: 1000,
            max_batch_get: 1000,
            query_timeout_ms: 5000,
            location_cache: 200_000,
            max_concurrent: 512,
            read_from: ReadFrom::Primary,
            max_replica_lag_ms: 1000,
        }
    }
}

/// The cleaner: drift repair, backfills of new indexes, expiry, tombstone
/// purges, the index lag measurement, and moves left in flight.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct CleanerSettings {
    /// Pause between sweep cycles (0: sweep as fast as possible).
    pub interval_ms: u64,
    /// Every cycle re-checks the entities updated this recently, so fresh
    /// drift is repaired within one cycle.
    pub recent_window_secs: u64,
    /// Entities (or index entity ids) per shard per step.
    pub batch: usize,
    /// Backfill speed limit in rows per second (0: unlimited). With
    /// `backfill_follow_health`, the ceiling of the pace it follows.
    pub backfill_rate: u64,
    /// The backfill's pace follows the shards' health: it slows down while
    /// a probe statement takes longer than before the backfill began by
    /// more than `backfill_health_slack_ms` (see `cleaner::pace`).
    pub backfill_follow_health: bool,
    /// How much slower (ms, 90th percentile) the probe may answer during a backfill
    /// that follows health than before it.
    pub backfill_health_slack_ms: f64,
    /// Shards a backfill scans at the same time.
    pub backfill_concurrency: usize,
    /// Entities per backfill batch (the most: a pace that follows health
    /// reads smaller ones). Each batch's index rows are one transaction
    /// per shard they go to, so fewer, larger batches mean fewer commits.
    pub backfill_batch: usize,
    /// How often each shard is searched for expired entities (see
    /// `expiry.property`); an entity is deleted within about this long
    /// after it expires, plus the time to delete those before it.
    pub expiry_interval_ms: u64,
    /// Tombstones (deleted entities' rows) older than this are purged
    /// (0: never). See `storage::purge`.
    pub tombstone_retention_secs: u64,
    /// Pause between purge rounds on each shard.
    pub purge_interval_ms: u64,
    /// Index tombstones (index rows marked removed, see
    /// `storage::index_rows`) are purged once the index's settled time has
    /// passed their removal by this much: an old event delivered again
    /// later than that could write its key back (the cleaner then removes
    /// it as drift).
    pub index_tombstone_retention_secs: u64,
}

impl Default for CleanerSettings {
    fn default() -> Self {
        CleanerSettings {
            interval_ms: 1000,
            recent_window_secs: 60,
            batch: 500,
            backfill_rate: 0,
            backfill_follow_health: false,
            backfill_health_slack_ms: 1.0,
            backfill_concurrency: 2,
            backfill_batch: 2000,
            expiry_interval_ms: 1000,
            tombstone_retention_secs: 7 * 86_400,
            purge_interval_ms: 60_000,
            index_tombstone_retention_secs: 600,
        }
    }
}

/// Expiry (TTL), off by default.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ExpirySettings {
    /// The property holding an entity's expiry time in Unix seconds
    /// (unset: nothing expires). Reads hide an entity from that instant
    /// on; the cleaner deletes it within `cleaner.expiry_interval_ms`.
    pub property: Option<String>,
}

/// The public change stream: every committed write as JSON in Debezium's
/// shape, for consumers outside bagstore (`docs/api.md`), on by default.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ChangesSettings {
    /// Whether the relay writes the change stream.
    pub enabled: bool,
    /// Its topic (created by `migrate` with the change topic's partitions).
    pub topic: String,
}

impl Default for ChangesSettings {
    fn default() -> Self {
        ChangesSettings { enabled: true, topic: "bagstore.changes.v1".into() }
    }
}

/// Kafka ingest: producers write commands to `topic`; the writers consume
/// them as one consumer group, `<kafka.group_prefix>bagstore-ingest`, and
/// apply each through the write path (`docs/api.md`, "Kafka ingest").
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct IngestSettings {
    /// Whether writer processes consume the ingest topic.
    pub enabled: bool,
    /// The commands' topic (created by `migrate` with the change topic's
    /// partitions). The dead-letter topic is `<topic>.dlq`.
    pub topic: String,
    /// Where each command that carries a `correlation_id` gets its outcome
    /// (empty: no replies).
    pub reply_topic: String,
    /// Commands taken from the topic per round at most.
    pub batch: usize,
    /// This writer's member name, stable across restarts (Kubernetes: the
    /// pod's name). The writers split the ingest topic's partitions by
    /// member leases on the metadata shard, as the indexers do. A process
    /// that starts under a name takes its partitions at once. Unset: a name
    /// of its own per process, so a restarted one is a new member.
    pub member: Option<String>,
}

impl Default for IngestSettings {
    fn default() -> Self {
        IngestSettings {
            enabled: true,
            topic: "bagstore.ingest.v1".into(),
            reply_topic: "bagstore.ingest.v1.replies".into(),
            batch: 500,
            member: None,
        }
    }
}

impl IngestSettings {
    /// Malformed and refused commands, each with its reason.
    pub fn dlq_topic(&self) -> String {
        format!("{}.dlq", self.topic)
    }
}

/// Moving logical shards between physical shards (`bagstore shards …`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MoverSettings {
    /// Copy speed limit in rows per second (0: unlimited).
    pub rate: u64,
    /// Rows per copy statement.
    pub batch: usize,
    /// A rebalance or a move of more logical shards than this runs as
    /// several moves of at most this many: each cutover then holds fewer
    /// writes, and a failure redoes less.
    pub logicals_per_move: usize,
    /// How long the cutover waits for writes in flight before it gives up
    /// and tries again later (writes meanwhile wait, they do not fail).
    pub fence_wait_ms: u64,
    /// How long a closed fence waits for the source's outbox to reach
    /// Kafka before it opens again and tries later.
    pub outbox_wait_ms: u64,
    /// Cutover attempts before the move stops with an error (it stays
    /// resumable).
    pub cutover_attempts: u32,
    /// A process not seen for this long is not waited for before a
    /// source's copy is removed.
    pub process_ttl_secs: u32,
    /// The copy pauses while the source has more than this many queries
    /// running (MySQL's `Threads_running`; 0: never pauses).
    pub max_threads_running: u32,
    /// For drills only (killing a mover mid-cutover on purpose): how long
    /// the cutover pauses before the source gives the logical shards up,
    /// and again before the map flips. Writes to them wait meanwhile. 0 in
    /// production.
    pub drill_hold_ms: u64,
}

impl Default for MoverSettings {
    fn default() -> Self {
        MoverSettings {
            rate: 0,
            batch: 2000,
            logicals_per_move: 256,
            fence_wait_ms: 1000,
            outbox_wait_ms: 1000,
            cutover_attempts: 20,
            process_ttl_secs: 10,
            max_threads_running: 32,
            drill_hold_ms: 0,
        }
    }
}
