//! What the randomized suites (convergence, chaos) agree on, written
//! independently of bagstore's own index and filter code so that a bug there
//! cannot hide itself:
//!
//! - [`random_entity`]: bodies over [`STANDARD_INDEXES`](crate::STANDARD_INDEXES)
//!   that make indexed values appear, change and vanish (arrays, wrong types,
//!   the partial index's condition flipping);
//! - [`expected_rows`] / [`actual_rows`]: every row each index should hold,
//!   derived from entity properties, and what the tables hold;
//! - [`random_query`] / [`matches`]: queries and a reference evaluator of
//!   their conditions, for Invariant R (no false positives);
//! - [`read_topic`]: every change event on the topic, for Invariant W.

use rand::rngs::StdRng;
use rand::Rng;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::BorrowedMessage;
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use schemas::event::{ChangeEvent, Op};
use serde_json::{json, Map, Value};
use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use crate::TestEnv;

/// The tables of [`STANDARD_INDEXES`](crate::STANDARD_INDEXES).
pub const STANDARD_TABLES: [&str; 4] = ["index_user_id", "index_user_name", "index_foo", "index_tag"];

pub const USERS: [&str; 4] = [
    "0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a",
    "1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b1b",
    "2c2c2c2c2c2c2c2c2c2c2c2c2c2c2c2c",
    "3d3d3d3d3d3d3d3d3d3d3d3d3d3d3d3d",
];
const FIRST: [&str; 3] = ["Ann", "Bob", "Cy"];
const LAST: [&str; 2] = ["Lee", "Kim"];
const TAGS: [&str; 4] = ["a", "b", "c", "d"];

fn pick(rng: &mut StdRng, xs: &[&str]) -> String {
    xs[rng.random_range(0..xs.len())].to_string()
}

/// A body for the standard indexes: each indexed property is sometimes
/// missing, `bar` is sometimes a string (no row in an int index), `m`
/// decides the partial index, `tags` is absent, a string, or an array
/// (sometimes with a number in it).
pub fn random_entity(rng: &mut StdRng) -> Value {
    let mut m = Map::new();
    if rng.random_bool(0.8) {
        m.insert("user_id".into(), json!(pick(rng, &USERS)));
    }
    if rng.random_bool(0.8) {
        m.insert("first_name".into(), json!(pick(rng, &FIRST)));
    }
    if rng.random_bool(0.8) {
        m.insert("last_name".into(), json!(pick(rng, &LAST)));
    }
    match rng.random_range(0..10) {
        0 => {
            m.insert("bar".into(), json!("2"));
        }
        1 => {}
        _ => {
            m.insert("bar".into(), json!(rng.random_range(0..4)));
        }
    }
    if rng.random_bool(0.7) {
        m.insert("m".into(), json!(pick(rng, &["right", "left"])));
    }
    match rng.random_range(0..4) {
        0 => {}
        1 => {
            m.insert("tags".into(), json!(pick(rng, &TAGS)));
        }
        _ => {
            let n = rng.random_range(0..4);
            let mut tags: Vec<Value> = (0..n).map(|_| json!(pick(rng, &TAGS))).collect();
            if rng.random_bool(0.2) {
                tags.push(json!(7));
            }
            m.insert("tags".into(), Value::Array(tags));
        }
    }
    m.insert("n".into(), json!(rng.random_range(0..1_000_000)));
    Value::Object(m)
}

/// (shard, key as text, entity id) for every row an index should hold.
pub type Rows = BTreeSet<(usize, String, String)>;

/// Which of the env's shards (by position in its DSN list) holds a key:
/// the cluster's map, read from the metadata shard, or a new cluster's.
#[derive(Debug, Clone)]
pub struct Placement {
    /// Position of the owner of each logical shard.
    owners: Vec<usize>,
}

impl Placement {
    /// A new cluster of `n` shards (logical shard k on the k mod n-th).
    pub fn even(n: usize) -> Placement {
        Placement { owners: (0..schemas::shard::DEFAULT_LOGICAL_SHARDS as usize).map(|k| k % n).collect() }
    }

