//! The load: clients writing a seeded history, a checker reading it back
//! (Invariant R, acknowledged writes readable), a lag monitor.

use super::*;

/// Classifies a write answer. A 4xx other than 404/412 is a bug: the
/// clients only send valid requests.
pub(super) fn outcome_of(shared: &Shared, what: &str, answer: Result<(u16, Value), String>) -> Outcome {
    match answer {
        Ok((200 | 201, body)) => match body["version"].as_u64() {
            Some(v) => Outcome::Acked(v),
            None => {
                shared.fail(format!("{what}: a success without a version: {body}"));
                Outcome::Unknown("no version".into())
            }
        },
        Ok((s @ (404 | 412), _)) => Outcome::Rejected(s),
        Ok((s, body)) if s >= 500 => Outcome::Unknown(format!("{s} {}", body["type"])),
        Ok((s, body)) => {
            shared.fail(format!("{what}: unexpected {s}: {body}"));
            Outcome::Unknown(format!("{s}"))
        }
        Err(e) => Outcome::Unknown(e),
    }
}

/// One writing client: random puts, conditional puts, creates, deletes and
/// small batches over the shared key space, through any live writer.
pub(super) async fn client(shared: Arc<Shared>, n: usize, seed: u64, keys: usize) {
    let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(1000).wrapping_add(n as u64));
    while let Some(base) = shared.next_turn(&mut rng).await {
        let k = rng.random_range(0..keys);
        let id = entity_id(k);
        let url = format!("{base}/v1/entities/{id}");
        let roll = rng.random_range(0..100);
        if roll < 10 {
            // A batch of three (one transaction per shard).
            let items: Vec<(String, Value)> = (0..3)
                .map(|_| {
                    let id = entity_id(rng.random_range(0..keys));
                    let mut body = model::random_entity(&mut rng);
                    body["id"] = json!(id);
                    (id, body)
                })
                .collect();
            let bodies: Vec<&Value> = items.iter().map(|(_, b)| b).collect();
            let req =
                shared.http.post(format!("{base}/v1/entities/batch")).json(&json!({"entities": bodies}));
            match shared.send(req).await {
                Ok((200, doc)) => {
                    let results = doc["results"].as_array().cloned().unwrap_or_default();
                    if results.len() != items.len() {
                        shared.fail(format!(
                            "batch answered {} results for {} items: {doc}",
                            results.len(),
                            items.len()
                        ));
                    }
                    for ((id, body), r) in items.iter().zip(results) {
                        let status = r["status"].as_u64().unwrap_or(200) as u16;
                        let outcome = outcome_of(&shared, "batch item", Ok((status, r)));
                        shared.record(n, id, format!("batch put {body}"), outcome);
                    }
                }
                other => {
                    for (id, body) in &items {
                        let o = outcome_of(&shared, "batch", other.clone());
                        shared.record(n, id, format!("batch put {body}"), o);
                    }
                }
            }
            continue;
        }
        let body = model::random_entity(&mut rng);
        if roll < 35 {
            // A new entity, never written again: if its event were lost,
            // no later event of the same entity would repair its rows.
            let id = format!("{:032x}", rng.random::<u128>());
            let url = format!("{base}/v1/entities/{id}");
            shared.created.lock().unwrap().push(id.clone());
            let req = shared.http.put(&url).header("If-None-Match", "*").json(&body);
            let what = format!("create {body}");
            let outcome = outcome_of(&shared, &what, shared.send(req).await);
            shared.record(n, &id, what, outcome);
            continue;
        }
        let (what, req) = if roll < 45 {
            ("delete".to_string(), shared.http.delete(&url))
        } else if roll < 58 {
            // Usually the version this client believes current; sometimes stale.
            let known = shared.max_acked.lock().unwrap().get(&id).copied().unwrap_or(1);
            let v = if rng.random_bool(0.7) { known } else { rng.random_range(1..known + 2) };
            (
                format!("put if-match {v} {body}"),
                shared.http.put(&url).header("If-Match", format!("\"{v}\"")).json(&body),
            )
        } else if roll < 62 {
            (
                format!("put if-none-match {body}"),
                shared.http.put(&url).header("If-None-Match", "*").json(&body),
            )
        } else if rng.random_bool(0.5) {
            keyed_put(&shared, n, &id, body, &mut rng).await;
            continue;
        } else {
            (format!("put {body}"), shared.http.put(&url).json(&body))
        };
        let answer = shared.send(req).await;
        let outcome = outcome_of(&shared, &what, answer);
        shared.record(n, &id, what, outcome);
    }
}

