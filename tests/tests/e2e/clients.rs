//! The OpenAPI document as other programs use it (issue 19): PyPI
//! `openapi-spec-validator` accepts it, every operation has an
//! `operationId`, and a client generated from it by PyPI
//! `openapi-python-client` (a generator sharing no code with bagstore) runs
//! the seed's scenario against a running bagstore: put the FriendFeed
//! entity, get it, query it by `user_id`. The tools live in the venv
//! `scripts/test` makes (`bagstore_tests::python`).

use bagstore_tests::python::{python, python_tools, repo_file as workspace, run_tool as run};
use bagstore_tests::{TestEnv, STANDARD_INDEXES};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_generated_from_the_openapi_document_runs_the_seed_scenario() {
    let tools = python_tools();
    let python = python();
    let doc_path = workspace("service/src/openapi.json");

    // Valid OpenAPI 3.0, and every operation named.
    let said = run(
        bagstore_tests::std_command(&python).arg("-m").arg("openapi_spec_validator").arg(&doc_path),
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
        bagstore_tests::std_command(tools.join("bin/openapi-python-client"))
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
        bagstore_tests::std_command(&python)
            .arg(workspace("tests/python/generated_client_scenario.py"))
            .env("PYTHONPATH", out.path())
            .env("BAGSTORE_URL", &dev.url),
        "the generated client's scenario",
    );
    assert!(said.contains("as documented"), "{said}");
}
