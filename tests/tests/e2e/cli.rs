//! The `bagstore` command as an HTTP client: tables for people, JSON for
//! scripts, clear errors with a non-zero exit.

use bagstore_tests::{bagstore_bin, until_query_is, TestEnv, STANDARD_INDEXES};
use serde_json::{json, Value};

async fn run(args: &[&str]) -> (bool, String, String) {
    let out = bagstore_tests::command(bagstore_bin()).args(args).output().await.unwrap();
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

    // Partial updates: operators, a merge patch, an upsert.
    let (ok, out, err) = run(&["patch", "--url", url, id, r#"{"$inc": {"views": 2}}"#]).await;
    assert!(ok && out.starts_with(&format!("{id} version 2")), "{out}{err}");
    let (ok, out, err) =
        run(&["patch", "--url", url, "--merge", "--if-match", "2", id, r#"{"title": null}"#]).await;
    assert!(ok && out.starts_with(&format!("{id} version 3")), "{out}{err}");
    let (_, out, _) = run(&["get", "--url", url, id]).await;
    let doc: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(doc["properties"], json!({"user_id": user, "views": 2}));
    let fresh = "c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3";
    let (ok, _, err) = run(&["patch", "--url", url, fresh, r#"{"$inc": {"n": 1}}"#]).await;
    assert!(!ok && err.contains("404"), "{err}");
    let (ok, out, err) =
        run(&["patch", "--url", url, "--upsert", "--json", fresh, r#"{"$inc": {"n": 1}}"#]).await;
    assert!(ok, "{err}");
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap()["version"], 1);

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
    assert!(ok && out.contains("deleted at version 4"), "{out}");
    let (ok, _, err) = run(&["get", "--url", url, id]).await;
    assert!(!ok);
    assert!(err.contains("404 Not found"), "{err}");
    let (ok, _, err) = run(&["put", "--url", url, "{not json"]).await;
    assert!(!ok && err.contains("not valid JSON"), "{err}");
    dev.terminate().await;
}

/// Runs the binary with extra environment variables; returns the exit code,
/// stdout and stderr.
async fn run_env(args: &[&str], vars: &[(&str, &str)]) -> (i32, String, String) {
    let out =
        bagstore_tests::command(bagstore_bin()).args(args).envs(vars.iter().copied()).output().await.unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// Each kind of failure has its own exit code (docs/operations.md,
/// "Commands": "Exit codes, errors and output"), and
/// with `--json` the error is one JSON document on stderr.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_exit_with_distinct_codes_and_honour_json() {
    let env = TestEnv::new("exitcodes", STANDARD_INDEXES).await;
    let dev = env.dev().await;
    let url = dev.url.as_str();
    let id = "5a1e0c3d2b1a49f8a7c6d5e4f3a2b1c0";
    let (code, out, err) = run_env(&["put", "--url", url, "--id", id, r#"{"n": 1}"#], &[]).await;
    assert_eq!(code, 0, "{out}{err}");

    // Usage: clap's, and input that is not JSON.
    assert_eq!(run_env(&["get", "--url", url], &[]).await.0, 2);
    let (code, _, err) = run_env(&["put", "--url", url, "{not json"], &[]).await;
    assert_eq!(code, 2, "{err}");
    // Not found.
    let missing = "00000000000000000000000000000001";
    let (code, out, err) = run_env(&["get", "--url", url, missing], &[]).await;
    assert_eq!(code, 3, "{out}{err}");
    assert!(err.starts_with("bagstore: error: 404"), "{err}");
    let (code, out, err) = run_env(&["get", "--url", url, "--json", missing], &[]).await;
    assert_eq!((code, out.as_str()), (3, ""), "{err}");
    let doc: Value = serde_json::from_str(err.trim()).unwrap_or_else(|e| panic!("{e}: {err}"));
    assert_eq!((doc["exit_code"].clone(), doc["problem"]["status"].clone()), (json!(3), json!(404)), "{doc}");
    // Conflict: a version precondition that does not hold.
    let (code, out, err) =
        run_env(&["put", "--url", url, "--id", id, "--if-match", "7", r#"{"n": 2}"#], &[]).await;
    assert_eq!(code, 4, "{out}{err}");
    // Unavailable: nothing listens.
    let (code, _, err) = run_env(&["get", "--url", "http://127.0.0.1:9", id], &[]).await;
    assert_eq!(code, 5, "{err}");
}

/// `--url https://…` works, trusting the system's CA store (here
/// `SSL_CERT_FILE`): against `openssl s_server -WWW` serving a file at the
/// entity's path over TLS with a certificate made for the test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_commands_speak_https() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ok = bagstore_tests::std_command("openssl")
        .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"])
        .args(["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", "key.pem", "-out", "cert.pem"])
        .current_dir(d)
        .output()
        .unwrap();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let id = "0badc0de0badc0de0badc0de0badc0de";
    std::fs::create_dir_all(d.join("v1/entities")).unwrap();
    let entity = json!({"id": id, "version": 3, "body": {"title": "over TLS"}});
    std::fs::write(d.join("v1/entities").join(id), entity.to_string()).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut server = bagstore_tests::command("openssl")
        .args(["s_server", "-quiet", "-WWW", "-cert", "cert.pem", "-key", "key.pem", "-accept"])
        .arg(port.to_string())
        .current_dir(d)
        .stdin(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let url = format!("https://127.0.0.1:{port}");
    let ca = d.join("cert.pem").display().to_string();
    let answer =
        bagstore_tests::eventually("the TLS server answers", std::time::Duration::from_secs(20), || {
            let (url, ca) = (url.clone(), ca.clone());
            async move {
                let (code, out, _) =
                    run_env(&["get", "--url", &url, "--json", id], &[("SSL_CERT_FILE", &ca)]).await;
                (code == 0).then_some(out)
            }
        })
        .await;
    assert_eq!(serde_json::from_str::<Value>(answer.trim()).unwrap(), entity);
    // A server the client cannot verify: refused, as unavailable.
    let (code, out, err) = run_env(&["get", "--url", &url, id], &[("SSL_CERT_FILE", "/dev/null")]).await;
    assert_eq!(code, 5, "{out}{err}");
    server.kill().await.ok();
}