/// A put with an `Idempotency-Key`, sent again with that key (through any
/// live writer) while its outcome is unknown (a 5xx or a lost connection),
/// up to five tries. The body carries the key (`retry_key`), so the topic
/// shows how often it was applied: at most once, and at the version
/// acknowledged (checked at the end, [`check_keyed`]).
async fn keyed_put(shared: &Shared, n: usize, id: &str, mut body: Value, rng: &mut StdRng) {
    let key = format!("chaos-{:032x}", rng.random::<u128>());
    body["retry_key"] = json!(key);
    let what = format!("keyed put {body}");
    let mut tries = 0;
    let mut log = Vec::new();
    let outcome = loop {
        tries += 1;
        let Some(base) = shared.live_writer(rng) else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let req =
            shared.http.put(format!("{base}/v1/entities/{id}")).header("Idempotency-Key", &key).json(&body);
        let sent_ms = shared.ms();
        let outcome = outcome_of(shared, &what, shared.send(req).await);
        log.push(format!("try {tries} at {sent_ms}-{} ms via {base}: {outcome}", shared.ms()));
        if !matches!(outcome, Outcome::Unknown(_)) || tries == 5 || shared.stop.load(Ordering::Relaxed) {
            break outcome;
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(100..400))).await;
    };
    let acked = match outcome {
        Outcome::Acked(v) => Some(v),
        _ => None,
    };
    shared.keyed.lock().unwrap().push(Keyed { id: id.to_string(), key, tries, acked, log });
    shared.record(n, id, format!("{what} ({tries} tries)"), outcome);
}

/// A keyed put of the load, as its client saw it.
#[derive(Debug, Clone)]
pub(super) struct Keyed {
    id: String,
    key: String,
    tries: u32,
    /// The version its last try was answered with.
    acked: Option<u64>,
    /// Each try: when, through which writer, and its outcome.
    log: Vec<String>,
}

/// Every keyed put applied at most once, at the version acknowledged (if
/// one was): the versions on the topic whose body carries its key. Returns
/// the breaches, and how many keyed puts were tried more than once.
pub(super) fn check_keyed(shared: &Shared, events: &[model::TopicEvent]) -> (Vec<String>, usize) {
    let mut applied: HashMap<&str, BTreeSet<u64>> = HashMap::new();
    for e in events {
        let key = e.event.after.as_ref().and_then(|b| match b.get("retry_key") {
            Some(schemas::value::Value::String(k)) => Some(k.as_str()),
            _ => None,
        });
        if let Some(k) = key {
            applied.entry(k).or_default().insert(e.event.version);
        }
    }
    let keyed = shared.keyed.lock().unwrap();
    let mut out = Vec::new();
    for k in keyed.iter() {
        let versions: Vec<u64> =
            applied.get(k.key.as_str()).map(|v| v.iter().copied().collect()).unwrap_or_default();
        let fine = match k.acked {
            Some(v) => versions == [v],
            None => versions.len() <= 1,
        };
        if !fine {
            out.push(format!(
                "entity {}: keyed put {} ({} tries, answered {:?}) is on the topic at versions {versions:?} ({})",
                k.id,
                k.key,
                k.tries,
                k.acked,
                k.log.join("; ")
            ));
        }
    }
    (out, keyed.iter().filter(|k| k.tries > 1).count())
}

