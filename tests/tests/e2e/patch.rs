//! Partial updates and HTTP conditionals (issue 18): RFC 7396 merge
//! patches through the API with the index following, atomic counters under
//! concurrency, concurrent `$set`s that never lose each other, clashes that
//! write nothing, `ETag`/`If-None-Match` on GET, `If-Match: *`, `Location`;
//! the one rule that tells a merge patch from operators.

use bagstore_tests::model::read_topic;
use bagstore_tests::{Api, TestEnv};
use reqwest::Method;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};

/// A string index on property "a" (multi-valued for arrays of strings).
const INDEX_A: &str = r#"
[[indexes]]
table = "index_a"
properties = [{ name = "a", type = "string", max_len = 16 }]
"#;

fn id(n: usize) -> String {
    format!("{n:032x}")
}

/// PATCH with a content type; (status, body).
async fn patch(
    base: &str,
    path: &str,
    content_type: &str,
    doc: &Value,
    headers: &[(&str, &str)],
) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .request(Method::PATCH, format!("{base}{path}"))
        .header("content-type", content_type)
        .body(doc.to_string());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().await.expect("PATCH");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn properties(api: &Api, id: &str) -> Value {
    let (status, body) = api.get(id).await;
    assert_eq!(status, 200, "{body}");
    body["properties"].clone()
}

