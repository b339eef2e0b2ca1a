//! The public change stream (issue 19): every write reaches
//! `changes.topic` as a JSON envelope in Debezium's shape, keyed by the id
//! in hex, with version and op headers, each valid against the shipped
//! JSON Schema (checked with PyPI `jsonschema`, from the venv of
//! `clients.rs`); per entity the versions come in order; deduplicated on
//! (id, version) and replayed, the stream rebuilds exactly the live
//! entities.

use bagstore_tests::{eventually, TestEnv, STANDARD_INDEXES};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// One message of the change stream.
#[derive(Debug, Clone)]
struct Change {
    partition: i32,
    key: String,
    headers: BTreeMap<String, String>,
    value: Value,
}

/// Every message on `topic` (4 partitions), in partition order.
fn read_all(brokers: &str, topic: &str) -> Vec<Change> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("{topic}-reader-{}", rand::random::<u32>()))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut out = Vec::new();
    for p in 0..4 {
        let (low, high) = consumer.fetch_watermarks(topic, p, Duration::from_secs(10)).unwrap();
        if high <= low {
            continue;
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, p, Offset::Offset(low)).unwrap();
        consumer.assign(&tpl).unwrap();
        let mut next = low;
        while next < high {
            let m = consumer.poll(Duration::from_secs(10)).expect("a message in time").unwrap();
            next = m.offset() + 1;
            let headers = m
                .headers()
                .map(|h| {
                    h.iter()
                        .map(|h| {
                            (h.key.to_string(), String::from_utf8_lossy(h.value.unwrap_or_default()).into())
                        })
                        .collect()
                })
                .unwrap_or_default();
            out.push(Change {
                partition: p,
                key: String::from_utf8(m.key().unwrap().to_vec()).unwrap(),
                headers,
                value: serde_json::from_slice(m.payload().unwrap()).unwrap(),
            });
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_write_reaches_the_public_change_stream_as_a_documented_envelope() {
    let env = TestEnv::new("changes", STANDARD_INDEXES).await;
    let dev = env.dev().await;
    let api = dev.api();
    let (a, b) = ("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb");
    assert_eq!(api.put(a, &json!({"user_id": a, "n": 1})).await.0, 201);
    assert_eq!(api.put(a, &json!({"user_id": a, "n": 2, "tags": ["x"]})).await.0, 200);
    assert_eq!(api.put(b, &json!({"title": "short-lived"})).await.0, 201);
    assert_eq!(api.delete(b).await.0, 200);
    let many: Vec<Value> = (0..20).map(|i| json!({"id": format!("{i:032x}"), "i": i})).collect();
    assert_eq!(api.batch(&many).await.0, 200);
    assert_eq!(api.put(&format!("{:032x}", 3), &json!({"i": 3, "again": true})).await.0, 200);
    assert_eq!(api.delete(&format!("{:032x}", 4)).await.0, 200);
    // 2 + 2 + 20 + 1 + 1 writes.
    let topic = "bagstore.changes.v1";
    let brokers = env.brokers();
    let changes = eventually("26 messages on the change stream", Duration::from_secs(30), || {
        let brokers = brokers.clone();
        async move {
            let all = tokio::task::spawn_blocking(move || read_all(&brokers, topic)).await.unwrap();
            (all.len() >= 26).then_some(all)
        }
    })
    .await;

    // Each message: key = source.id, headers = version and op, and the op
    // fits the bags.
    for c in &changes {
        let src = &c.value["source"];
        assert_eq!(c.key, src["id"].as_str().unwrap(), "{c:?}");
        assert_eq!(c.headers["bagstore-version"], src["version"].to_string(), "{c:?}");
        assert_eq!(c.headers["bagstore-op"], c.value["op"].as_str().unwrap(), "{c:?}");
        assert_eq!(c.value["ts_ms"].as_i64().unwrap(), src["committed_at_us"].as_i64().unwrap() / 1000);
    }
    let ops: Vec<(String, u64, String)> = changes
        .iter()
        .filter(|c| c.key == a || c.key == b)
        .map(|c| {
            (
                c.key.clone(),
                c.value["source"]["version"].as_u64().unwrap(),
                c.value["op"].as_str().unwrap().into(),
            )
        })
        .collect();
    for want in [(a, 1, "c"), (a, 2, "u"), (b, 1, "c"), (b, 2, "d")] {
        assert!(
            ops.iter().any(|(k, v, op)| (k.as_str(), *v, op.as_str()) == want),
            "{want:?} missing from {ops:?}"
        );
    }
    let a2 = changes.iter().find(|c| c.key == a && c.value["source"]["version"] == 2).unwrap();
    assert_eq!(a2.value["before"], json!({"user_id": a, "n": 1}));
    assert_eq!(a2.value["after"], json!({"user_id": a, "n": 2, "tags": ["x"]}));

    // Per entity, one partition and versions in order; deduplicated on
    // (id, version) and replayed, the stream gives the live entities.
    let mut state: BTreeMap<String, (u64, Value)> = BTreeMap::new();
    let mut partition_of: BTreeMap<String, i32> = BTreeMap::new();
    for c in &changes {
        assert_eq!(
            *partition_of.entry(c.key.clone()).or_insert(c.partition),
            c.partition,
            "{} on two partitions",
            c.key
        );
        let v = c.value["source"]["version"].as_u64().unwrap();
        let last = state.get(&c.key).map_or(0, |s| s.0);
        if v <= last {
            continue; // a redelivery
        }
        assert_eq!(v, last + 1, "{}: version {v} after {last}", c.key);
        state.insert(c.key.clone(), (v, c.value["after"].clone()));
    }
    let live: BTreeMap<&String, &Value> =
        state.iter().filter(|(_, (_, after))| !after.is_null()).map(|(id, (_, after))| (id, after)).collect();
    assert_eq!(live.len(), 1 + 19, "{live:?}");
    for (id, after) in &live {
        let (status, got) = api.get(id).await;
        assert_eq!(status, 200, "{id}");
        assert_eq!(&&got["properties"], after, "{id}");
        assert_eq!(got["version"], state[*id].0);
    }

    // The JSON Schema, by a validator that is not ours.
    let tools =
        std::env::var_os("BAGSTORE_OPENAPI_TOOLS").map(std::path::PathBuf::from).unwrap_or_else(|| {
            Path::new(&std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/bagstore/openapi-tools-0.9.0-0.29.1")
        });
    let dir = tempfile::tempdir().unwrap();
    let values: Vec<&Value> = changes.iter().map(|c| &c.value).collect();
    std::fs::write(dir.path().join("values.json"), serde_json::to_vec(&values).unwrap()).unwrap();
    let schema = Path::new(env!("CARGO_MANIFEST_DIR")).join("../schemas/json/change-event.v1.json");
    let check = "import json, sys, jsonschema\n\
                 schema = json.load(open(sys.argv[1]))\n\
                 jsonschema.Draft202012Validator.check_schema(schema)\n\
                 v = jsonschema.Draft202012Validator(schema)\n\
                 values = json.load(open(sys.argv[2]))\n\
                 for x in values:\n    v.validate(x)\n\
                 bad = {'op': 'd', 'before': None, 'after': {'a': 1}, 'ts_ms': 1, 'source': values[0]['source']}\n\
                 assert not v.is_valid(bad), 'a delete with an after passed'\n\
                 print(f'{len(values)} valid')\n";
    let out = std::process::Command::new(tools.join("bin/python"))
        .args(["-c", check])
        .arg(&schema)
        .arg(dir.path().join("values.json"))
        .output()
        .expect("python from the OpenAPI tools venv (scripts/test installs it)");
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{said}");
    assert!(said.contains(&format!("{} valid", changes.len())), "{said}");
}
