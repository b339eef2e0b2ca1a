//! Reads routed to replicas (issue 33, read routing), on private servers
//! of the test's own: two shards, each with a replica. One reader reads
//! replicas with a lag bound it never reaches, so it keeps reading a
//! replica whose SQL thread is stopped; another has a short bound and
//! leaves that replica. With a write token no read answers an older
//! version than the token names (gets, batch gets, queries); without one
//! an answer may be older, never wrong. A move's cutover that the stopped
//! replica has not applied is lag, not a stale map. The replica applying
//! again is used again, one removed from the map leaves routing, and one
//! killed is skipped (reads already sent to it go to the primary).

use bagstore_tests::api::{metric_sum, Api};
use bagstore_tests::{eventually, TestEnv};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::Duration;

use bagstore_tests::replicated::Cluster;

use crate::replication::{connect, ADMIN_ENV};

const INDEXES: &str = r#"
[[indexes]]
table = "index_group"
properties = [{ name = "group", type = "string", max_len = 32 }]
"#;

/// Entities per shard.
const PER_SHARD: usize = 8;

/// The physical shard an id lives on in a new two-shard cluster (logical
/// shard `k` on the `k mod 2`-th).
fn shard_of(id: &str) -> usize {
    let id = schemas::EntityId::parse(id).unwrap();
    schemas::logical_of(id.as_bytes(), schemas::shard::DEFAULT_LOGICAL_SHARDS) as usize % 2
}

/// `PER_SHARD` new ids on each shard: (shard 0's, shard 1's).
fn ids_per_shard() -> (Vec<String>, Vec<String>) {
    let (mut on0, mut on1) = (Vec::new(), Vec::new());
    while on0.len() < PER_SHARD || on1.len() < PER_SHARD {
        let id = schemas::EntityId(rand::random()).to_hex();
        match shard_of(&id) {
            0 if on0.len() < PER_SHARD => on0.push(id),
            1 if on1.len() < PER_SHARD => on1.push(id),
            _ => {}
        }
    }
    (on0, on1)
}

/// `GET /v1/entities/{id}`, with write tokens if any.
async fn get(api: &Api, id: &str, tokens: &[&str]) -> (u16, Value) {
    let path = match tokens {
        [] => format!("/v1/entities/{id}"),
        _ => format!("/v1/entities/{id}?consistent_with={}", tokens.join(",")),
    };
    api.raw(reqwest::Method::GET, &path, Vec::new()).await
}