/// The index rows `index_a` should hold for a bag: its string "a", or each
/// string of an array "a".
fn expected_a(bag: &Value) -> BTreeSet<String> {
    match &bag["a"] {
        Value::String(s) => [s.clone()].into(),
        Value::Array(items) => items.iter().filter_map(|v| v.as_str().map(str::to_string)).collect(),
        _ => BTreeSet::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merge_patches_follow_rfc_7396_and_the_index_follows_them() {
    let env = TestEnv::new("mergepatch", INDEX_A).await;
    let dev = env.dev().await;
    let api = dev.api();
    // RFC 7396 appendix A, the examples whose target and result are objects.
    let cases = [
        (json!({"a":"b"}), json!({"a":"c"}), json!({"a":"c"})),
        (json!({"a":"b"}), json!({"b":"c"}), json!({"a":"b","b":"c"})),
        (json!({"a":"b"}), json!({"a":null}), json!({})),
        (json!({"a":"b","b":"c"}), json!({"a":null}), json!({"b":"c"})),
        (json!({"a":["b"]}), json!({"a":"c"}), json!({"a":"c"})),
        (json!({"a":"c"}), json!({"a":["b"]}), json!({"a":["b"]})),
        (json!({"a":{"b":"c"}}), json!({"a":{"b":"d","c":null}}), json!({"a":{"b":"d"}})),
        (json!({"a":[{"b":"c"}]}), json!({"a":[1]}), json!({"a":[1]})),
        (json!({"e":null}), json!({"a":1}), json!({"e":null,"a":1})),
        (json!({}), json!({"a":{"bb":{"ccc":null}}}), json!({"a":{"bb":{}}})),
    ];
    let mut want_rows: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (n, (target, p, want)) in cases.iter().enumerate() {
        let id = id(n + 1);
        assert_eq!(api.put(&id, target).await.0, 201);
        let (status, body) =
            patch(&dev.url, &format!("/v1/entities/{id}"), "application/merge-patch+json", p, &[]).await;
        assert_eq!((status, body["version"].as_u64()), (200, Some(2)), "{target} + {p}: {body}");
        assert_eq!(&properties(&api, &id).await, want, "{target} + {p}");
        want_rows.insert(id, expected_a(want));
    }
    env.until_caught_up(&["index_a"]).await;
    let rows: Vec<(usize, (String, String))> = env
        .fetch_all_shards(
            "SELECT LOWER(HEX(entity_id)), CAST(a AS CHAR) FROM index_a WHERE removed_us IS NULL",
        )
        .await;
    let mut got: BTreeMap<String, BTreeSet<String>> =
        want_rows.keys().map(|k| (k.clone(), BTreeSet::new())).collect();
    for (_, (entity, a)) in rows {
        got.entry(entity).or_default().insert(a);
    }
    assert_eq!(got, want_rows, "index_a after the patches");
    // A merge patch of the whole entity must be an object.
    let (status, body) =
        patch(&dev.url, &format!("/v1/entities/{}", id(1)), "application/merge-patch+json", &json!([1]), &[])
            .await;
    assert_eq!(
        (status, body["type"].as_str().map(|t| t.ends_with("bad-patch"))),
        (400, Some(true)),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_increments_count_exactly_with_one_version_and_one_event_each() {
    let env = TestEnv::new("counters", "").await;
    let dev = env.dev().await;
    let counter = id(7);
    let mut clients = Vec::new();
    for _ in 0..8 {
        let url = dev.url.clone();
        let path = format!("/v1/entities/{counter}?upsert=true");
        clients.push(tokio::spawn(async move {
            let mut versions = Vec::new();
            for _ in 0..100 {
                let (status, body) =
                    patch(&url, &path, "application/json", &json!({"$inc": {"views": 1}}), &[]).await;
                assert!(status == 200 || status == 201, "{status} {body}");
                versions.push(body["version"].as_u64().expect("a version"));
            }
            versions
        }));
    }
    let mut versions = Vec::new();
    for c in clients {
        versions.extend(c.await.expect("client"));
    }
    versions.sort_unstable();
    assert_eq!(versions, (1..=800).collect::<Vec<u64>>(), "each increment its own version, no gap");
    let api = dev.api();
    assert_eq!(properties(&api, &counter).await, json!({"views": 800}));
    // One event per version on the topic.
    env.until_caught_up(&[]).await;
    let (brokers, topic) = (env.brokers(), env.topic.clone());
    let events = tokio::task::spawn_blocking(move || read_topic(&brokers, &topic, 4)).await.expect("read");
    let mut seen: Vec<u64> =
        events.iter().filter(|e| e.event.id.to_hex() == counter).map(|e| e.event.version).collect();
    seen.sort_unstable();
    assert_eq!(seen, (1..=800).collect::<Vec<u64>>(), "one event per version");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sets_of_different_properties_never_lose_either() {
    let env = TestEnv::new("patchsets", "").await;
    let dev = env.dev().await;
    let api = dev.api();
    let target = id(9);
    assert_eq!(api.put(&target, &json!({"start": true})).await.0, 201);
    let mut clients = Vec::new();
    for side in ["left", "right"] {
        let (url, path) = (dev.url.clone(), format!("/v1/entities/{target}"));
        clients.push(tokio::spawn(async move {
            for i in 0..50 {
                let doc = json!({"$set": {format!("{side}.n"): i, format!("{side}_{i}"): i}});
                let (status, body) = patch(&url, &path, "application/json", &doc, &[]).await;
                assert_eq!(status, 200, "{body}");
            }
        }));
    }
    for c in clients {
        c.await.expect("client");
    }
    let p = properties(&api, &target).await;
    for side in ["left", "right"] {
        assert_eq!(p[side]["n"], 49, "{p}");
        for i in 0..50 {
            assert_eq!(p[format!("{side}_{i}")], i, "{side}_{i} lost: {p}");
        }
    }
    assert_eq!(p["start"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clashes_and_bad_patches_write_nothing_and_conditionals_hold() {
    let env = TestEnv::new("patchedges", "").await;
    let dev = env.dev().await;
    let api = dev.api();
    let e = id(11);
    let url = format!("/v1/entities/{e}");
    // A missing entity: 404 unless upsert.
    let (status, _) = patch(&dev.url, &url, "application/json", &json!({"$set": {"x": 1}}), &[]).await;
    assert_eq!(status, 404);
    // Created by an upsert: 201 with Location.
    let r = reqwest::Client::new()
        .request(Method::PATCH, format!("{}{url}?upsert=true", dev.url))
        .header("content-type", "application/json")
        .body(json!({"$set": {"s": "text", "n.m": 1}}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    assert_eq!(r.headers()["location"].to_str().unwrap(), url);
    // A type clash names the property and writes nothing.
    let (status, body) = patch(&dev.url, &url, "application/json", &json!({"$inc": {"s": 1}}), &[]).await;
    assert_eq!((status, body["property"].as_str()), (422, Some("s")), "{body}");
    let (status, body) = patch(&dev.url, &url, "application/json", &json!({"$push": {"n.m": 2}}), &[]).await;
    assert_eq!((status, body["property"].as_str()), (422, Some("n.m")), "{body}");
    let mixed = json!({"$set": {"x": 1}, "s": "a property beside an operator"});
    for bad in [json!({"$rename": {"s": "t"}}), mixed, json!({"$set": {"a..b": 1}}), json!([1])] {
        let (status, body) = patch(&dev.url, &url, "application/json", &bad, &[]).await;
        assert_eq!(status, 400, "{bad}: {body}");
    }
    let (status, body) = api.get(&e).await;
    assert_eq!((status, body["version"].as_u64()), (200, Some(1)), "nothing was written: {body}");
    // Preconditions: If-Match with the version, and * (must exist).
    let (status, _) =
        patch(&dev.url, &url, "application/json", &json!({"$set": {"x": 1}}), &[("if-match", "\"5\"")]).await;
    assert_eq!(status, 412);
    let (status, body) =
        patch(&dev.url, &url, "application/json", &json!({"$set": {"x": 1}}), &[("if-match", "*")]).await;
    assert_eq!((status, body["version"].as_u64()), (200, Some(2)), "{body}");
    let absent = id(12);
    let (status, _) = api.put_with(&absent, &json!({"x": 1}), ("If-Match", "*")).await;
    assert_eq!(status, 404, "If-Match: * on a missing entity");
    // GET: ETag, and 304 for If-None-Match with the current version.
    let client = reqwest::Client::new();
    let r = client.get(format!("{}{url}", dev.url)).send().await.unwrap();
    assert_eq!(r.headers()["etag"].to_str().unwrap(), "\"2\"");
    let r = client.get(format!("{}{url}", dev.url)).header("if-none-match", "\"2\"").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 304);
    let r = client.get(format!("{}{url}", dev.url)).header("if-none-match", "\"1\"").send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // POST creating an entity answers with its Location.
    let r = client.post(format!("{}/v1/entities", dev.url)).json(&json!({"k": 1})).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let location = r.headers()["location"].to_str().unwrap().to_string();
    let body: Value = r.json().await.unwrap();
    assert_eq!(location, format!("/v1/entities/{}", body["id"].as_str().unwrap()));
}

/// The patch form by one rule (`schemas::patch::parse`, shared with Kafka
/// ingest): `Content-Type: application/merge-patch+json` declares a merge
/// patch; any other type declares nothing, and the keys decide (all `$`:
/// operators, none: a merge patch, a mix: 400 `bad-patch`). A property
/// whose name starts with `$` is written by declaring the merge form, by
/// PUT, or with `$set`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_form_wins_and_otherwise_the_keys_decide() {
    let env = TestEnv::new("patchform", INDEX_A).await;
    let dev = env.dev().await;
    let api = dev.api();
    let e = id(21);
    let url = format!("/v1/entities/{e}");
    let send = |content_type: &'static str, doc: Value, headers: &'static [(&'static str, &'static str)]| {
        let (base, url) = (dev.url.clone(), url.clone());
        async move { patch(&base, &url, content_type, &doc, headers).await }
    };
    assert_eq!(api.put(&e, &json!({"a": "x", "n": 1})).await.0, 201);
    // Undeclared, no `$`: a merge patch (null removes, the index follows).
    let (status, body) = send("application/json", json!({"a": "y", "n": null}), &[]).await;
    assert_eq!((status, body["version"].as_u64()), (200, Some(2)), "{body}");
    assert_eq!(properties(&api, &e).await, json!({"a": "y"}));
    // Undeclared, all `$`: operators, whatever the type says otherwise.
    let (status, body) = send("text/plain", json!({"$inc": {"n": 2}}), &[]).await;
    assert_eq!((status, body["version"].as_u64()), (200, Some(3)), "{body}");
    // Declared merge: `$price` is a property, not an operator.
    let (status, body) = send("application/merge-patch+json", json!({"$price": 5, "b": true}), &[]).await;
    assert_eq!((status, body["version"].as_u64()), (200, Some(4)), "{body}");
    assert_eq!(properties(&api, &e).await, json!({"a": "y", "n": 2, "$price": 5, "b": true}));
    // ...and `$set` reaches it too.
    let (status, _) = send("application/json", json!({"$set": {"$price": 6}}), &[]).await;
    assert_eq!(status, 200);
    assert_eq!(properties(&api, &e).await["$price"], 6);
    // Undeclared, `$price` alone is an unknown operator, and a mix is
    // refused; the answer says how to declare the merge form.
    for (doc, says) in [
        (json!({"$price": 7}), "unknown operator"),
        (json!({"$price": 7, "b": false}), "mixes"),
        (json!({"$inc": {"n": 1}, "b": false}), "mixes"),
    ] {
        let (status, body) = send("application/json", doc.clone(), &[]).await;
        assert_eq!(status, 400, "{doc}: {body}");
        assert!(body["type"].as_str().is_some_and(|t| t.ends_with("bad-patch")), "{body}");
        let detail = body["detail"].as_str().unwrap_or_default();
        assert!(detail.contains(says) && detail.contains("application/merge-patch+json"), "{doc}: {detail}");
    }
    assert_eq!(api.get(&e).await.1["version"], 5, "the refused patches wrote nothing");
    // A keyed retry of an undeclared merge patch gets the first answer.
    let key: &'static [(&str, &str)] = &[("idempotency-key", "form-retry-1")];
    let first = send("application/json", json!({"a": "z"}), key).await;
    let again = send("application/json", json!({"a": "z"}), key).await;
    assert_eq!((first.0, &first.1["version"]), (200, &json!(6)), "{first:?}");
    assert_eq!(again, first);
    // The index followed the merge patches.
    bagstore_tests::until_query_is(&api, &json!({"where": {"a": "z"}}), &[&e]).await;
    dev.terminate().await;
}
