//! Optional bearer tokens per role: a missing or unknown token is 401, a
//! token of another role 403, and a refused request writes nothing.

use bagstore_tests::{TestEnv, STANDARD_INDEXES};
use reqwest::{Method, StatusCode};
use serde_json::json;

const AUTH: &str = r#"
[auth]
write_tokens = ["w-secret-1"]
read_tokens = ["r-secret-1"]
admin_tokens = ["a-secret-1"]
protect_metrics = true
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_need_the_token_of_their_role_and_refusals_write_nothing() {
    let env = TestEnv::new("auth", &format!("{AUTH}{STANDARD_INDEXES}")).await;
    let dev = env.dev().await;
    let http = reqwest::Client::new();
    let call = |method: Method, path: &str, token: Option<&str>| {
        let mut req = http
            .request(method, format!("{}{path}", dev.url))
            .json(&json!({"user_id": "c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3c3"}));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        async move {
            let resp = req.send().await.unwrap();
            let status = resp.status();
            let www = resp.headers().get("www-authenticate").is_some();
            let body: serde_json::Value = resp.json().await.unwrap_or_default();
            (status, www, body)
        }
    };
    let id = "/v1/entities/d4d4d4d4d4d4d4d4d4d4d4d4d4d4d4d4";

    let (s, www, body) = call(Method::PUT, id, None).await;
    assert_eq!(
        (s, www, body["type"].clone()),
        (StatusCode::UNAUTHORIZED, true, json!("/problems/unauthorized"))
    );
    assert_eq!(call(Method::PUT, id, Some("nonsense")).await.0, StatusCode::UNAUTHORIZED);
    let (s, _, body) = call(Method::PUT, id, Some("r-secret-1")).await;
    assert_eq!((s, body["type"].clone()), (StatusCode::FORBIDDEN, json!("/problems/forbidden")));
    assert_eq!(call(Method::POST, "/v1/entities/batch", Some("r-secret-1")).await.0, StatusCode::FORBIDDEN);
    assert_eq!(env.count_rows("entities").await, 0, "refused writes wrote nothing");

    assert_eq!(call(Method::PUT, id, Some("w-secret-1")).await.0, StatusCode::CREATED);
    assert_eq!(
        call(Method::PUT, id, Some("a-secret-1")).await.0,
        StatusCode::OK,
        "admin tokens work everywhere"
    );

    assert_eq!(call(Method::GET, id, None).await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(call(Method::GET, id, Some("w-secret-1")).await.0, StatusCode::FORBIDDEN);
    assert_eq!(call(Method::GET, id, Some("r-secret-1")).await.0, StatusCode::OK);
    assert_eq!(call(Method::GET, "/v1/indexes", Some("r-secret-1")).await.0, StatusCode::OK);

    assert_eq!(
        call(Method::DELETE, "/v1/indexes/index_tag", Some("r-secret-1")).await.0,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        call(Method::DELETE, "/v1/indexes/index_tag", Some("w-secret-1")).await.0,
        StatusCode::FORBIDDEN
    );
    assert_eq!(call(Method::DELETE, "/v1/indexes/index_tag", Some("a-secret-1")).await.0, StatusCode::OK);

    assert_eq!(call(Method::GET, "/health", None).await.0, StatusCode::OK);
    assert_eq!(call(Method::GET, "/metrics", None).await.0, StatusCode::UNAUTHORIZED);
    let metrics = http.get(format!("{}/metrics", dev.url)).bearer_auth("r-secret-1").send().await.unwrap();
    assert_eq!(metrics.status(), StatusCode::OK);

    // The CLI passes --token.
    let out = bagstore_tests::command(bagstore_tests::bagstore_bin())
        .args(["get", "--url", &dev.url, "--token", "r-secret-1", "d4d4d4d4d4d4d4d4d4d4d4d4d4d4d4d4"])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let log = dev.log_text();
    dev.terminate().await;
    for secret in ["w-secret-1", "r-secret-1", "a-secret-1"] {
        assert!(!log.contains(secret), "{secret} leaked into the log");
    }
}
