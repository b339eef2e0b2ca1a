//! The Python tools the tests drive (`tests/python/requirements.txt`):
//! clients that share no code with bagstore or librdkafka, run as a user
//! of them would.

use std::path::{Path, PathBuf};

/// The venv `scripts/test` makes (`ensure_python_tools` in
/// `scripts/lib.sh`): `$BAGSTORE_PYTHON_TOOLS`, else its default place.
pub fn python_tools() -> PathBuf {
    let dir = std::env::var_os("BAGSTORE_PYTHON_TOOLS").map(PathBuf::from).unwrap_or_else(|| {
        Path::new(&std::env::var_os("HOME").unwrap_or_default()).join(".cache/bagstore/python-tools")
    });
    assert!(
        dir.join(".complete").exists(),
        "no Python tools in {}: scripts/test installs them (ensure_python_tools in scripts/lib.sh)",
        dir.display()
    );
    dir
}

/// The venv's python.
pub fn python() -> PathBuf {
    python_tools().join("bin/python")
}

/// A file of this repository, by its path from the workspace root.
pub fn repo_file(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

/// Runs `cmd`; panics with its output unless it succeeds. Returns its
/// stdout and stderr.
pub fn run_tool(cmd: &mut std::process::Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{what} failed ({}):\n{text}", out.status);
    text
}

/// Reads `group`'s view of the change stream with the kafka-python
/// consumer (`tests/python/change_stream_consumer.py`), every message
/// checked against the JSON Schema; returns what it wrote (`live`: id →
/// {"version", "properties"}; `from`: partition → the offset it started
/// at; `ops`: messages per op) and what it said.
pub fn consume_change_stream(
    bootstrap: &str,
    topic: &str,
    group: &str,
    api_version: Option<&str>,
) -> (serde_json::Value, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("live.json");
    let mut cmd = crate::std_command(python());
    cmd.arg(repo_file("tests/python/change_stream_consumer.py"))
        .arg(bootstrap)
        .arg(topic)
        .arg(group)
        .arg(repo_file("schemas/json/change-event.v1.json"))
        .arg(&out);
    if let Some(v) = api_version {
        cmd.arg(v);
    }
    let said = run_tool(&mut cmd, "the kafka-python change stream consumer");
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&out).expect("its output")).expect("JSON");
    (doc, said)
}

/// One round of the change stream consumers' mixed workload through
/// `api` (a writer): a batch of 100 new entities (ids `round*100 ..`), then
/// 20 rewrites and deletes over the first 400 ids.
pub async fn mixed_round(api: &crate::Api, round: u32) {
    use serde_json::json;
    let items: Vec<serde_json::Value> = (0..100)
        .map(|i| json!({"id": format!("{:032x}", round * 100 + i), "round": round, "i": i}))
        .collect();
    assert_eq!(api.batch(&items).await.0, 200);
    for i in 0..20 {
        let target = format!("{:032x}", (round * 31 + i * 7) % 400);
        if i % 4 == 0 {
            let _ = api.delete(&target).await;
        } else {
            let _ = api.put(&target, &serde_json::json!({"round": round, "rewritten": i})).await;
        }
    }
}

/// Checks what [`consume_change_stream`] rebuilt (`doc`; `said` is its
/// output) after rounds 0 to 2 of [`mixed_round`], a snapshot, and round 3:
/// the group started where the snapshot placed it, past the writes of
/// rounds 0 to 2 (not at the beginning: every create of those rounds
/// reached it as a snapshot read, not as its create), and it ends with the
/// same live entities as the store read through `reader`, at the same
/// versions, with the same properties.
pub async fn assert_rebuilt(reader: &crate::Api, doc: &serde_json::Value, said: &str) {
    let from: i64 = doc["from"].as_object().expect("from").values().map(|v| v.as_i64().unwrap_or(0)).sum();
    assert!(from >= 300, "the group started at {from} messages in: {said}");
    assert!(doc["ops"]["r"].as_u64().unwrap_or(0) > 200, "too few snapshot reads: {said}");
    let live = doc["live"].as_object().expect("live");
    let mut expected = 0;
    for i in 0..400u32 {
        let id = format!("{i:032x}");
        let (status, got) = reader.get(&id).await;
        match status {
            200 => {
                expected += 1;
                let e =
                    live.get(&id).unwrap_or_else(|| panic!("{id} is live but not in the consumer's view"));
                assert_eq!((&e["version"], &e["properties"]), (&got["version"], &got["properties"]), "{id}");
            }
            404 => assert!(!live.contains_key(&id), "{id} is gone but the consumer has it"),
            other => panic!("{id}: {other}"),
        }
    }
    assert_eq!(live.len(), expected, "the consumer has entities the store does not");
    assert!(expected > 250, "{expected} live entities");
}