/// `POST /v1/entities/get`: each entity's version, by id.
async fn get_many(api: &Api, ids: &[String], tokens: &[String]) -> BTreeMap<String, u64> {
    let body = json!({"ids": ids, "consistent_with": tokens});
    let (status, doc) =
        api.raw(reqwest::Method::POST, "/v1/entities/get", body.to_string().into_bytes()).await;
    assert_eq!(status, 200, "{doc}");
    doc["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["id"].as_str().unwrap().to_string(), e["version"].as_u64().unwrap()))
        .collect()
}

/// A query on `group`: its items (id → (version, group)); every item
/// must match the query as returned (invariant R).
async fn query(api: &Api, group: &str, tokens: &[String]) -> BTreeMap<String, (u64, String)> {
    let q = json!({"where": {"group": group}, "limit": 1000, "consistent_with": tokens});
    let (status, doc) = api.query(&q).await;
    assert_eq!(status, 200, "{doc}");
    let mut out = BTreeMap::new();
    for e in doc["items"].as_array().unwrap() {
        let g = e["properties"]["group"].as_str().unwrap_or_default().to_string();
        assert_eq!(g, group, "a query answered an entity that does not match it: {e}");
        out.insert(e["id"].as_str().unwrap().to_string(), (e["version"].as_u64().unwrap(), g));
    }
    out
}

/// Each shard's replicas that `api`'s reader uses now.
async fn usable(api: &Api, shard: usize) -> f64 {
    let m = api.metrics().await;
    metric_sum(&m, "bagstore_reader_replicas_usable", &[("shard", &shard.to_string())])
}

async fn until_usable(api: &Api, shard: usize, n: f64) {
    let what = format!("shard {shard} to have {n} usable replicas");
    eventually(&what, Duration::from_secs(30), || async { (usable(api, shard).await == n).then_some(()) })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_on_a_stopped_replica_never_go_behind_a_write_token_and_are_never_wrong_without_one() {
    let mut env = TestEnv::new("readroute", INDEXES).await;
    // Two shards, a replica each: s0's is member 1 of shard 0, s1's member 1 of shard 1.
    let mut cluster = Cluster::start(&mut env, 2, 1).await;
    let s1_replica = cluster.shards[1][1].server.as_ref().expect("running");
    let writer = env.spawn(&["writer"]).await;
    let _indexer = env.spawn(&["indexer"]).await;
    // Lenient: a bound no replica here reaches. Bounded: half a second.
    let replicas = ("BAGSTORE_READER__READ_FROM", "replicas");
    let lenient =
        env.spawn_env(&["reader"], &[replicas, ("BAGSTORE_READER__MAX_REPLICA_LAG_MS", "600000")]).await;
    let bounded =
        env.spawn_env(&["reader"], &[replicas, ("BAGSTORE_READER__MAX_REPLICA_LAG_MS", "500")]).await;
    let (w, r, b) = (writer.api(), lenient.api(), bounded.api());
    let (on0, on1) = ids_per_shard();
    let all: Vec<String> = on0.iter().chain(&on1).cloned().collect();
    let mut tokens = Vec::new();
    for id in &all {
        let (status, body) = w.put(id, &json!({"group": "g", "n": 1})).await;
        assert_eq!(status, 201, "{body}");
        tokens.push(body["write_token"].as_str().unwrap().to_string());
    }
    for api in [&r, &b] {
        for shard in [0, 1] {
            until_usable(api, shard, 1.0).await;
        }
    }
    // Caught up: the first versions, from the replicas.
    assert_eq!(query(&r, "g", &tokens).await.len(), all.len());
    assert!(get_many(&r, &all, &tokens).await.values().all(|v| *v == 1));
    refused_tokens(&r, &all[0]).await;
    let m = r.metrics().await;
    assert!(metric_sum(&m, "bagstore_reader_routed_total", &[("target", "replica")]) > 0.0, "{m}");
    assert_eq!(metric_sum(&m, "bagstore_reader_routed_total", &[("target", "primary")]), 0.0);

    // s1's replica stops applying (it still receives and acknowledges).
    let mut droot = connect(&s1_replica.server_dsn()).await;
    sqlx::query("STOP SLAVE SQL_THREAD").execute(&mut droot).await.unwrap();
    let mut tokens = BTreeMap::new();
    for id in &all {
        let (status, body) = w.put(id, &json!({"group": "h", "n": 2})).await;
        assert_eq!(status, 200, "{body}");
        tokens.insert(id.clone(), body["write_token"].as_str().unwrap().to_string());
    }
    let token_list: Vec<String> = tokens.values().cloned().collect();
    tokened_reads(&r, &all, &tokens).await;
    untokened_reads(&r, &on0, &on1).await;
    let m = r.metrics().await;
    for (name, labels) in [
        ("bagstore_reader_token_waits_total", ("outcome", "primary")),
        ("bagstore_reader_replica_fallbacks_total", ("reason", "write_token")),
        ("bagstore_reader_routed_total", ("target", "primary_fallback")),
    ] {
        assert!(metric_sum(&m, name, &[labels]) > 0.0, "{name}{labels:?} counted nothing:\n{m}");
    }

    // The bounded reader leaves the lagging replica (its other one stays)
    // and answers s1's entities from the primary.
    until_usable(&b, 1, 0.0).await;
    assert_eq!(usable(&b, 0).await, 1.0);
    for id in &on1 {
        assert_eq!(get(&b, id, &[]).await.1["version"], 2);
    }
    let m = b.metrics().await;
    assert!(metric_sum(&m, "bagstore_reader_replica_fallbacks_total", &[("reason", "no_replica")]) > 0.0);

    // A delete's token: gone, however old the replica.
    let (status, del) = w.delete(&on1[0]).await;
    assert_eq!(status, 200, "{del}");
    let del_token = del["write_token"].as_str().unwrap();
    assert_eq!(get(&r, &on1[0], &[del_token]).await.0, 404);
    assert!(get_many(&r, &on1[..1], &[del_token.to_string()]).await.is_empty());
    assert_eq!(get(&r, &on1[0], &[]).await.1["version"], 1, "untokened reads still go to the replica");
    let mut with_delete = token_list.clone();
    with_delete.push(del_token.to_string());
    assert!(!query(&r, "h", &with_delete).await.contains_key(&on1[0]));

    moved_behind_the_replica(&env, &w, &r, &on0[0]).await;

    // Applying again, the replica is used again; removed, it leaves routing.
    sqlx::query("START SLAVE SQL_THREAD").execute(&mut droot).await.unwrap();
    until_usable(&b, 1, 1.0).await;
    eventually("the replica's answers to catch up", Duration::from_secs(30), || async {
        (get(&r, &on1[1], &[]).await.1["version"] == 2).then_some(())
    })
    .await;
    let address = cluster.dsn(&env, 1, 1);
    let (ok, out, err) =
        env.run(&env.args(&["shards", "replicas", "remove", "s1", &address]), &ADMIN_ENV).await;
    assert!(ok, "replicas remove: {out}{err}");
    until_usable(&r, 1, 0.0).await;
    assert_eq!(get(&r, &on1[1], &[]).await.1["version"], 2);

    // s0's replica dies: reads sent to it before the watch sees it run on
    // the primary; then it is down and skipped.
    cluster.kill_9(0, 1);
    // (on0[0] moved to s1 above.)
    for id in on0[1..].iter().cycle().take(40) {
        let (status, doc) = get(&r, id, &[]).await;
        assert_eq!((status, doc["version"].clone()), (200, json!(2)), "{id} with its replica dead: {doc}");
    }
    until_usable(&r, 0, 0.0).await;
    drop((writer, lenient, bounded, _indexer));
    cluster.stop().await;
}

/// Tokens that are not write tokens, and parameters the routes do not
/// take, are refused with a reason.
async fn refused_tokens(r: &Api, id: &str) {
    let kind = |doc: &Value| doc["type"].as_str().unwrap_or_default().rsplit('/').next().unwrap().to_string();
    for (path, want) in [
        (format!("/v1/entities/{id}?consistent_with=nope"), "bad-write-token"),
        (format!("/v1/entities/{id}?consistent_with={id}.x"), "bad-write-token"),
        (format!("/v1/entities/{id}?consistant_with={id}.1"), "bad-request"),
    ] {
        let (status, doc) = r.raw(reqwest::Method::GET, &path, Vec::new()).await;
        assert_eq!((status, kind(&doc)), (400, want.to_string()), "{path}: {doc}");
    }
    for (body, want) in [
        (json!({"ids": [id], "consistent_with": [id]}), "bad-write-token"),
        (json!({"ids": [id], "consistent_with": format!("{id}.1")}), "bad-request"),
    ] {
        let (status, doc) =
            r.raw(reqwest::Method::POST, "/v1/entities/get", body.to_string().into_bytes()).await;
        assert_eq!((status, kind(&doc)), (400, want.to_string()), "{body}: {doc}");
    }
}

/// Reads with the updates' tokens on the lenient reader: every entity at
/// its second version, the query on the new group returns them all and
/// the one on the old group none of them.
async fn tokened_reads(r: &Api, all: &[String], tokens: &BTreeMap<String, String>) {
    for id in all {
        let (status, doc) = get(r, id, &[&tokens[id]]).await;
        assert_eq!((status, doc["version"].clone()), (200, json!(2)), "{id}: {doc}");
        assert_eq!(doc["properties"]["group"], "h", "{doc}");
    }
    let list: Vec<String> = tokens.values().cloned().collect();
    let versions = get_many(r, all, &list).await;
    assert_eq!(versions.len(), all.len());
    assert!(versions.values().all(|v| *v == 2), "{versions:?}");
    let h = query(r, "h", &list).await;
    assert_eq!(h.len(), all.len(), "{h:?}");
    assert!(h.values().all(|(v, _)| *v == 2), "{h:?}");
    let g = query(r, "g", &list).await;
    assert!(g.is_empty(), "entities a token says moved on answered at their old version: {g:?}");
}

/// Reads without tokens on the lenient reader: shard 1's entities come
/// from its stopped replica (older), shard 0's from its live one; a query
/// answers only what matches it as answered.
async fn untokened_reads(r: &Api, on0: &[String], on1: &[String]) {
    for id in on1 {
        let (status, doc) = get(r, id, &[]).await;
        assert_eq!((status, doc["version"].clone()), (200, json!(1)), "{doc}");
        assert_eq!(doc["properties"]["group"], "g", "{doc}");
    }
    for id in on0 {
        let doc = eventually("shard 0's replica to apply the update", Duration::from_secs(20), || async {
            let (_, doc) = get(r, id, &[]).await;
            (doc["version"] == 2).then_some(doc)
        })
        .await;
        assert_eq!(doc["properties"]["group"], "h", "{doc}");
    }
    let ids: Vec<String> = on0.iter().chain(on1).cloned().collect();
    let versions = get_many(r, &ids, &[]).await;
    assert!(on1.iter().all(|id| versions[id] == 1), "{versions:?}");
    for (id, (v, _)) in query(r, "g", &[]).await {
        assert!(on1.contains(&id) && v == 1, "{id} at version {v} matched the old group");
    }
}

/// Moves the logical shard of `id` (on s0) to s1, whose replica has not
/// applied anything since: the cutover it lacks is lag, so the reader
/// reads the moved entity from s1's primary, without reloading its map
/// at every read.
async fn moved_behind_the_replica(env: &TestEnv, w: &Api, r: &Api, id: &str) {
    let k = schemas::logical_of(&hex(id), schemas::shard::DEFAULT_LOGICAL_SHARDS);
    let args = env.args(&["shards", "move", "--logical", &k.to_string(), "--to", "s1"]);
    let (ok, out, err) = env.run(&args, &[("BAGSTORE_MOVER__PROCESS_TTL_SECS", "2")]).await;
    assert!(ok, "shards move: {out}{err}");
    let (status, body) = w.put(id, &json!({"group": "h", "n": 3})).await;
    assert_eq!(status, 200, "{body}");
    let token = body["write_token"].as_str().unwrap().to_string();
    eventually("the reader to read the moved entity", Duration::from_secs(30), || async {
        (get(r, id, &[]).await.1["version"] == 3).then_some(())
    })
    .await;
    let before = r.metrics().await;
    for _ in 0..20 {
        assert_eq!(get(r, id, &[]).await.1["version"], 3);
    }
    assert_eq!(get(r, id, &[&token]).await.1["version"], 3);
    let after = r.metrics().await;
    let behind = [("reason", "behind_cutover")];
    let fallbacks = "bagstore_reader_replica_fallbacks_total";
    assert!(
        metric_sum(&after, fallbacks, &behind) >= metric_sum(&before, fallbacks, &behind) + 20.0,
        "reads of the moved entity did not fall back as behind the cutover"
    );
    for name in ["bagstore_reader_stale_map_retries_total", "bagstore_map_reloads_total"] {
        assert_eq!(
            metric_sum(&after, name, &[]),
            metric_sum(&before, name, &[]),
            "{name} moved on a lagging replica"
        );
    }
}

fn hex(id: &str) -> Vec<u8> {
    schemas::EntityId::parse(id).unwrap().0.to_vec()
}
