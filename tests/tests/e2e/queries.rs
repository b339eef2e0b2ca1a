//! The query engine end to end: ordered pages on one shard and across
//! shards, ranges, pagination under concurrent writes, the planner, stale
//! rows inside a page, read-your-writes, and index order in MySQL.

use bagstore_tests::{eventually, Api, TestEnv};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use schemas::index::{IndexSpec, KeyValue};
use serde_json::{json, Value};
use std::collections::HashSet;
use std::time::Duration;
use storage::index_rows::IndexRow;
use storage::index_scan::{self, IndexScan};
use storage::migrate;

const INDEXES: &str = r#"
[[indexes]]
table = "index_user_id"
properties = [{ name = "user_id", type = "uuid" }]

[[indexes]]
table = "index_user_published"
properties = [{ name = "user_id", type = "uuid" }, { name = "published", type = "int" }]
shard_on = "user_id"

[[indexes]]
table = "index_user_title"
properties = [{ name = "user_id", type = "uuid" }, { name = "title", type = "string" }]

[[indexes]]
table = "index_feed_published"
properties = [{ name = "feed_id", type = "uuid" }, { name = "published", type = "int" }]
shard_on = "published"
"#;

fn uid(n: u64) -> String {
    format!("{:032x}", 0xfeed_0000_0000u64 + n)
}

/// Entities `(id, user, feed, published)`; some published values repeat,
/// so ties are broken by entity id.
fn corpus() -> Vec<(String, String, String, i64)> {
    let mut rng = StdRng::seed_from_u64(7);
    (0..95u64)
        .map(|i| {
            let user = if i < 65 { uid(1) } else { uid(2) };
            (uid(1000 + i), user, uid(500), rng.random_range(1_000..1_060))
        })
        .collect()
}

async fn put_all(api: &Api, items: &[(String, String, String, i64)]) {
    let docs: Vec<Value> = items
        .iter()
        .map(|(id, user, feed, published)| {
            json!({"id": id, "user_id": user, "feed_id": feed, "published": published, "title": format!("t{published}")})
        })
        .collect();
    let (s, body) = api.batch(&docs).await;
    assert_eq!(s, 200, "{body}");
}

/// Every page of a query; asserts each page touches `shards` shards.
async fn all_pages(api: &Api, q: &Value, shards: u64) -> Vec<String> {
    let mut q = q.clone();
    let mut ids = Vec::new();
    for _ in 0..100 {
        let (s, body) = api.query(&q).await;
        assert_eq!(s, 200, "{body}");
        assert_eq!(body["explain"]["shards_touched"], shards, "{body}");
        ids.extend(body["items"].as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap().to_string()));
        match body["next_page_token"].as_str() {
            Some(t) => q["page_token"] = json!(t),
            None => return ids,
        }
    }
    panic!("more than 100 pages")
}

