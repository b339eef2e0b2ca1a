//! The public change stream (issue 19): every write reaches
//! `changes.topic` as a JSON envelope in Debezium's shape, keyed by the id
//! in hex, with version and op headers, each valid against the shipped
//! JSON Schema (checked with PyPI `jsonschema`); per entity the versions
//! come in order; deduplicated on (id, version) and replayed, the stream
//! rebuilds exactly the live entities. `bagstore changes snapshot` brings
//! a new group up to date while writes go on, read back both here and by
//! a PyPI `kafka-python` consumer (`tests/python/change_stream_consumer.py`)
//! on librdkafka's mock cluster, and by the same consumer against a
//! literal `bagstore dev` (its embedded Kafka) across a writer kill; on the
//! standalone broker, across a writer kill, it is in `chaos_tansu.rs`.

use bagstore_tests::{eventually, TestEnv, STANDARD_INDEXES};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::Duration;

/// One message of the change stream.
#[derive(Debug, Clone)]
struct Change {
    partition: i32,
    key: String,
    headers: BTreeMap<String, String>,
    value: Value,
}

/// Where [`read_stream`] starts on each partition.
enum From<'a> {
    /// The first message still kept.
    Beginning,
    /// The group's committed offsets (its view of the stream).
    Group(&'a str),
}

