//! The OpenAPI document as other programs use it (issue 19): PyPI
//! `openapi-spec-validator` accepts it, every operation has an
//! `operationId`, and a client generated from it by PyPI
//! `openapi-python-client` (a generator sharing no code with bagstore) runs
//! the seed's scenario against a running bagstore: put the FriendFeed
//! entity, get it, query it by `user_id`. The tools live in the venv
//! `scripts/test` makes (`ensure_openapi_tools`, exported as
//! `BAGSTORE_OPENAPI_TOOLS`).

use bagstore_tests::{TestEnv, STANDARD_INDEXES};
use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

fn tools() -> PathBuf {
    let dir = std::env::var_os("BAGSTORE_OPENAPI_TOOLS").map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME").unwrap_or_default();
        Path::new(&home).join(".cache/bagstore/openapi-tools-0.9.0-0.29.1")
    });
    assert!(
        dir.join(".complete").exists(),
        "no OpenAPI tools in {}: scripts/test installs them (ensure_openapi_tools in scripts/lib.sh)",
        dir.display()
    );
    dir
}

/// Runs `cmd`; panics with its output unless it succeeds. Returns stdout
/// and stderr.
fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{what} failed ({}):\n{text}", out.status);
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_generated_from_the_openapi_document_runs_the_seed_scenario() {
    let tools = tools();
    let python = tools.join("bin/python");
    let doc_path = workspace("service/src/openapi.json");

    // Valid OpenAPI 3.0, and every operation named.
    let said = run(
        Command::new(&python).arg("-m").arg("openapi_spec_validator").arg(&doc_path),
        "openapi-spec-validator",
    );
    assert!(said.contains(": OK"), "{said}");
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&doc_path).unwrap()).unwrap();
    let mut ids = std::collections::BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        let methods = ["get", "put", "post", "patch", "delete", "head", "options"];
        for (method, op) in item.as_object().unwrap().iter().filter(|(m, _)| methods.contains(&m.as_str())) {
            let id =
                op["operationId"].as_str().unwrap_or_else(|| panic!("{method} {path} has no operationId"));
            assert!(ids.insert(id.to_string()), "operationId {id} is used twice");
            for (code, answer) in op["responses"].as_object().unwrap() {
                let typed = answer.get("$ref").is_some() || answer.get("content").is_some() || code == "304";
                assert!(typed, "{method} {path} answers {code} without a schema");
            }
        }
    }

    // Generated without a warning (a warning means a part it could not type).
    let out = tempfile::tempdir().unwrap();
    std::fs::write(out.path().join("config.yaml"), "post_hooks: []\n").unwrap();
    let said = run(
        Command::new(tools.join("bin/openapi-python-client"))
            .current_dir(out.path())
            .args(["generate", "--meta", "none", "--config", "config.yaml", "--path"])
            .arg(&doc_path),
        "openapi-python-client generate",
    );
    assert!(!said.to_lowercase().contains("warning"), "the generator warned:\n{said}");
    assert!(out.path().join("bagstore_client/api/default/query.py").exists(), "{said}");

    let env = TestEnv::new("genclient", STANDARD_INDEXES).await;
    let dev = env.dev().await;
    let said = run(
        Command::new(&python)
            .arg(workspace("tests/python/generated_client_scenario.py"))
            .env("PYTHONPATH", out.path())
            .env("BAGSTORE_URL", &dev.url),
        "the generated client's scenario",
    );
    assert!(said.contains("as documented"), "{said}");
}
