//! Kafka ingest driven as a producer would: PyPI kafka-python sends the
//! commands (`tests/python/ingest_producer.py`), writers apply them, and
//! the outcome is checked against the producer's own plan: every valid
//! command applied exactly once (each entity's version and properties),
//! every malformed or refused one dead-lettered with its reason, every
//! correlation id answered exactly once.

use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use crate::python::{python, repo_file, run_tool};
use crate::{Api, Proc, TestEnv};

/// The producer's plan and what it said.
#[derive(Debug)]
pub struct Sent {
    pub plan: Value,
    pub said: String,
    dir: tempfile::TempDir,
}

/// Sends `count` commands over `entities` entities to the ingest topic
/// (blocking: run it on a blocking thread).
pub fn produce(bootstrap: &str, count: usize, entities: usize, seed: u64, api_version: Option<&str>) -> Sent {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("plan.json");
    let mut cmd = crate::std_command(python());
    cmd.arg(repo_file("tests/python/ingest_producer.py"))
        .arg("produce")
        .arg(bootstrap)
        .arg("bagstore.ingest.v1")
        .arg(count.to_string())
        .arg(entities.to_string())
        .arg(seed.to_string())
        .arg(&out);
    cmd.args(api_version);
    let said = run_tool(&mut cmd, "the kafka-python ingest producer");
    let plan = serde_json::from_slice(&std::fs::read(&out).expect("the plan")).expect("JSON");
    Sent { plan, said, dir }
}

/// Reads the reply and dead-letter topics until the plan is answered
/// (blocking).
pub fn collect(bootstrap: &str, sent: &Sent, api_version: Option<&str>) -> (Value, String) {
    let out = sent.dir.path().join("collected.json");
    let mut cmd = crate::std_command(python());
    cmd.arg(repo_file("tests/python/ingest_producer.py"))
        .arg("collect")
        .arg(bootstrap)
        .arg("bagstore.ingest.v1.replies")
        .arg("bagstore.ingest.v1.dlq")
        .arg(sent.dir.path().join("plan.json"))
        .arg(&out);
    cmd.args(api_version);
    let said = run_tool(&mut cmd, "the kafka-python reply collector");
    (serde_json::from_slice(&std::fs::read(&out).expect("its output")).expect("JSON"), said)
}

/// What the run came to, for the test's report.
#[derive(Debug, Default)]
pub struct Tally {
    pub applied_entities: usize,
    pub answered: usize,
    pub dead_lettered: usize,
}

/// Checks the store and the topics against the plan; panics on the first
/// difference.
pub async fn check(reader: &Api, sent: &Sent, collected: &Value) -> Tally {
    let mut tally = Tally::default();
    // Exactly once in effect: each entity's version counts its valid
    // commands, and its properties are theirs applied in order.
    for (id, want) in sent.plan["final"].as_object().expect("final") {
        let (status, got) = reader.get(id).await;
        if want["version"] == 0 {
            assert_eq!(status, 404, "{id} had no valid command but exists: {got}");
            continue;
        }
        assert_eq!(status, 200, "{id}: {got}");
        assert_eq!(
            (&got["version"], &got["properties"]),
            (&want["version"], &want["properties"]),
            "{id}: stored (left) differs from the producer's valid commands applied once each (right)"
        );
        tally.applied_entities += 1;
    }
    let replies = collected["replies"].as_object().expect("replies");
    let dead = collected["dead"].as_array().expect("dead letters");
    // One dead letter per command: no source twice.
    let mut sources = std::collections::HashSet::new();
    for d in dead {
        assert!(sources.insert(d["source"].to_string()), "dead-lettered twice: {d}");
    }
    let mut dead_by_command: HashMap<&str, Vec<&Value>> = HashMap::new();
    for d in dead {
        dead_by_command.entry(d["command"].as_str().unwrap_or_default()).or_default().push(d);
    }
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for m in sent.plan["sent"].as_array().expect("sent") {
        let kind = m["kind"].as_str().expect("kind");
        *kinds.entry(kind).or_default() += 1;
        if let Some(cid) = m["cid"].as_str() {
            let answers = replies
                .get(cid)
                .and_then(Value::as_array)
                .unwrap_or_else(|| panic!("{cid} ({kind}) got no reply"));
            assert_eq!(answers.len(), 1, "{cid} ({kind}) was answered {} times: {answers:?}", answers.len());
            let a = &answers[0];
            let expect = &m["expect"];
            assert_eq!(a["ok"], expect["ok"], "{cid} ({kind}): {a} but expected {expect}");
            if expect["ok"] == true {
                assert_eq!(
                    (&a["id"], &a["version"]),
                    (&expect["id"], &expect["version"]),
                    "{cid} ({kind}): {a}"
                );
            } else {
                assert!(a["problem"]["detail"].as_str().is_some_and(|d| !d.is_empty()), "{cid}: {a}");
            }
            tally.answered += 1;
        }
        if kind == "malformed" || kind == "refused" {
            let payload = m["payload"].as_str().expect("payload");
            let found = dead_by_command
                .get(payload)
                .unwrap_or_else(|| panic!("not dead-lettered ({kind}): {payload}"));
            assert!(
                found.iter().all(|d| d["reason"].as_str().is_some_and(|r| !r.is_empty())),
                "a dead letter without its reason: {found:?}"
            );
            tally.dead_lettered += 1;
        }
    }
    // Nothing valid reached the dead-letter topic.
    let expected_dead: std::collections::HashSet<&str> = sent.plan["sent"]
        .as_array()
        .expect("sent")
        .iter()
        .filter(|m| m["kind"] == "malformed" || m["kind"] == "refused")
        .filter_map(|m| m["payload"].as_str())
        .collect();
    if let Some(extra) = dead_by_command.keys().find(|c| !expected_dead.contains(*c)) {
        panic!("a valid command was dead-lettered: {:?}", dead_by_command[extra]);
    }
    assert!(kinds.get("duplicate").copied().unwrap_or(0) > 0 && !expected_dead.is_empty(), "{kinds:?}");
    tally
}