/// The messages on `topic` (4 partitions) from `from` to the end, in
/// partition order, without committing anything.
fn read_stream(brokers: &str, topic: &str, from: From<'_>) -> Vec<Change> {
    let group = match from {
        From::Beginning => format!("{topic}-reader-{}", rand::random::<u32>()),
        From::Group(g) => g.to_string(),
    };
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", &group)
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut parts = TopicPartitionList::new();
    for p in 0..4 {
        parts.add_partition(topic, p);
    }
    let committed = consumer.committed_offsets(parts, Duration::from_secs(10)).unwrap();
    let mut out = Vec::new();
    for p in 0..4 {
        let (low, high) = consumer.fetch_watermarks(topic, p, Duration::from_secs(10)).unwrap();
        let start = match from {
            From::Beginning => low,
            From::Group(_) => match committed.find_partition(topic, p).unwrap().offset() {
                Offset::Offset(o) => o,
                _ => panic!("group {group} has no offset on partition {p}"),
            },
        };
        if high <= start {
            continue;
        }
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(topic, p, Offset::Offset(start)).unwrap();
        consumer.assign(&tpl).unwrap();
        let mut next = start;
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
            let all = tokio::task::spawn_blocking(move || read_stream(&brokers, topic, From::Beginning))
                .await
                .unwrap();
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
    let dir = tempfile::tempdir().unwrap();
    let values: Vec<&Value> = changes.iter().map(|c| &c.value).collect();
    std::fs::write(dir.path().join("values.json"), serde_json::to_vec(&values).unwrap()).unwrap();
    let schema = bagstore_tests::python::repo_file("schemas/json/change-event.v1.json");
    let check = "import json, sys, jsonschema\n\
                 schema = json.load(open(sys.argv[1]))\n\
                 jsonschema.Draft202012Validator.check_schema(schema)\n\
                 v = jsonschema.Draft202012Validator(schema)\n\
                 values = json.load(open(sys.argv[2]))\n\
                 for x in values:\n    v.validate(x)\n\
                 bad = {'op': 'd', 'before': None, 'after': {'a': 1}, 'ts_ms': 1, 'source': values[0]['source']}\n\
                 assert not v.is_valid(bad), 'a delete with an after passed'\n\
                 print(f'{len(values)} valid')\n";
    let out = bagstore_tests::std_command(bagstore_tests::python::python())
        .args(["-c", check])
        .arg(&schema)
        .arg(dir.path().join("values.json"))
        .output()
        .expect("python from the tests' venv (scripts/test installs it)");
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{said}");
    assert!(said.contains(&format!("{} valid", changes.len())), "{said}");
}

/// `bagstore changes snapshot --group G` brings a new group up to date
/// while writes go on: killed half way and run again, it finishes; then
/// reading G from its offsets, keeping a message only when its version is
/// above the last one kept for its id, gives exactly the live entities
/// and their versions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_then_the_tail_give_a_new_group_every_live_entity() {
    let env = TestEnv::new("snapshot", STANDARD_INDEXES).await;
    env.migrate().await;
    let writer = env.spawn(&["writer", "--http", "127.0.0.1:0"]).await;
    let reader = env.spawn(&["reader", "--http", "127.0.0.1:0"]).await;
    let (api, read) = (writer.api(), reader.api());
    let id = |i: u32| format!("{i:032x}");
    for chunk in 0..6u32 {
        let items: Vec<Value> =
            (0..100).map(|i| json!({"id": id(chunk * 100 + i), "n": i, "v": 0})).collect();
        assert_eq!(api.batch(&items).await.0, 200);
    }
    for i in 0..40 {
        assert_eq!(api.delete(&id(i * 7)).await.0, 200);
    }

    // Writes go on during the snapshot: updates, deletes, new ids.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (api, stop) = (api.clone(), stop.clone());
        tokio::spawn(async move {
            let mut k = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                k += 1;
                let target = (k * 37) % 700;
                if k.is_multiple_of(5) {
                    let _ = api.delete(&format!("{target:032x}")).await;
                } else {
                    let _ = api.put(&format!("{target:032x}"), &json!({"n": target, "v": k})).await;
                }
            }
            k
        })
    };
    let group = "search-indexer";
    let args = env.args(&["changes", "snapshot", "--group", group, "--rate", "400"]);
    let meta = env.pool(0).await;
    let mut child = bagstore_tests::command(bagstore_tests::bagstore_bin())
        .args(&args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    eventually("the snapshot emitted something", Duration::from_secs(60), || async {
        let n: Option<(u64,)> = sqlx::query_as("SELECT rows_emitted FROM bagstore_snapshots WHERE grp = ?")
            .bind(group)
            .fetch_optional(&meta)
            .await
            .unwrap();
        n.filter(|(n,)| *n > 0).map(|_| ())
    })
    .await;
    child.kill().await.unwrap();
    let (ok, out, err) = env.run(&args, &[]).await;
    assert!(ok && out.contains("done"), "{out}{err}");
    assert!(err.contains("resuming"), "the second run did not resume: {err}");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let writes = load.await.unwrap();
    assert!(writes > 20, "only {writes} writes ran beside the snapshot");
    env.until_caught_up(&[]).await;

    let topic = "bagstore.changes.v1";
    let brokers = env.brokers();
    let seen =
        tokio::task::spawn_blocking(move || read_stream(&brokers, topic, From::Group(group))).await.unwrap();
    let reads = seen.iter().filter(|c| c.value["op"] == "r").count();
    assert!(reads > 0, "no snapshot message");
    let mut state: BTreeMap<String, (u64, Value)> = BTreeMap::new();
    for c in &seen {
        let v = c.value["source"]["version"].as_u64().unwrap();
        if state.get(&c.key).is_some_and(|(last, _)| *last >= v) {
            continue;
        }
        state.insert(c.key.clone(), (v, c.value["after"].clone()));
    }
    let mut live = 0;
    for i in 0..700u32 {
        let (status, got) = read.get(&id(i)).await;
        let have = state.get(&id(i));
        match status {
            200 => {
                live += 1;
                let (v, after) =
                    have.unwrap_or_else(|| panic!("{}: live but never reached the group", id(i)));
                assert_eq!((got["version"].as_u64().unwrap(), &got["properties"]), (*v, after), "{}", id(i));
            }
            404 => assert!(
                have.is_none_or(|(_, after)| after.is_null()),
                "{}: gone but the group has {have:?}",
                id(i)
            ),
            other => panic!("{}: {other}", id(i)),
        }
    }
    assert!(live > 400, "{live} live entities");

    // The same group read by kafka-python, a client that shares no code
    // with librdkafka (the mock cluster needs its protocol version pinned),
    // every message checked against the JSON Schema.
    let brokers = env.brokers();
    let (doc, said) = tokio::task::spawn_blocking(move || {
        bagstore_tests::python::consume_change_stream(&brokers, topic, group, Some("1.0.0"))
    })
    .await
    .unwrap();
    let by_python = doc["live"].as_object().unwrap();
    assert_eq!(by_python.len(), live, "{said}");
    for (id, e) in by_python {
        let (v, after) = &state[id];
        assert_eq!((e["version"].as_u64(), &e["properties"]), (Some(*v), after), "{id}: {said}");
    }
    let (ok, out, err) = env.run(&args, &[]).await;
    assert!(ok && out.contains("already done"), "{out}{err}");
}