    /// The map as the cluster has it now.
    pub async fn load(env: &TestEnv) -> Placement {
        let meta = env.pool(0).await;
        let physical: Vec<(u32, String)> = sqlx::query_as("SELECT id, address FROM bagstore_physical")
            .fetch_all(&meta)
            .await
            .expect("physical");
        let map: Vec<(u16, u32)> =
            sqlx::query_as("SELECT logical, physical FROM bagstore_map ORDER BY logical")
                .fetch_all(&meta)
                .await
                .expect("map");
        let position = |id: u32| {
            let address = &physical.iter().find(|p| p.0 == id).expect("a registered shard").1;
            env.dsns
                .iter()
                .position(|d| d == address)
                .unwrap_or_else(|| panic!("{address} is not one of the env's DSNs"))
        };
        Placement { owners: map.into_iter().map(|(_, p)| position(p)).collect() }
    }

    pub fn of(&self, bytes: &[u8]) -> usize {
        self.owners[schemas::logical_of(bytes, self.owners.len() as u16) as usize]
    }
}

fn hex_bytes(s: &str) -> Vec<u8> {
    schemas::id::unhex(s).expect("hex")
}

/// The rows of every standard index, derived from live entities' properties
/// (entity id → properties), without bagstore's index code.
pub fn expected_rows(
    entities: &HashMap<String, Value>,
    placement: &Placement,
) -> HashMap<&'static str, Rows> {
    let shard = |bytes: &[u8]| placement.of(bytes);
    let mut out: HashMap<&'static str, Rows> = STANDARD_TABLES.iter().map(|t| (*t, Rows::new())).collect();
    let mut add = |table: &'static str, row| {
        out.get_mut(table).expect("standard table").insert(row);
    };
    for (eid, p) in entities {
        if let Some(u) = p["user_id"].as_str() {
            add("index_user_id", (shard(&hex_bytes(u)), u.to_string(), eid.clone()));
        }
        if let (Some(f), Some(l)) = (p["first_name"].as_str(), p["last_name"].as_str()) {
            add("index_user_name", (shard(f.as_bytes()), format!("{f}|{l}"), eid.clone()));
        }
        if let (Some(bar), Some("right")) = (p["bar"].as_i64(), p["m"].as_str()) {
            add("index_foo", (shard(&bar.to_be_bytes()), bar.to_string(), eid.clone()));
        }
        let tags: Vec<&str> = match &p["tags"] {
            Value::String(s) => vec![s.as_str()],
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        for t in tags {
            add("index_tag", (shard(t.as_bytes()), t.to_string(), eid.clone()));
        }
    }
    out
}

/// What the standard index tables hold, on every shard.
pub async fn actual_rows(env: &TestEnv) -> HashMap<&'static str, Rows> {
    let queries = [
        (
            "index_user_id",
            "SELECT LOWER(HEX(user_id)), LOWER(HEX(entity_id)) FROM index_user_id WHERE removed_us IS NULL",
        ),
        (
            "index_user_name",
            "SELECT CONCAT(CAST(first_name AS CHAR), '|', CAST(last_name AS CHAR)), LOWER(HEX(entity_id)) \
             FROM index_user_name WHERE removed_us IS NULL",
        ),
        (
            "index_foo",
            "SELECT CAST(bar AS CHAR), LOWER(HEX(entity_id)) FROM index_foo WHERE removed_us IS NULL",
        ),
        (
            "index_tag",
            "SELECT CAST(tags AS CHAR), LOWER(HEX(entity_id)) FROM index_tag WHERE removed_us IS NULL",
        ),
    ];
    let mut out: HashMap<&'static str, Rows> = HashMap::new();
    for (table, sql) in queries {
        let rows: Vec<(usize, (String, String))> = env.fetch_all_shards(sql).await;
        out.insert(table, rows.into_iter().map(|(s, (key, eid))| (s, key, eid)).collect());
    }
    out
}

/// The versions of entity `id`'s rows in index `table`, on every shard, as
/// `shard:version`, a tombstone's as `shard:vN removed` (what a failed
/// comparison prints beside a row).
pub async fn row_versions(env: &TestEnv, table: &str, id: &str) -> String {
    let sql = format!(
        "SELECT version, removed_us IS NOT NULL FROM `{table}` WHERE entity_id = UNHEX('{id}') ORDER BY version"
    );
    let rows: Vec<(usize, (u64, bool))> = env.fetch_all_shards(&sql).await;
    let v: Vec<String> = rows
        .iter()
        .map(|(s, (v, removed))| format!("{s}:v{v}{}", if *removed { " removed" } else { "" }))
        .collect();
    format!("[{}]", v.join(", "))
}