/// The client number a fault's own writes are recorded under.
pub(super) const FAULT_CLIENT: usize = 99;

/// Creates `n` new entities at once (each id written once, recorded in
/// `created` like the load's creates) and returns how many were
/// acknowledged. Their events reach the topic together, so an idle indexer
/// fetches them in one batch or two.
pub(super) async fn burst_of_creates(shared: &Shared, rng: &mut StdRng, n: usize) -> usize {
    let Some(base) = shared.live_writer(rng) else { return 0 };
    let requests: Vec<(String, Value)> =
        (0..n).map(|_| (format!("{:032x}", rng.random::<u128>()), model::random_entity(rng))).collect();
    let sends = requests.into_iter().map(|(id, body)| {
        let url = format!("{base}/v1/entities/{id}");
        shared.created.lock().unwrap().push(id.clone());
        async move {
            let req = shared.http.put(&url).header("If-None-Match", "*").json(&body);
            let what = format!("create (burst) {body}");
            let outcome = outcome_of(shared, &what, shared.send(req).await);
            let acked = matches!(outcome, Outcome::Acked(_));
            shared.record(FAULT_CLIENT, &id, what, outcome);
            acked
        }
    });
    futures::future::join_all(sends).await.into_iter().filter(|a| *a).count()
}

/// Reads while the faults go on: random queries (Invariant R) and gets of
/// acknowledged writes (read-after-acknowledge on the canonical store).
pub(super) async fn checker(shared: Arc<Shared>, seed: u64, keys: usize) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x00c0_ffee);
    // On the primaries; connected again after a failover.
    let mut on: Vec<String> = Vec::new();
    let mut pools: Vec<sqlx::MySqlPool> = Vec::new();
    let c = &shared.counters;
    while !shared.stop.load(Ordering::Relaxed) {
        let primaries = shared.primaries.read().unwrap().clone();
        if primaries != on {
            for p in pools.drain(..) {
                p.close().await;
            }
            for d in &primaries {
                pools.push(sqlx::MySqlPool::connect_lazy(d).expect("a DSN"));
            }
            on = primaries;
        }
        if rng.random_bool(0.6) {
            let q = model::random_query(&mut rng);
            let req = shared.http.post(format!("{}/v1/query", shared.reader)).json(&q);
            let sent = now_us();
            match shared.send(req).await {
                Ok((200, body)) => {
                    let items = body["items"].as_array().cloned().unwrap_or_default();
                    let mut seen = BTreeSet::new();
                    for item in &items {
                        let id = item["id"].as_str().unwrap_or("?").to_string();
                        if !model::matches(&q, &item["properties"]) {
                            shared.fail(format!(
                                "Invariant R: query {q} returned {id} with {}",
                                item["properties"]
                            ));
                        }
                        if !seen.insert(id.clone()) {
                            shared.fail(format!("query {q} returned {id} twice"));
                        }
                        // Expired before the query began: hidden by the re-filter.
                        if let Some(at) = expires_us(&item["properties"]).filter(|at| *at <= sent) {
                            shared.fail(format!(
                                "query {q} returned {id}, expired at {at} µs, before the query was sent at {sent} µs: {}",
                                item["properties"]
                            ));
                        }
                    }
                    c.queries_checked.fetch_add(1, Ordering::Relaxed);
                    c.query_items_checked.fetch_add(items.len() as u64, Ordering::Relaxed);
                }
                Ok((s, _)) if s >= 500 => {
                    c.queries_unavailable.fetch_add(1, Ordering::Relaxed);
                }
                Ok((s, body)) => shared.fail(format!("query {q}: unexpected {s}: {body}")),
                Err(_) => {
                    c.queries_unavailable.fetch_add(1, Ordering::Relaxed);
                }
            }
        } else {
            let id = entity_id(rng.random_range(0..keys));
            let floor = shared.max_acked.lock().unwrap().get(&id).copied().unwrap_or(0);
            let req = shared.http.get(format!("{}/v1/entities/{id}", shared.reader));
            match shared.send(req).await {
                Ok((200, body)) => {
                    let v = body["version"].as_u64().unwrap_or(0);
                    if v < floor {
                        shared.fail(format!("get {id}: version {v} below the acknowledged {floor}"));
                    }
                    c.gets_checked.fetch_add(1, Ordering::Relaxed);
                }
                Ok((404, _)) => {
                    // Wrong only if the acknowledged version is still the
                    // live one: then the 404 hid it. A tombstone at or above
                    // it, or any newer version (a later delete, maybe already
                    // overwritten by a re-create), explains the 404; so does
                    // no row at all if the tombstone was purged: then its
                    // logical shard's version floor (raised in the purge's
                    // transaction) covers it. Logical shards move: only a
                    // shard that owns the entity's logical shard speaks for
                    // it (a moved-away copy waits for its removal, and its
                    // old row must not stand in for a purged tombstone).
                    match owners_of(&pools, &id).await {
                        Ok(owners) if owners.is_empty() => {
                            // Read mid-handover, between shards: no verdict.
                            c.gets_unavailable.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(owners) => {
                            let explains = |o: &Owner| match o.row {
                                Some((v, tombstone)) => v > floor || (tombstone && v == floor),
                                None => o.floor >= floor,
                            };
                            if owners.iter().any(explains) {
                                c.gets_checked.fetch_add(1, Ordering::Relaxed);
                                if owners.iter().any(|o| o.row.is_none() && floor > 0) {
                                    c.gets_purged.fetch_add(1, Ordering::Relaxed);
                                }
                            } else {
                                let at = where_is(&pools, &id).await;
                                let owners: Vec<String> = owners
                                    .iter()
                                    .map(|o| format!("s{}: row {:?}, floor {}", o.shard, o.row, o.floor))
                                    .collect();
                                shared.fail(format!(
                                    "get {id}: 404 but its owner has {owners:?} (row: version, tombstone) \
                                     and {floor} was acknowledged; {at}"
                                ))
                            }
                        }
                        Err(_) => {
                            c.gets_unavailable.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                Ok((s, _)) if s >= 500 => {
                    c.gets_unavailable.fetch_add(1, Ordering::Relaxed);
                }
                Ok((s, body)) => shared.fail(format!("get {id}: unexpected {s}: {body}")),
                Err(_) => {
                    c.gets_unavailable.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
    for p in pools {
        p.close().await;
    }
}

/// Where `id` and its logical shard are, for a failure's message: per
/// physical shard its row, whether the shard owns the logical shard and its
/// epoch; then the map's owner and the moves of that logical shard.
async fn where_is(pools: &[sqlx::MySqlPool], id: &str) -> String {
    let logical = logical_of_hex(id);
    let mut out = format!("logical shard {logical}:");
    for (i, pool) in pools.iter().enumerate() {
        let row: Result<Option<(u64, bool, u64, i64)>, _> = sqlx::query_as(
            "SELECT CAST(version AS UNSIGNED), body IS NULL, CAST(added_id AS UNSIGNED), \
             CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01', updated) AS SIGNED) FROM entities WHERE id = UNHEX(?)",
        )
        .bind(id)
        .fetch_optional(pool)
        .await;
        let owned: Result<Option<(u64,)>, _> =
            sqlx::query_as("SELECT CAST(version_floor AS UNSIGNED) FROM bagstore_owned WHERE logical = ?")
                .bind(logical)
                .fetch_optional(pool)
                .await;
        let epoch: Result<Option<(u64,)>, _> =
            sqlx::query_as("SELECT CAST(epoch AS UNSIGNED) FROM bagstore_shard WHERE id = 1")
                .fetch_optional(pool)
                .await;
        out += &format!(
            " s{i}: row (version, tombstone, added_id, updated_us) {row:?}, owned (floor) {owned:?}, epoch {epoch:?};"
        );
    }
    let map: Result<Option<(u64,)>, _> =
        sqlx::query_as("SELECT CAST(physical AS UNSIGNED) FROM bagstore_map WHERE logical = ?")
            .bind(logical)
            .fetch_optional(&pools[0])
            .await;
    type MoveRow = (u64, String, u64, u64, String);
    let moves: Result<Vec<MoveRow>, _> = sqlx::query_as(
        "SELECT CAST(id AS UNSIGNED), logicals, CAST(source AS UNSIGNED), CAST(target AS UNSIGNED), phase \
         FROM bagstore_moves ORDER BY id",
    )
    .fetch_all(&pools[0])
    .await;
    let moves: Vec<String> = match moves {
        Ok(m) => m
            .into_iter()
            .filter(|(_, ls, ..)| {
                schemas::topology::parse_logicals(ls, schemas::shard::DEFAULT_LOGICAL_SHARDS)
                    .is_ok_and(|v| v.contains(&logical))
            })
            .map(|(mid, ls, s, t, phase)| format!("move {mid} ({ls}) s{s}->s{t} {phase}"))
            .collect(),
        Err(e) => vec![format!("moves unreadable: {e}")],
    };
    out + &format!(" the map says {map:?}; its moves: {moves:?}")
}

/// What one shard that owns an entity's logical shard holds of it.
struct Owner {
    shard: usize,
    /// Its row: (version, tombstone).
    row: Option<(u64, bool)>,
    /// Its logical shard's version floor there.
    floor: u64,
}

/// The shards that own `id`'s logical shard, each with its row and floor
/// read in one statement (so ownership and row are of one moment).
async fn owners_of(pools: &[sqlx::MySqlPool], id: &str) -> Result<Vec<Owner>, sqlx::Error> {
    let mut out = Vec::new();
    for (shard, pool) in pools.iter().enumerate() {
        let found: Option<(u64, Option<u64>, Option<bool>)> = sqlx::query_as(
            "SELECT CAST(o.version_floor AS UNSIGNED), CAST(e.version AS UNSIGNED), e.body IS NULL \
             FROM bagstore_owned o LEFT JOIN entities e ON e.id = UNHEX(?) WHERE o.logical = ?",
        )
        .bind(id)
        .bind(logical_of_hex(id))
        .fetch_optional(pool)
        .await?;
        if let Some((floor, version, tombstone)) = found {
            out.push(Owner { shard, row: version.map(|v| (v, tombstone.unwrap_or(false))), floor });
        }
    }
    Ok(out)
}

/// Samples the index lag (events, from the broker; seconds, from the
/// cleaner's metrics) and keeps the maxima for the report.
pub(super) async fn monitor(
    shared: Arc<Shared>,
    kafka: schemas::settings::KafkaSettings,
    cleaner_url: Arc<RwLock<String>>,
) {
    let http = reqwest::Client::new();
    while !shared.stop.load(Ordering::Relaxed) {
        let mut events = 0i64;
        for t in STANDARD_TABLES {
            if let Ok(parts) = service::kafka::group_lag(&kafka, &kafka.group_for(t)).await {
                events = events.max(parts.iter().map(|p| p.lag()).sum());
            }
        }
        shared.counters.max_lag_events.fetch_max(events as u64, Ordering::Relaxed);
        let url = format!("{}/metrics", cleaner_url.read().unwrap());
        if let Ok(resp) = http.get(url).timeout(Duration::from_secs(2)).send().await {
            let text = resp.text().await.unwrap_or_default();
            for t in STANDARD_TABLES {
                let secs = metric_sum(&text, "bagstore_index_lag_seconds", &[("index", t)]);
                shared.counters.max_lag_ms.fetch_max((secs * 1000.0) as u64, Ordering::Relaxed);
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