/// The ingest topic's lag as `/v1/lag` reports it.
pub async fn ingest_lag(reader: &Api) -> Option<i64> {
    let (status, lag) = reader.raw(reqwest::Method::GET, "/v1/lag", Vec::new()).await;
    assert_eq!(status, 200, "{lag}");
    lag["ingest"]["lag_events"].as_i64()
}

/// Commands a writer process took from the ingest topic (every outcome).
pub async fn taken_by(writer: &Proc) -> f64 {
    crate::metric_sum(&writer.api().metrics().await, "bagstore_ingest_commands_total", &[])
}

/// The ingest partitions a writer process holds now.
pub async fn holds(writer: &Proc) -> f64 {
    crate::metric_sum(&writer.api().metrics().await, "bagstore_ingest_assigned_partitions", &[])
}

/// The whole run: `count` commands from kafka-python while two writers
/// consume them; the first is killed with `kill -9` once it has taken
/// some and while it holds ingest partitions (its lease's share), and a
/// writer is started again at once (a new member: no `ingest.member` is
/// set, so the dead one's partitions move only when its lease ends).
/// Returns the tally.
pub async fn producer_scenario(env: &TestEnv, count: usize, api_version: Option<&'static str>) -> Tally {
    let reader = env.spawn(&["reader", "--http", "127.0.0.1:0"]).await;
    let first = env.spawn(&["writer", "--http", "127.0.0.1:0"]).await;
    let _second = env.spawn(&["writer", "--http", "127.0.0.1:0"]).await;
    let bootstrap = env.brokers();
    let producing =
        tokio::task::spawn_blocking(move || produce(&bootstrap, count, 300, 20261123, api_version));
    let (taken, held) = crate::eventually(
        "the first writer to take ingest commands while it holds ingest partitions",
        Duration::from_secs(120),
        || async {
            let (n, held) = (taken_by(&first).await, holds(&first).await);
            (n >= 300.0 && held > 0.0).then_some((n, held))
        },
    )
    .await;
    first.kill9().await;
    let _restarted = env.spawn(&["writer", "--http", "127.0.0.1:0"]).await;
    eprintln!(
        "ingest: the first writer was killed with kill -9 after taking {taken} commands, holding {held} \
         ingest partitions, and a writer was started again"
    );
    let sent = producing.await.expect("the producer ran");
    eprintln!("{}", sent.said);
    // Every answer is on its topic once the offsets are committed, so a
    // second answer cannot come after the collector is done.
    let api = reader.api();
    crate::eventually("the ingest group to catch up", Duration::from_secs(60), || async {
        (ingest_lag(&api).await == Some(0)).then_some(())
    })
    .await;
    let bootstrap = env.brokers();
    let (collected, sent) = tokio::task::spawn_blocking(move || {
        let c = collect(&bootstrap, &sent, api_version);
        (c, sent)
    })
    .await
    .expect("the collector ran");
    eprintln!("{}", collected.1);
    check(&api, &sent, &collected.0).await
}