/// Differences between what each index should hold and what it holds, one
/// line each (`<table>: missing|dangling (shard, key, entity)`).
pub fn row_differences(
    want: &HashMap<&'static str, Rows>,
    have: &HashMap<&'static str, Rows>,
) -> Vec<String> {
    let mut out = Vec::new();
    for table in STANDARD_TABLES {
        let (w, h) =
            (want.get(table).cloned().unwrap_or_default(), have.get(table).cloned().unwrap_or_default());
        for missing in w.difference(&h) {
            out.push(format!("{table}: missing {missing:?}"));
        }
        for dangling in h.difference(&w) {
            out.push(format!("{table}: dangling {dangling:?}"));
        }
    }
    out
}

/// A query the standard indexes can answer, sometimes with a filter on an
/// unindexed property, an `in` list, a range or an explicit order.
pub fn random_query(rng: &mut StdRng) -> Value {
    let mut q = match rng.random_range(0..7) {
        0 => json!({"where": {"user_id": pick(rng, &USERS)}}),
        1 => json!({"where": {"user_id": pick(rng, &USERS), "n": {"gte": rng.random_range(0..1_000_000)}}}),
        2 => json!({"where": {"first_name": pick(rng, &FIRST), "last_name": pick(rng, &LAST)}}),
        3 => json!({"where": {"first_name": {"in": [pick(rng, &FIRST), pick(rng, &FIRST)]}}}),
        4 => json!({"index": "index_foo", "where": {"bar": {"gte": rng.random_range(0..4)}}}),
        5 => json!({"where": {"bar": rng.random_range(0..4)}}),
        _ => json!({"where": {"tags": pick(rng, &TAGS)}}),
    };
    if rng.random_bool(0.3) {
        q["order"] = json!("desc");
    }
    q["limit"] = json!(rng.random_range(1..30));
    q
}

/// JSON equality as bagstore defines it for conditions: numbers by value,
/// and a property holding an array matches when one element does.
fn value_eq(actual: &Value, want: &Value) -> bool {
    match (actual, want) {
        (Value::Array(items), w) if !w.is_array() => items.iter().any(|a| value_eq(a, w)),
        (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
        (a, b) => a == b,
    }
}

fn value_gte(actual: &Value, bound: &Value) -> bool {
    match actual {
        Value::Array(items) => items.iter().any(|a| value_gte(a, bound)),
        Value::Number(a) => a.as_f64() >= bound.as_f64(),
        _ => false,
    }
}

/// Whether `properties` satisfy every condition of a query made by
/// [`random_query`], and the partial index's condition when the query names
/// that index (a reference evaluator, independent of the reader's).
pub fn matches(query: &Value, properties: &Value) -> bool {
    let conditions = query["where"].as_object().expect("where");
    let all = conditions.iter().all(|(name, cond)| {
        let actual = &properties[name];
        if actual.is_null() {
            return false;
        }
        match cond {
            Value::Object(op) if op.contains_key("gte") => value_gte(actual, &op["gte"]),
            Value::Object(op) if op.contains_key("in") => {
                op["in"].as_array().expect("in list").iter().any(|w| value_eq(actual, w))
            }
            want => value_eq(actual, want),
        }
    });
    let partial = query["index"] != "index_foo" || properties["m"] == "right";
    all && partial
}

/// One event read back from the change topic.
#[derive(Debug, Clone)]
pub struct TopicEvent {
    pub partition: i32,
    pub offset: i64,
    pub event: ChangeEvent,
}

/// Every event on `topic` (partitions `0..partitions`), in partition order.
pub fn read_topic(brokers: &str, topic: &str, partitions: i32) -> Vec<TopicEvent> {
    read_partitions(brokers, topic, partitions, |partition, offset, payload| TopicEvent {
        partition,
        offset,
        event: ChangeEvent::decode(payload).expect("a decodable event"),
    })
}

/// One message of the public change stream, as its envelope says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamMessage {
    pub id: String,
    pub version: u64,
    /// `c`, `u`, `d` (or `r` for a snapshot's read).
    pub op: String,
}

