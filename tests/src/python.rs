//! The Python tools the tests drive (`tests/python/requirements.txt`):
//! clients that share no code with bagstore or librdkafka, run as a user
//! of them would.

use std::path::{Path, PathBuf};
use std::process::Command;

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
pub fn run_tool(cmd: &mut Command, what: &str) -> String {
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
    let mut cmd = Command::new(python());
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
