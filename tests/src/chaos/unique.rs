//! Writers competing for unique keys ([`UNIQUE_TOML`]'s index): a client
//! puts, patches and deletes entities of its own small id space, each
//! claiming one of a few handles, so most writes race another entity for
//! a key while the faults land. A 409 `unique-violation` is a right
//! answer; any other refusal is a bug.
//!
//! Checked at the end ([`check_unique`]): no two live entities share a
//! handle, and the unique index's rows are exactly one held row per
//! handle a live entity holds, naming it (once the cleaner has resolved
//! the reservations killed writers left).

use super::*;

/// The unique index the competitors write.
pub(super) const UNIQUE_TOML: &str = r#"
[[indexes]]
table = "index_uhandle"
properties = [{ name = "uhandle", type = "string", max_len = 16 }]
unique = true
"#;

/// Ids the competitors write, and the handles they race for.
pub(super) const UNIQUE_IDS: usize = 24;
const HANDLES: usize = 6;

/// The client number the competitor records its writes under.
const CLIENT: usize = 900;

pub(super) fn unique_id(k: usize) -> String {
    format!("{:032x}", 0xc4a0_7000_0000u64 + k as u64)
}

/// Counts of the competitor's answers.
#[derive(Debug, Default)]
pub(super) struct UniqueCounters {
    pub refused: AtomicU64,
}

/// The competing client (see the module docs).
pub(super) async fn unique_client(shared: Arc<Shared>, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(7919).wrapping_add(34));
    while let Some(base) = shared.next_turn(&mut rng).await {
        let id = unique_id(rng.random_range(0..UNIQUE_IDS));
        let url = format!("{base}/v1/entities/{id}");
        let handle = format!("h{}", rng.random_range(0..HANDLES));
        let roll = rng.random_range(0..100);
        let (what, req) = if roll < 45 {
            let body = json!({"uhandle": handle, "n": rng.random_range(0..1000)});
            (format!("unique put {body}"), shared.http.put(&url).json(&body))
        } else if roll < 70 {
            let doc = json!({"$set": {"uhandle": handle}});
            (format!("unique patch {doc}"), shared.http.patch(&url).json(&doc))
        } else if roll < 85 {
            ("unique delete".to_string(), shared.http.delete(&url))
        } else {
            // Drops its handle: the key is freed.
            let body = json!({"n": rng.random_range(0..1000)});
            (format!("unique put {body}"), shared.http.put(&url).json(&body))
        };
        let answer = shared.send(req).await;
        if let Ok((409, body)) = &answer {
            if body["type"] != "/problems/unique-violation"
                || body["existing_id"].as_str() == Some(id.as_str())
            {
                shared.fail(format!("{what} on {id}: a wrong 409: {body}"));
            }
            shared.counters.unique.refused.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let outcome = outcome_of(&shared, &what, answer);
        shared.record(CLIENT, &id, what, outcome);
    }
}

/// The end checks (see the module docs); returns the handles held.
pub(super) async fn check_unique(shared: &Shared, env: &TestEnv) -> usize {
    let ids: Vec<String> = (0..UNIQUE_IDS).map(unique_id).collect();
    let req = shared.http.post(format!("{}/v1/entities/get", shared.reader)).json(&json!({"ids": ids}));
    let (status, body) = shared.send(req).await.expect("batch get");
    assert_eq!(status, 200, "{body}");
    let mut holders: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for e in body["items"].as_array().expect("items") {
        if let Some(h) = e["properties"]["uhandle"].as_str() {
            holders.entry(h.to_string()).or_default().push(e["id"].as_str().unwrap().to_string());
        }
    }
    for (h, who) in holders.iter().filter(|(_, who)| who.len() > 1) {
        shared.fail(format!("unique: handle {h} is held by {} live entities: {who:?}", who.len()));
    }
    let want: BTreeSet<(String, String, bool)> =
        holders.iter().map(|(h, who)| (h.clone(), who[0].clone(), false)).collect();
    let rows = || async {
        env.fetch_all_shards::<(Vec<u8>, String, i64)>(
            "SELECT uhandle, LOWER(HEX(entity_id)), CAST(token IS NOT NULL AS SIGNED) FROM index_uhandle",
        )
        .await
        .into_iter()
        .map(|(_, (k, e, p))| (String::from_utf8_lossy(&k).into_owned(), e, p != 0))
        .collect::<BTreeSet<_>>()
    };
    // A killed writer's reservation is resolved by the cleaner once it
    // runs out (5 s).
    let settled = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if rows().await == want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    if settled.is_err() {
        shared.fail(format!("unique: the key rows are {:?}, the truth is {want:?}", rows().await));
    }
    holders.len()
}