/// Every message still on the public change stream `topic`, in partition
/// order, and whether a partition has lost its oldest messages (its low
/// watermark above 0: librdkafka's mock cluster keeps at most 5 MiB or
/// 100,000 messages per partition, and the stream's JSON reaches that in
/// the chaos suite).
pub fn read_change_stream(brokers: &str, topic: &str, partitions: i32) -> (Vec<StreamMessage>, bool) {
    let truncated = {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", format!("{topic}-lows-{}", rand::random::<u32>()))
            .create()
            .expect("consumer");
        (0..partitions)
            .any(|p| consumer.fetch_watermarks(topic, p, Duration::from_secs(10)).expect("watermarks").0 > 0)
    };
    let messages = read_partitions(brokers, topic, partitions, |p, offset, payload| {
        let v: Value =
            serde_json::from_slice(payload).unwrap_or_else(|e| panic!("{topic} {p}@{offset}: {e}"));
        StreamMessage {
            id: v["source"]["id"].as_str().expect("source.id").to_string(),
            version: v["source"]["version"].as_u64().expect("source.version"),
            op: v["op"].as_str().expect("op").to_string(),
        }
    });
    (messages, truncated)
}

/// Per entity, the public change stream's first occurrences must be the
/// change topic's, version for version and in the same order, with
/// matching ops (a delete is `d`, a write `c` or `u`). When the stream lost
/// its oldest messages (`truncated`), each entity's must be a suffix of the
/// topic's instead: still in order, nothing skipped after the first one
/// kept. Returns one line per breach.
pub fn check_change_stream(stream: &[StreamMessage], truncated: bool, events: &[TopicEvent]) -> Vec<String> {
    let (firsts, _) = first_occurrences(events);
    let mut seen: HashMap<&str, Vec<(u64, &str)>> = HashMap::new();
    for m in stream {
        let list = seen.entry(&m.id).or_default();
        if !list.iter().any(|(v, _)| *v == m.version) {
            list.push((m.version, &m.op));
        }
    }
    let mut out = Vec::new();
    for (id, want) in &firsts {
        let got = seen.get(id.as_str()).cloned().unwrap_or_default();
        let skipped = if truncated { want.len().saturating_sub(got.len()) } else { 0 };
        let matches = got.len() + skipped == want.len()
            && got
                .iter()
                .zip(&want[skipped..])
                .all(|((gv, gop), (wv, wop))| gv == wv && (*gop == "d") == (*wop == Op::Delete));
        if !matches {
            out.push(format!(
                "entity {id}: the change stream's first occurrences are {got:?}, the change topic's {:?}",
                want.iter().map(|(v, op)| (*v, *op)).collect::<Vec<_>>()
            ));
        }
    }
    for id in seen.keys().filter(|id| !firsts.contains_key(**id)) {
        out.push(format!("entity {id}: on the change stream but not on the change topic"));
    }
    out
}

/// Every message of `topic` (partitions `0..partitions`), each decoded by
/// `decode(partition, offset, payload)`, in partition order.
fn read_partitions<T>(
    brokers: &str,
    topic: &str,
    partitions: i32,
    decode: impl Fn(i32, i64, &[u8]) -> T,
) -> Vec<T> {
    read_messages(brokers, topic, partitions, |m| {
        decode(m.partition(), m.offset(), m.payload().expect("payload"))
    })
}

/// Every message of `topic` (partitions `0..partitions`), each read by
/// `read` (headers and all), in partition order.
pub fn read_messages<T>(
    brokers: &str,
    topic: &str,
    partitions: i32,
    read: impl Fn(&BorrowedMessage<'_>) -> T,
) -> Vec<T> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("{topic}-checker-{}", rand::random::<u32>()))
        .set("enable.auto.commit", "false")
        .create()
        .expect("checker consumer");
    let mut out = Vec::new();
    for p in 0..partitions {
        let (low, high) = consumer.fetch_watermarks(topic, p, Duration::from_secs(10)).expect("watermarks");
        if high <= low {
            continue;
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, p, Offset::Offset(low)).expect("partition");
        consumer.assign(&tpl).expect("assign");
        let mut next = low;
        // A broker just restarted (tansu after `kill -9`), on a loaded
        // machine, can take a while to answer the first fetch: what counts
        // is a minute without progress, not one slow poll.
        let mut progress_at = std::time::Instant::now();
        while next < high {
            match consumer.poll(Duration::from_secs(5)) {
                Some(Ok(m)) => {
                    next = m.offset() + 1;
                    progress_at = std::time::Instant::now();
                    out.push(read(&m));
                }
                Some(Err(e)) => panic!("reading partition {p}: {e}"),
                None if progress_at.elapsed() < Duration::from_secs(60) => {}
                None => panic!("partition {p} stalled at offset {next} of {high} for 60 s"),
            }
        }
    }
    out
}