/// The change stream of a literal `bagstore dev` (private MariaDB shards,
/// the embedded Kafka; the stream on by default), read by a PyPI
/// `kafka-python` consumer: a second writer process joins dev's cluster
/// and is killed with `kill -9` half way through a mixed workload and
/// started again, `bagstore changes snapshot` brings a new group up to
/// date, more writes follow, and the consumer (every message checked
/// against the JSON Schema) ends with exactly the live entities and their
/// versions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_python_consumer_rebuilds_bagstore_devs_live_entities_from_snapshot_and_tail() {
    use bagstore_tests::python::{assert_rebuilt, consume_change_stream, mixed_round};
    use bagstore_tests::Proc;
    let dir = tempfile::tempdir().unwrap();
    let indexes = dir.path().join("indexes.toml");
    std::fs::write(&indexes, STANDARD_INDEXES).unwrap();
    let args = |list: &[&str], config: &std::path::Path| -> Vec<String> {
        list.iter().map(|s| s.to_string()).chain(["--config".into(), config.display().to_string()]).collect()
    };
    let data = dir.path().join("data").display().to_string();
    let dev =
        Proc::start(&args(&["dev", "--http", "127.0.0.1:0", "--data-dir", &data], &indexes), dir.path(), &[])
            .await
            .unwrap();
    // bagstore dev ready: http=<url> shards=<dsn>,<dsn> kafka=<bootstrap>
    let word = |prefix: &str| {
        dev.ready_line.split_whitespace().find_map(|w| w.strip_prefix(prefix)).unwrap().to_string()
    };
    let (shards, brokers) = (word("shards="), word("kafka="));
    // Another process in dev's cluster: its shards and its embedded Kafka.
    let joined = dir.path().join("joined.toml");
    let dsns: Vec<String> = shards.split(',').map(|d| format!("{d:?}")).collect();
    std::fs::write(
        &joined,
        format!(
            "[mysql]\nshards = [{}]\n\n[kafka]\nbrokers = {brokers:?}\nreplication_factor = 1\n\n{STANDARD_INDEXES}",
            dsns.join(", ")
        ),
    )
    .unwrap();
    let writer_args = args(&["writer", "--http", "127.0.0.1:0"], &joined);
    let spawn_writer = || Proc::start(&writer_args, dir.path(), &[]);
    let writer = spawn_writer().await.unwrap();
    mixed_round(&writer.api(), 0).await;
    mixed_round(&dev.api(), 1).await;
    writer.kill9().await;
    let writer = spawn_writer().await.unwrap();
    mixed_round(&writer.api(), 2).await;
    let group = "dev-warehouse";
    let snapshot = bagstore_tests::command(bagstore_tests::bagstore_bin())
        .args(args(&["changes", "snapshot", "--group", group], &joined))
        .output()
        .await
        .unwrap();
    let said =
        format!("{}{}", String::from_utf8_lossy(&snapshot.stdout), String::from_utf8_lossy(&snapshot.stderr));
    assert!(snapshot.status.success() && said.contains("done"), "{said}");
    mixed_round(&dev.api(), 3).await;
    // Everything committed is published: every outbox is empty.
    let pools: Vec<sqlx::MySqlPool> =
        futures::future::join_all(shards.split(',').map(sqlx::MySqlPool::connect))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
    eventually("every outbox to be published", Duration::from_secs(60), || async {
        for p in &pools {
            let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM outbox").fetch_one(p).await.unwrap();
            if n > 0 {
                return None;
            }
        }
        Some(())
    })
    .await;

    let topic = "bagstore.changes.v1";
    let (doc, said) =
        tokio::task::spawn_blocking(move || consume_change_stream(&brokers, topic, group, Some("1.0.0")))
            .await
            .unwrap();
    eprintln!("{said}");
    assert_rebuilt(&dev.api(), &doc, &said).await;
    drop(writer);
    assert_eq!(dev.terminate().await, Some(0));
}
