//! The `bagstore` command as an HTTP client: tables for people, JSON for
//! scripts, clear errors with a non-zero exit.

use bagstore_tests::{bagstore_bin, until_query_is, TestEnv, STANDARD_INDEXES};
use serde_json::{json, Value};

async fn run(args: &[&str]) -> (bool, String, String) {
    let out = tokio::process::Command::new(bagstore_bin()).args(args).output().await.unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_commands_write_read_query_and_administer() {
    let env = TestEnv::new("cli", STANDARD_INDEXES).await;
    let dev = env.dev().await;
    let url = dev.url.as_str();
    let id = "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1";
    let user = "b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2";

    let body = json!({"user_id": user, "title": "from the cli"}).to_string();
    let (ok, out, err) = run(&["put", "--url", url, "--id", id, &body]).await;
    assert!(ok, "{err}");
    assert!(out.starts_with(&format!("{id} version 1 (write_token {id}.1)")), "{out}");
    let (ok, out, _) = run(&["put", "--url", url, "--id", id, "--if-match", "7", &body]).await;
    assert!(!ok, "{out}");

    let (ok, out, _) = run(&["get", "--url", url, id]).await;
    assert!(ok);
    let doc: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(doc["properties"]["title"], "from the cli");

    until_query_is(&dev.api(), &json!({"where": {"user_id": user}}), &[id]).await;
    let q = json!({"where": {"user_id": user}}).to_string();
    let (ok, out, _) = run(&["query", "--url", url, &q]).await;
    assert!(ok);
    assert!(out.lines().next().unwrap().starts_with("ID"), "{out}");
    assert!(out.contains(id) && out.contains("index index_user_id"), "{out}");
    let (ok, out, _) = run(&["query", "--url", url, "--json", &q]).await;
    assert!(ok);
    let doc: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(doc["items"][0]["id"], id);

    let (ok, out, _) = run(&["index", "list", "--url", url]).await;
    assert!(ok);
    let row = out.lines().find(|l| l.starts_with("index_user_id ")).unwrap_or_else(|| panic!("{out}"));
    assert!(row.contains("ACTIVE") && row.contains("user_id:uuid"), "{row}");

    let (ok, out, _) = run(&["lag", "--url", url]).await;
    assert!(ok);
    assert!(out.starts_with("INDEX"), "{out}");
    assert!(out.lines().any(|l| l.starts_with("index_tag ")), "{out}");
    let (ok, out, _) = run(&["lag", "--url", url, "--json"]).await;
    assert!(ok);
    let doc: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(doc["indexes"].as_array().unwrap().len(), 4);

    let (ok, out, err) = run(&["index", "drop", "index_tag", "--url", url]).await;
    assert!(ok, "{err}");
    assert!(out.contains("index index_tag dropped on 2 shards"), "{out}");
    let (_, out, _) = run(&["index", "list", "--url", url]).await;
    assert!(out.lines().any(|l| l.starts_with("index_tag ") && l.contains("DROPPING")), "{out}");

    let (ok, out, _) = run(&["delete", "--url", url, id]).await;
    assert!(ok && out.contains("deleted at version 2"), "{out}");
    let (ok, _, err) = run(&["get", "--url", url, id]).await;
    assert!(!ok);
    assert!(err.contains("404 Not found"), "{err}");
    let (ok, _, err) = run(&["put", "--url", url, "{not json"]).await;
    assert!(!ok && err.contains("not valid JSON"), "{err}");
    dev.terminate().await;
}