/// Invariant W on the topic: per entity, the versions seen for the first
/// time must be exactly 1, 2, … in that order (a redelivered duplicate of an
/// earlier version is allowed, delivery being at least once, but it must be
/// the same event: one version is one write), and must cover
/// every version the store committed (`final_versions`: entity id → its
/// version in `entities`, tombstones included). Returns one line per breach.
/// Events that arrive after a newer version of their entity was already on
/// the topic (a redelivery overtaken by a later write), per entity. Not a
/// breach of Invariant W by itself (the first occurrences are what it
/// orders), but an indexer that applies such a stale event may bring back an
/// index row a newer event removed; the chaos report counts them.
pub fn stale_redeliveries(events: &[TopicEvent]) -> HashMap<String, Vec<(u64, u64)>> {
    let mut newest: HashMap<String, u64> = HashMap::new();
    let mut out: HashMap<String, Vec<(u64, u64)>> = HashMap::new();
    for e in events {
        let id = e.event.id.to_hex();
        let top = newest.entry(id.clone()).or_default();
        if e.event.version < *top {
            out.entry(id).or_default().push((e.event.version, *top));
        }
        *top = (*top).max(e.event.version);
    }
    out
}

/// The versions of entity `id` in topic order, with where each sits.
pub fn topic_history(events: &[TopicEvent], id: &str) -> Vec<String> {
    events
        .iter()
        .filter(|e| e.event.id.to_hex() == id)
        .map(|e| format!("v{}{}@{}:{}", e.event.version, op_letter(e.event.op), e.partition, e.offset))
        .collect()
}

fn op_letter(op: Op) -> &'static str {
    match op {
        Op::Delete => "d",
        _ => "",
    }
}

/// Per entity id, its versions (with their kind) in first-seen order.
pub type FirstSeen = HashMap<String, Vec<(u64, Op)>>;

/// Per entity, the versions (with their kind) in the order they first
/// appear on the topic; and a breach for every version two different
/// events carry (a redelivery is the same event again; two different
/// writes with one version would be a lost update).
pub fn first_occurrences(events: &[TopicEvent]) -> (FirstSeen, Vec<String>) {
    let mut firsts = FirstSeen::new();
    let mut seen: HashMap<(String, u64), &ChangeEvent> = HashMap::new();
    let mut out = Vec::new();
    for e in events {
        let id = e.event.id.to_hex();
        match seen.get(&(id.clone(), e.event.version)) {
            None => {
                seen.insert((id.clone(), e.event.version), &e.event);
                firsts.entry(id).or_default().push((e.event.version, e.event.op));
            }
            Some(first) if **first != e.event => out.push(format!(
                "entity {id}: two different events carry version {} (partition {} offset {})",
                e.event.version, e.partition, e.offset
            )),
            Some(_) => {}
        }
    }
    (firsts, out)
}

pub fn check_topic_order(events: &[TopicEvent], final_versions: &HashMap<String, u64>) -> Vec<String> {
    let (firsts, mut out) = first_occurrences(events);
    let firsts: HashMap<String, Vec<u64>> =
        firsts.into_iter().map(|(id, v)| (id, v.into_iter().map(|(v, _)| v).collect())).collect();
    for (id, versions) in &firsts {
        let want: Vec<u64> = (1..=versions.len() as u64).collect();
        if *versions != want {
            out.push(format!(
                "entity {id}: first occurrences on the topic are {versions:?}, not 1..n in order"
            ));
        }
    }
    for (id, v) in final_versions {
        let published = firsts.get(id).map_or(0, |f| f.len() as u64);
        if published != *v {
            out.push(format!(
                "entity {id}: the store is at version {v} but the topic has versions 1..{published}"
            ));
        }
    }
    out
}

/// Every entity's version in the store, tombstones included (id → version).
pub async fn stored_versions(env: &TestEnv) -> HashMap<String, u64> {
    let rows: Vec<(usize, (String, u64))> =
        env.fetch_all_shards("SELECT LOWER(HEX(id)), CAST(version AS UNSIGNED) FROM entities").await;
    rows.into_iter().map(|(_, r)| r).collect()
}