fn newest_first(items: &[(String, String, String, i64)], user: &str) -> Vec<String> {
    let mut mine: Vec<&(String, String, String, i64)> = items.iter().filter(|e| e.1 == user).collect();
    mine.sort_by(|a, b| (b.3, &b.0).cmp(&(a.3, &a.0)));
    mine.iter().map(|e| e.0.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latest_entries_of_one_user_page_newest_first_on_one_shard_even_with_stale_rows() {
    let env = TestEnv::new("latest", INDEXES).await;
    // The in-process cleaner sleeps after its first cycle: the hand-made
    // rows below are for the reader to face, not for the cleaner to repair.
    let dev = env
        .spawn_env(&["dev", "--http", "127.0.0.1:0"], &[("BAGSTORE_CLEANER__INTERVAL_MS", "600000")])
        .await;
    let api = dev.api();
    let items = corpus();
    put_all(&api, &items).await;
    let want = newest_first(&items, &uid(1));
    let q =
        json!({"index": "index_user_published", "where": {"user_id": uid(1)}, "order": "desc", "limit": 20});
    eventually("every entry to be indexed", Duration::from_secs(20), || async {
        (all_pages(&api, &q, 1).await.len() == want.len()).then_some(())
    })
    .await;
    assert_eq!(all_pages(&api, &q, 1).await, want);
    let (_, first) = api.query(&q).await;
    assert_eq!(first["items"].as_array().unwrap().len(), 20);

    // Hand-made rows in the middle of page one: an id that does not exist,
    // another user's entity, and one of this user's with a wrong value.
    let user = schemas::EntityId::parse(&uid(1)).unwrap();
    let shard = schemas::shard::initial_position_of(&user.0, 2);
    let pool = env.pool(shard).await;
    let mid = items.iter().filter(|e| e.1 == uid(1)).map(|e| e.3).max().unwrap() - 3;
    for (entity, published) in [(uid(9999), mid), (items[80].0.clone(), mid), (items[0].0.clone(), mid + 1)] {
        sqlx::query("INSERT IGNORE INTO index_user_published (user_id, published, entity_id, version) VALUES (?, ?, ?, 1)")
            .bind(&user.0[..])
            .bind(published)
            .bind(&schemas::EntityId::parse(&entity).unwrap().0[..])
            .execute(&pool)
            .await
            .unwrap();
    }
    let (s, page) = api.query(&q).await;
    assert_eq!(s, 200);
    let got: Vec<&str> =
        page["items"].as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert_eq!(got, want[..20].iter().map(String::as_str).collect::<Vec<_>>(), "{page}");
    assert!(page["explain"]["dropped_by_refilter"].as_u64().unwrap() >= 3, "{page}");
    assert_eq!(all_pages(&api, &q, 1).await, want, "later pages unchanged too");
    // Once the indexer has applied every event, the reported lag is zero.
    eventually("index_lag_ms to reach 0", Duration::from_secs(20), || async {
        let (_, page) = api.query(&q).await;
        (page["index_lag_ms"] == 0 && page["index_applied_through_us"].is_i64()).then_some(())
    })
    .await;

    // A forged or foreign token is refused.
    let mut other = q.clone();
    other["order"] = json!("asc");
    other["page_token"] = page["next_page_token"].clone();
    let (s, doc) = api.query(&other).await;
    assert_eq!((s, doc["type"].clone()), (400, json!("/problems/bad-page-token")));
    // A token of the encoding before v1 (bare hex of JSON) gets a clear 400.
    let mut old = q.clone();
    old["page_token"] = json!(schemas::id::hex(br#"{"f":1,"key":[],"id":[0]}"#));
    let (s, doc) = api.query(&old).await;
    assert_eq!((s, doc["type"].clone()), (400, json!("/problems/bad-page-token")));
    assert!(doc["detail"].as_str().unwrap().contains("another version of bagstore"), "{doc}");
    dev.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordered_query_without_a_fixed_shard_merges_every_shard_in_order() {
    let env = TestEnv::new("fanout", INDEXES).await;
    let dev = env.dev().await;
    let api = dev.api();
    let items = corpus();
    put_all(&api, &items).await;
    let mut want: Vec<&(String, String, String, i64)> = items.iter().collect();
    want.sort_by(|a, b| (b.3, &b.0).cmp(&(a.3, &a.0)));
    let want: Vec<String> = want.iter().map(|e| e.0.clone()).collect();
    // Rows live on the shard of their `published` value: both shards hold some.
    let q = json!({"index": "index_feed_published", "where": {"feed_id": uid(500)}, "order": "desc", "limit": 15});
    eventually("every entry to be indexed", Duration::from_secs(20), || async {
        (all_pages(&api, &q, 2).await.len() == want.len()).then_some(())
    })
    .await;
    assert_eq!(all_pages(&api, &q, 2).await, want);
    assert!(env.count_rows("index_feed_published").await == 95);

    // A range, ascending.
    let mut asc: Vec<&(String, String, String, i64)> =
        items.iter().filter(|e| (1_010..1_030).contains(&e.3)).collect();
    asc.sort_by(|a, b| (a.3, &a.0).cmp(&(b.3, &b.0)));
    let asc: Vec<String> = asc.iter().map(|e| e.0.clone()).collect();
    let rq = json!({"index": "index_feed_published", "where": {"feed_id": uid(500), "published": {"gte": 1010, "lt": 1030}},
                    "limit": 9});
    assert_eq!(all_pages(&api, &rq, 2).await, asc);
    dev.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paging_under_concurrent_writes_has_no_duplicates_and_misses_nothing_that_stayed() {
    let env = TestEnv::new("pagingrace", INDEXES).await;
    let dev = env.dev().await;
    let api = dev.api();
    let items = corpus();
    put_all(&api, &items).await;
    let original: HashSet<String> = items.iter().filter(|e| e.1 == uid(1)).map(|e| e.0.clone()).collect();
    let q =
        json!({"index": "index_user_published", "where": {"user_id": uid(1)}, "order": "desc", "limit": 7});
    eventually("every entry to be indexed", Duration::from_secs(20), || async {
        (all_pages(&api, &q, 1).await.len() == original.len()).then_some(())
    })
    .await;

    // New entries for the same user and rewrites of other users' entries
    // keep landing while we page.
    let writer_api = api.clone();
    let writes = tokio::spawn(async move {
        let mut rng = StdRng::seed_from_u64(11);
        for i in 0..120u64 {
            let published: i64 = rng.random_range(990..1_070);
            writer_api.put(&uid(5000 + i), &json!({"user_id": uid(1), "published": published})).await;
            writer_api.put(&uid(1070 + i % 20), &json!({"user_id": uid(2), "published": published})).await;
        }
    });
    let mut seen = Vec::new();
    let mut page_q = q.clone();
    loop {
        let (s, body) = api.query(&page_q).await;
        assert_eq!(s, 200, "{body}");
        seen.extend(body["items"].as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap().to_string()));
        match body["next_page_token"].as_str() {
            Some(t) => page_q["page_token"] = json!(t),
            None => break,
        }
        tokio::time::sleep(Duration::from_millis(30)).await; // pace the pages so writes interleave
    }
    writes.await.unwrap();
    let unique: HashSet<&String> = seen.iter().collect();
    assert_eq!(unique.len(), seen.len(), "duplicates across pages");
    for id in &original {
        assert!(unique.contains(id), "{id} matched throughout and was missed");
    }
    dev.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_planner_picks_the_most_specific_of_three_candidate_indexes() {
    let env = TestEnv::new("planner", INDEXES).await;
    let dev = env.dev().await;
    let api = dev.api();
    put_all(&api, &corpus()).await;
    let (s, body) = api
        .query(&json!({"where": {"user_id": uid(1), "published": {"gte": 1_050}, "title": {"exists": true}}}))
        .await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(body["index"], "index_user_published", "{body}");
    let (_, body) = api.query(&json!({"where": {"user_id": uid(1), "title": "t1001"}})).await;
    assert_eq!(body["index"], "index_user_title", "{body}");
    let (s, body) = api.query(&json!({"where": {"published": 5}})).await;
    assert_eq!((s, body["type"].clone()), (400, json!("/problems/no-usable-index")), "{body}");
    assert!(body["detail"].as_str().unwrap().contains("published"), "{body}");
    dev.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consistent_with_waits_for_a_paused_indexer_and_plain_queries_report_lag() {
    let env = TestEnv::new("ryw", INDEXES).await;
    env.migrate().await;
    let writer = env.spawn(&["writer"]).await;
    let reader = env.spawn_env(&["reader"], &[("BAGSTORE_READER__QUERY_TIMEOUT_MS", "30000")]).await;
    let impatient = env.spawn_env(&["reader"], &[("BAGSTORE_READER__QUERY_TIMEOUT_MS", "500")]).await;
    // No indexer runs yet: the index is paused.
    let (s, body) = writer.api().put(&uid(1), &json!({"user_id": uid(77), "published": 1})).await;
    assert_eq!(s, 201);
    let token = body["write_token"].as_str().unwrap().to_string();
    let q = json!({"index": "index_user_id", "where": {"user_id": uid(77)}});

    let (s, plain) = reader.api().query(&q).await;
    assert_eq!(s, 200);
    assert_eq!(plain["items"].as_array().unwrap().len(), 0, "the index has not seen the write");
    assert!(plain["index_lag_ms"].as_i64().unwrap() > 0, "{plain}");

    let mut consistent = q.clone();
    consistent["consistent_with"] = json!([token]);
    let (s, doc) = impatient.api().query(&consistent).await;
    assert_eq!((s, doc["type"].clone()), (504, json!("/problems/index-behind")), "{doc}");

    let waiting = {
        let api = reader.api();
        let consistent = consistent.clone();
        tokio::spawn(async move { api.query(&consistent).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the consistent query must wait for the index");
    let indexer = env.spawn(&["indexer", "--index", "index_user_id"]).await;
    let (s, body) = waiting.await.unwrap();
    assert_eq!(s, 200, "{body}");
    let ids: Vec<&str> =
        body["items"].as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert_eq!(ids, vec![uid(1).as_str()]);
    // A delete is consistent at once: the re-filter hides the entity.
    let (_, del) = writer.api().delete(&uid(1)).await;
    let mut after_delete = q.clone();
    after_delete["consistent_with"] = json!([del["write_token"]]);
    let (s, body) = reader.api().query(&after_delete).await;
    assert_eq!((s, body["items"].as_array().unwrap().len()), (200, 0), "{body}");
    for p in [writer, reader, impatient, indexer] {
        p.terminate().await;
    }
}

/// MySQL's index order must equal bagstore's value order, or merging
/// shards in Rust would interleave them wrongly: for every column type,
/// random values (negative numbers, unicode) come back from `ORDER BY` in
/// exactly `KeyValue` order, and keyset pages neither skip nor repeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_order_in_mysql_equals_value_order_for_every_type() {
    let env = TestEnv::new("keyorder", "").await;
    env.migrate().await;
    let shards = storage::Shards::configured(&schemas::settings::MysqlSettings {
        shards: env.dsns.iter().map(|d| schemas::settings::Dsn(d.clone())).collect(),
        ..Default::default()
    })
    .unwrap();
    let mut rng = StdRng::seed_from_u64(3);
    for ty in ["uuid", "string", "int", "float", "bool"] {
        let spec: IndexSpec = toml::from_str(&format!(
            "table = \"order_{ty}\"\nproperties = [{{ name = \"v\", type = \"{ty}\" }}]"
        ))
        .unwrap();
        migrate::create_index_table(0, shards.pool(0), &spec).await.unwrap();
        let alphabet = ['a', 'Z', 'é', 'ß', '日', '🎉', ' ', '0', '\u{7f}'];
        let mut rows = Vec::new();
        for i in 0..300u32 {
            let v = match ty {
                "uuid" => KeyValue::Uuid(rng.random()),
                "string" => KeyValue::Str(
                    (0..rng.random_range(0..6))
                        .map(|_| alphabet[rng.random_range(0..alphabet.len())])
                        .collect(),
                ),
                "int" => KeyValue::Int(if i % 3 == 0 { rng.random() } else { rng.random_range(-50..50) }),
                "float" => KeyValue::float(if i % 3 == 0 {
                    rng.random::<f64>() * 1e300 - 5e299
                } else {
                    rng.random_range(-2.0..2.0)
                }),
                _ => KeyValue::Bool(rng.random()),
            };
            let mut id = [0u8; 16];
            id[..4].copy_from_slice(&i.to_be_bytes());
            rows.push(IndexRow {
                key: vec![v],
                entity: schemas::EntityId(id),
                logical: 0,
                version: 1,
                entity_added_id: None,
                reservation: None,
            });
        }
        let mut conn = shards.pool(0).acquire().await.unwrap();
        storage::index_rows::upsert_index_rows(0, &mut conn, &spec, &rows).await.unwrap();
        drop(conn);
        let mut want: Vec<(Vec<KeyValue>, schemas::EntityId)> =
            rows.iter().map(|r| (r.key.clone(), r.entity)).collect();
        want.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap().then(a.1.cmp(&b.1)));
        want.dedup();
        for descending in [false, true] {
            let mut got = Vec::new();
            let mut after: Option<(Vec<KeyValue>, schemas::EntityId)> = None;
            loop {
                let scan = IndexScan {
                    prefix: &[],
                    range: None,
                    after: after.as_ref().map(|(k, id)| (&k[..], *id)),
                    descending,
                    limit: 37,
                    with_entities: descending,
                };
                // The joined scan (used by the reader) must keep the same order.
                let page: Vec<_> = index_scan::scan_index(0, shards.pool(0), &spec, &scan)
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|row| (row.key, row.entity))
                    .collect();
                if page.is_empty() {
                    break;
                }
                after = page.last().cloned();
                got.extend(page);
            }
            let mut expect = want.clone();
            if descending {
                expect.reverse();
            }
            assert_eq!(got, expect, "{ty} order differs (descending: {descending})");
        }
    }
    shards.close().await;
}
