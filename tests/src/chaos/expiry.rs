//! Expiry (TTL) and the tombstone purge under chaos (issue 18).
//!
//! Every process of the run (and every `bagstore shards` command) reads
//! [`CONFIG_TOML`]: `expiry.property = "expires_at"`, the cleaner searching
//! for expired entities every 300 ms, and tombstones purged 2 s after the
//! delete, every 500 ms. The shared keys' deletes are therefore purged
//! during the load, and a re-created id continues above its logical
//! shard's version floor instead of its old tombstone: [`check_versions`]
//! is Invariant W with that allowance (versions of a live entity still go
//! up by exactly one; a jump only follows a delete, and only as far as the
//! floor).
//!
//! One more client ([`expiring_client`]) writes entities of a key space of
//! its own ([`exp_id`]) that expire 1–4 s after the write (whole or
//! fractional seconds), rewrites some before they expire (with a later
//! expiry, or none), re-creates some after, and gives some no expiry or
//! one an hour away. It alone writes those ids, one request at a time, so
//! its model is exact: each id's last acknowledged version and body (a
//! write of unknown outcome is settled by a rewrite once the load stops).
//! Checked on every answer, with the instants the request was sent and
//! answered: a live entity's write gets exactly the next version; an
//! expired one is absent to writes (`If-None-Match: *` succeeds with a
//! version above the old one, `If-Match` fails with 412) and to gets and
//! batch gets; a non-number expiry is refused with 422 `bad-expiry`.
//!
//! At the end ([`until_expired_are_deleted`], [`check_expiring`]), once the
//! clock passed every expiry the client left and the cleaner deleted them:
//! no expired entity is returned by a get, the batch get or the query on
//! its tag; each one's row is a tombstone one version above its last write
//! (the cleaner's delete), or gone with its logical shard's floor at least
//! that high (purged); no index row names it; every other entity of the
//! client is visible with its last acknowledged version and properties.

use super::*;
use schemas::event::Op;
use std::time::{SystemTime, UNIX_EPOCH};

/// Appended to the run's config: read by every process of the stack.
pub(super) const CONFIG_TOML: &str = "
[expiry]
property = \"expires_at\"

[cleaner]
expiry_interval_ms = 300
tombstone_retention_secs = 2
purge_interval_ms = 500
";

/// Ids the expiring client writes (nobody else writes them).
pub(super) const EXP_KEYS: usize = 48;
/// A tag every body of the expiring client carries: the end check's query.
pub(super) const EXP_TAG: &str = "exp";
/// The expiring client's number in the history of operations.
const EXP_CLIENT: usize = 99;
/// An expiry this far ahead does not pass during the run.
const FAR_SECS: i64 = 3600;

pub(super) fn exp_id(k: usize) -> String {
    format!("{:032x}", 0xe4a0_5000_0000u64 + k as u64)
}

/// Wall-clock microseconds since the Unix epoch (the processes of the
/// stack read the same clock).
pub(super) fn now_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock after 1970").as_micros() as i64
}

/// The expiry instant a body names (µs, rounded up: the entity is hidden
/// from that microsecond on), worked out here, not by bagstore's code.
pub(super) fn expires_us(properties: &Value) -> Option<i64> {
    properties.get("expires_at").and_then(Value::as_f64).map(|secs| (secs * 1e6).ceil() as i64)
}

/// An expiry that passes during the run (not [`FAR_SECS`] away).
fn is_short(at_us: i64, now: i64) -> bool {
    at_us < now + FAR_SECS * 1_000_000 / 2
}

/// One id of the expiring client, as far as its answers tell.
#[derive(Debug, Clone, Default)]
pub(super) struct ExpEntity {
    /// The last acknowledged write: its version and body.
    pub(super) acked: Option<(u64, Value)>,
    /// A write after `acked` whose outcome is unknown (it may have committed).
    pub(super) uncertain: bool,
}

/// What an id was for the whole time between two instants (a request
/// sent and its answer), from the model alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// Never written (with certainty).
    Absent,
    /// Visible at this version (no expiry, or one after the answer).
    Live(u64),
    /// Expired before the request was sent (at this version).
    Expired(u64),
    /// Its expiry fell between the two instants.
    Edge(u64),
    /// An unknown outcome since the last acknowledged version (or 0).
    Unknown(u64),
}

fn seen(e: &ExpEntity, from_us: i64, to_us: i64) -> Seen {
    match (&e.acked, e.uncertain) {
        (a, true) => Seen::Unknown(a.as_ref().map_or(0, |(v, _)| *v)),
        (None, false) => Seen::Absent,
        (Some((v, body)), false) => match expires_us(body) {
            Some(at) if at <= from_us => Seen::Expired(*v),
            Some(at) if at <= to_us => Seen::Edge(*v),
            _ => Seen::Live(*v),
        },
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Put,
    IfMatch(u64),
    IfNoneMatch,
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Kind::Put => write!(f, "put"),
            Kind::IfMatch(v) => write!(f, "put if-match {v}"),
            Kind::IfNoneMatch => write!(f, "put if-none-match"),
        }
    }
}

/// What the expiring client did and saw, for the report.
#[derive(Debug, Default)]
pub(super) struct ExpCounters {
    pub(super) acked: AtomicU64,
    /// Acknowledged writes carrying an expiry that passes during the run…
    pub(super) with_expiry: AtomicU64,
    /// …of which in fractional seconds.
    pub(super) fractional: AtomicU64,
    /// Acknowledged rewrites of an entity whose expiry was still ahead:
    /// with a later expiry, and without one.
    pub(super) extended: AtomicU64,
    pub(super) cleared: AtomicU64,
    /// Acknowledged writes of an entity expired before the request.
    pub(super) recreated: AtomicU64,
    /// Conditional writes refused as they must be (412).
    pub(super) refused: AtomicU64,
    pub(super) bad_expiry: AtomicU64,
    pub(super) reads: AtomicU64,
    /// Reads that hid an entity expired before the read began.
    pub(super) hidden: AtomicU64,
    pub(super) unavailable: AtomicU64,
}

/// A time in seconds as a body names it: whole seconds (rounded up) or
/// milliseconds.
fn secs_value(rng: &mut StdRng, secs: f64) -> Value {
    if rng.random_bool(0.5) {
        json!(secs.ceil() as i64)
    } else {
        json!((secs * 1000.0).round() / 1000.0)
    }
}

/// A body over the standard indexes with [`EXP_TAG`] among its tags and,
/// mostly, an expiry 1–4 s ahead. `pending`: the expiry of the entity as
/// it is (still ahead), which a rewrite often pushes later or drops.
fn exp_body(rng: &mut StdRng, now: i64, pending: Option<i64>) -> Value {
    let mut body = model::random_entity(rng);
    let mut tags = match body.get("tags") {
        Some(Value::Array(a)) => a.clone(),
        Some(v @ Value::String(_)) => vec![v.clone()],
        _ => Vec::new(),
    };
    tags.push(json!(EXP_TAG));
    body["tags"] = Value::Array(tags);
    let now_secs = now as f64 / 1e6;
    let roll = rng.random_range(0..100);
    let ahead: f64 = rng.random_range(1.0..4.0);
    let at = match pending {
        Some(at) if roll < 45 => Some(secs_value(rng, at as f64 / 1e6 + ahead.min(3.0))),
        Some(_) if roll < 75 => None,
        _ if roll < 70 => Some(secs_value(rng, now_secs + ahead)),
        _ if roll < 85 => None,
        _ => Some(json!(now_secs.ceil() as i64 + FAR_SECS)),
    };
    if let Some(at) = at {
        body["expires_at"] = at;
    }
    body
}

/// JSON equality with numbers compared by value.
fn same_json(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same_json(p, q))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same_json(v, w)))
        }
        _ => a == b,
    }
}

/// Whether an answer to `kind` is what the store must give an entity that
/// was `state` throughout the request; why not, if not.
fn judge(kind: Kind, state: Seen, outcome: &Outcome) -> Result<(), String> {
    let rejected = |s: u16| match kind {
        Kind::Put => Err(format!("a plain put was rejected with {s}")),
        _ if s != 412 => Err(format!("rejected with {s}, not 412")),
        _ => Ok(()),
    };
    match (state, outcome) {
        (_, Outcome::Unknown(_)) => Ok(()),
        (Seen::Unknown(v) | Seen::Edge(v), Outcome::Acked(w)) => {
            (*w > v).then_some(()).ok_or(format!("version {w} is not above the acknowledged {v}"))
        }
        (Seen::Unknown(_) | Seen::Edge(_), Outcome::Rejected(s)) => rejected(*s),
        (Seen::Live(_), Outcome::Acked(_)) if kind == Kind::IfNoneMatch => {
            Err("If-None-Match: * succeeded on a live entity".into())
        }
        (Seen::Live(v), Outcome::Acked(w)) => (*w == v + 1)
            .then_some(())
            .ok_or(format!("a live entity at version {v} was written at version {w}, not {}", v + 1)),
        (Seen::Live(v), Outcome::Rejected(s)) => match kind {
            Kind::IfNoneMatch => rejected(*s),
            _ => Err(format!("rejected with {s} although live at version {v}")),
        },
        (Seen::Expired(_) | Seen::Absent, Outcome::Acked(_)) if matches!(kind, Kind::IfMatch(_)) => {
            Err("If-Match succeeded on an expired or absent entity".into())
        }
        (Seen::Expired(v), Outcome::Acked(w)) => (*w > v)
            .then_some(())
            .ok_or(format!("re-created at version {w}, not above its version {v} before it expired")),
        (Seen::Absent, Outcome::Acked(_)) => Ok(()),
        (Seen::Expired(_) | Seen::Absent, Outcome::Rejected(s)) => match kind {
            Kind::IfMatch(_) => rejected(*s),
            _ => Err(format!("rejected with {s}: an expired or absent entity must be absent to writes")),
        },
    }
}

/// One write of id `k` through `base`, judged and recorded in the model.
async fn write_one(shared: &Shared, rng: &mut StdRng, base: &str, k: usize) {
    let id = exp_id(k);
    let before = shared.expiring.lock().unwrap()[k].clone();
    let now = now_us();
    let pending = before.acked.as_ref().and_then(|(_, b)| expires_us(b)).filter(|at| *at > now);
    let body = exp_body(rng, now, pending);
    let wrong = rng.random_bool(0.08);
    let kind = match seen(&before, now, now) {
        Seen::Unknown(_) => Kind::Put,
        Seen::Absent | Seen::Expired(_) if wrong => {
            Kind::IfMatch(before.acked.as_ref().map_or(1, |(v, _)| *v))
        }
        Seen::Live(_) | Seen::Edge(_) if wrong => Kind::IfNoneMatch,
        Seen::Absent | Seen::Expired(_) if rng.random_bool(0.6) => Kind::IfNoneMatch,
        Seen::Live(v) | Seen::Edge(v) if rng.random_bool(0.5) => Kind::IfMatch(v),
        _ => Kind::Put,
    };
    let mut req = shared.http.put(format!("{base}/v1/entities/{id}")).json(&body);
    req = match kind {
        Kind::Put => req,
        Kind::IfMatch(v) => req.header("If-Match", format!("\"{v}\"")),
        Kind::IfNoneMatch => req.header("If-None-Match", "*"),
    };
    let what = format!("{kind} {body}");
    let sent = now_us();
    let answer = shared.send(req).await;
    let state = seen(&before, sent, now_us());
    let outcome = outcome_of(shared, &what, answer);
    if let Err(why) = judge(kind, state, &outcome) {
        shared.fail(format!("expiring entity {id} ({state:?} at the request): {what} -> {outcome}: {why}"));
    }
    let c = &shared.counters.exp;
    match &outcome {
        Outcome::Acked(w) => {
            c.acked.fetch_add(1, Ordering::Relaxed);
            let at = expires_us(&body);
            if at.is_some_and(|at| is_short(at, sent)) {
                c.with_expiry.fetch_add(1, Ordering::Relaxed);
                if body["expires_at"].is_f64() {
                    c.fractional.fetch_add(1, Ordering::Relaxed);
                }
            }
            if let (Seen::Live(_), Some(p)) = (state, pending) {
                match at {
                    None => c.cleared.fetch_add(1, Ordering::Relaxed),
                    Some(at) if at > p => c.extended.fetch_add(1, Ordering::Relaxed),
                    Some(_) => 0,
                };
            }
            if matches!(state, Seen::Expired(_)) {
                c.recreated.fetch_add(1, Ordering::Relaxed);
            }
            shared.expiring.lock().unwrap()[k] = ExpEntity { acked: Some((*w, body)), uncertain: false };
        }
        Outcome::Rejected(_) => {
            c.refused.fetch_add(1, Ordering::Relaxed);
        }
        Outcome::Unknown(_) => shared.expiring.lock().unwrap()[k].uncertain = true,
    }
    shared.record(EXP_CLIENT, &id, what, outcome);
}

/// A body whose expiry is not a number: refused whole (422 `bad-expiry`).
async fn bad_expiry(shared: &Shared, rng: &mut StdRng, base: &str, k: usize) {
    let id = exp_id(k);
    let mut body = model::random_entity(rng);
    body["expires_at"] = match rng.random_range(0..3) {
        0 => json!("in a second"),
        1 => json!(true),
        _ => json!([now_us() / 1_000_000 + 2]),
    };
    let req = shared.http.put(format!("{base}/v1/entities/{id}")).json(&body);
    match shared.send(req).await {
        Ok((422, doc)) if doc["type"].as_str().is_some_and(|t| t.ends_with("bad-expiry")) => {
            shared.counters.exp.bad_expiry.fetch_add(1, Ordering::Relaxed);
        }
        Ok((s, _)) if s >= 500 => {}
        Err(_) => {}
        Ok((s, doc)) => {
            shared.fail(format!("expiring entity {id}: put {body} answered {s} {doc}, not 422 bad-expiry"))
        }
    }
}

/// Checks one read of id `k`'s entity against the model: `found` is its
/// version and properties as the reader answered, `None` for absent.
fn judge_read(shared: &Shared, how: &str, k: usize, state: Seen, found: Option<(u64, &Value)>) {
    let id = exp_id(k);
    let c = &shared.counters.exp;
    c.reads.fetch_add(1, Ordering::Relaxed);
    let body = || shared.expiring.lock().unwrap()[k].acked.clone().map(|(_, b)| b).unwrap_or(Value::Null);
    match (state, found) {
        (Seen::Unknown(_), _) => {}
        (Seen::Live(v), Some((w, props))) | (Seen::Edge(v), Some((w, props))) => {
            let want = body();
            if w != v || !same_json(props, &want) {
                shared.fail(format!(
                    "{how} {id}: version {w} with {props}, but version {v} with {want} was the last acknowledged"
                ));
            }
        }
        (Seen::Live(v), None) => shared
            .fail(format!("{how} {id}: absent, but live at version {v} (expires {:?})", expires_us(&body()))),
        (Seen::Expired(v), Some((w, props))) => shared.fail(format!(
            "{how} {id}: returned version {w} with {props}, but version {v} expired before the read began"
        )),
        (Seen::Absent, Some((w, _))) => {
            shared.fail(format!("{how} {id}: returned version {w} of a never-written id"))
        }
        (Seen::Expired(_), None) => {
            c.hidden.fetch_add(1, Ordering::Relaxed);
        }
        (Seen::Absent | Seen::Edge(_), None) => {}
    }
}

/// A get of one of the client's ids and a batch get of it with a few more.
async fn read_some(shared: &Shared, rng: &mut StdRng) {
    let ks: Vec<usize> = (0..4).map(|_| rng.random_range(0..EXP_KEYS)).collect();
    let states = |from: i64, to: i64| -> Vec<Seen> {
        let m = shared.expiring.lock().unwrap();
        ks.iter().map(|k| seen(&m[*k], from, to)).collect()
    };
    let c = &shared.counters.exp;
    // Only this task writes these ids: the model holds still during a read.
    let sent = now_us();
    let answer =
        shared.send(shared.http.get(format!("{}/v1/entities/{}", shared.reader, exp_id(ks[0])))).await;
    let state = states(sent, now_us())[0];
    match answer {
        Ok((200, doc)) => {
            let v = doc["version"].as_u64().unwrap_or(0);
            judge_read(shared, "get", ks[0], state, Some((v, &doc["properties"])));
        }
        Ok((404, _)) => judge_read(shared, "get", ks[0], state, None),
        Ok((s, _)) if s >= 500 => {
            c.unavailable.fetch_add(1, Ordering::Relaxed);
        }
        Err(_) => {
            c.unavailable.fetch_add(1, Ordering::Relaxed);
        }
        Ok((s, doc)) => shared.fail(format!("get {}: unexpected {s}: {doc}", exp_id(ks[0]))),
    }
    let ids: Vec<String> = ks.iter().map(|k| exp_id(*k)).collect();
    let sent = now_us();
    let req = shared.http.post(format!("{}/v1/entities/get", shared.reader)).json(&json!({ "ids": ids }));
    let answer = shared.send(req).await;
    let seen_now = states(sent, now_us());
    match answer {
        Ok((200, doc)) => {
            let items = doc["items"].as_array().cloned().unwrap_or_default();
            let mut judged = BTreeSet::new();
            for (k, state) in ks.iter().zip(seen_now) {
                if !judged.insert(*k) {
                    continue;
                }
                let item = items.iter().find(|i| i["id"] == exp_id(*k).as_str());
                let found = item.map(|i| (i["version"].as_u64().unwrap_or(0), &i["properties"]));
                judge_read(shared, "batch get", *k, state, found);
            }
        }
        Ok((s, _)) if s >= 500 => {
            c.unavailable.fetch_add(1, Ordering::Relaxed);
        }
        Err(_) => {
            c.unavailable.fetch_add(1, Ordering::Relaxed);
        }
        Ok((s, doc)) => shared.fail(format!("batch get {ids:?}: unexpected {s}: {doc}")),
    }
}

/// The expiring client: writes, conditional writes, malformed expiries and
/// reads of its own ids, paced to a few dozen requests a second; once the
/// load stops, rewrites every id whose last write had an unknown outcome
/// until one is acknowledged, so that the model is exact.
pub(super) async fn expiring_client(shared: Arc<Shared>, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x00e4_a1e5);
    while let Some(base) = shared.next_turn(&mut rng).await {
        let k = rng.random_range(0..EXP_KEYS);
        match rng.random_range(0..100) {
            0..20 => read_some(&shared, &mut rng).await,
            20..23 => bad_expiry(&shared, &mut rng, &base, k).await,
            _ => write_one(&shared, &mut rng, &base, k).await,
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(10..40))).await;
    }
    let until = Instant::now() + Duration::from_secs(120);
    for k in 0..EXP_KEYS {
        while shared.expiring.lock().unwrap()[k].uncertain {
            if Instant::now() >= until {
                shared.fail(format!("expiring entity {}: no write was acknowledged within 120 s", exp_id(k)));
                break;
            }
            match shared.live_writer(&mut rng) {
                Some(base) => write_one(&shared, &mut rng, &base, k).await,
                None => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
}

/// The client's ids by what the model expects at the end: expired (with
/// the version of the last write and its expiry), and visible (version,
/// body).
pub(super) struct ExpFinal {
    pub(super) expired: BTreeMap<String, (u64, i64)>,
    pub(super) visible: BTreeMap<String, (u64, Value)>,
}

pub(super) fn exp_final(shared: &Shared) -> ExpFinal {
    let now = now_us();
    let mut out = ExpFinal { expired: BTreeMap::new(), visible: BTreeMap::new() };
    for (k, e) in shared.expiring.lock().unwrap().iter().enumerate() {
        // An id left uncertain (a failure already) is not judged.
        let (false, Some((v, body))) = (e.uncertain, &e.acked) else { continue };
        if let Some(at) = expires_us(body).filter(|at| is_short(*at, now)) {
            out.expired.insert(exp_id(k), (*v, at));
        } else {
            out.visible.insert(exp_id(k), (*v, body.clone()));
        }
    }
    out
}

/// `(body is null, version, logical shard)` of every row of `ids` on
/// every shard (more than one row while a move's copy is not cleaned up).
async fn entity_rows(env: &TestEnv, ids: &[&String]) -> HashMap<String, Vec<(bool, u64, u16)>> {
    let mut out: HashMap<String, Vec<(bool, u64, u16)>> = HashMap::new();
    if ids.is_empty() {
        return out;
    }
    let list: Vec<String> = ids.iter().map(|id| format!("UNHEX('{id}')")).collect();
    let sql = format!(
        "SELECT LOWER(HEX(id)), CAST(body IS NULL AS UNSIGNED), CAST(version AS UNSIGNED), \
         CAST(logical AS UNSIGNED) FROM entities WHERE id IN ({})",
        list.join(", ")
    );
    let rows: Vec<(usize, (String, u64, u64, u64))> = env.fetch_all_shards(&sql).await;
    for (_, (id, dead, v, logical)) in rows {
        out.entry(id).or_default().push((dead != 0, v, logical as u16));
    }
    out
}

/// Waits until the clock passed every expiry the client left and every
/// such entity's row is a tombstone or purged; the time that took after
/// the latest expiry (the cleaner's bound, with the stack's load).
pub(super) async fn until_expired_are_deleted(env: &TestEnv, fin: &ExpFinal) -> Duration {
    let latest = fin.expired.values().map(|(_, at)| *at).max().unwrap_or(0);
    eventually("the clock to pass the latest expiry", Duration::from_secs(30), || async move {
        (now_us() > latest).then_some(())
    })
    .await;
    let ids: Vec<&String> = fin.expired.keys().collect();
    let ids = &ids;
    eventually("the cleaner to delete every expired entity", Duration::from_secs(60), || async move {
        let rows = entity_rows(env, ids).await;
        rows.values().flatten().all(|(dead, _, _)| *dead).then_some(())
    })
    .await;
    Duration::from_micros((now_us() - latest).max(0) as u64)
}

/// The version floor of every logical shard (the highest any shard holds).
pub(super) async fn version_floors(env: &TestEnv) -> HashMap<u16, u64> {
    let rows: Vec<(usize, (u64, u64))> = env
        .fetch_all_shards(
            "SELECT CAST(logical AS UNSIGNED), CAST(version_floor AS UNSIGNED) FROM bagstore_owned",
        )
        .await;
    let mut out: HashMap<u16, u64> = HashMap::new();
    for (_, (logical, floor)) in rows {
        let f = out.entry(logical as u16).or_default();
        *f = (*f).max(floor);
    }
    out
}

pub(super) fn logical_of_hex(id: &str) -> u16 {
    let bytes = schemas::id::unhex(id).expect("hex id");
    schemas::logical_of(&bytes, schemas::shard::DEFAULT_LOGICAL_SHARDS)
}

/// What [`check_expiring`] found, for the report.
#[derive(Debug, Default)]
pub(super) struct ExpSummary {
    pub(super) expired: usize,
    pub(super) tombstones: usize,
    pub(super) purged: usize,
    pub(super) visible: usize,
}

/// The end checks of the client's entities (see the module docs), with
/// the pipeline caught up.
pub(super) async fn check_expiring(shared: &Shared, env: &TestEnv, fin: &ExpFinal) -> ExpSummary {
    let mut sum =
        ExpSummary { expired: fin.expired.len(), visible: fin.visible.len(), ..ExpSummary::default() };
    // Gets.
    for (id, (v, at)) in &fin.expired {
        let (status, doc) =
            shared.send(shared.http.get(format!("{}/v1/entities/{id}", shared.reader))).await.expect("get");
        if status != 404 {
            shared.fail(format!(
                "at the end, get {id} answered {status} {doc}: version {v} expired at {at} µs"
            ));
        }
    }
    for (id, (v, body)) in &fin.visible {
        let (status, doc) =
            shared.send(shared.http.get(format!("{}/v1/entities/{id}", shared.reader))).await.expect("get");
        if status != 200 || doc["version"].as_u64() != Some(*v) || !same_json(&doc["properties"], body) {
            shared.fail(format!("at the end, get {id} answered {status} {doc}, not version {v} with {body}"));
        }
    }
    // The batch get.
    let ids: Vec<String> = (0..EXP_KEYS).map(exp_id).collect();
    let req = shared.http.post(format!("{}/v1/entities/get", shared.reader)).json(&json!({ "ids": ids }));
    let (status, doc) = shared.send(req).await.expect("batch get");
    assert_eq!(status, 200, "{doc}");
    let mut got: BTreeMap<String, (u64, Value)> = BTreeMap::new();
    for item in doc["items"].as_array().expect("items") {
        let id = item["id"].as_str().unwrap_or("?").to_string();
        got.insert(id, (item["version"].as_u64().unwrap_or(0), item["properties"].clone()));
    }
    for (id, (v, body)) in &fin.visible {
        match got.get(id) {
            Some((w, props)) if w == v && same_json(props, body) => {}
            other => shared.fail(format!(
                "at the end, the batch get gave {other:?} for {id}, not version {v} with {body}"
            )),
        }
    }
    for id in got.keys().filter(|id| fin.expired.contains_key(*id)) {
        shared.fail(format!("at the end, the batch get returned the expired entity {id}"));
    }
    // The query on the client's tag, every page.
    let mut queried = BTreeSet::new();
    let mut q = json!({"where": {"tags": EXP_TAG}, "limit": 20});
    loop {
        let (status, doc) = shared
            .send(shared.http.post(format!("{}/v1/query", shared.reader)).json(&q))
            .await
            .expect("query");
        assert_eq!(status, 200, "query {q}: {doc}");
        for item in doc["items"].as_array().expect("items") {
            queried.insert(item["id"].as_str().unwrap_or("?").to_string());
        }
        match doc["next_page_token"].as_str() {
            Some(t) => q["page_token"] = json!(t),
            None => break,
        }
    }
    let want: BTreeSet<String> = fin.visible.keys().cloned().collect();
    if queried != want {
        shared.fail(format!(
            "at the end, the query on tag {EXP_TAG:?} returned {:?} beyond the visible entities and missed {:?}",
            queried.difference(&want).collect::<Vec<_>>(),
            want.difference(&queried).collect::<Vec<_>>()
        ));
    }
    // The rows: expired entities deleted by one more version, or purged.
    let floors = version_floors(env).await;
    let all: Vec<&String> = fin.expired.keys().chain(fin.visible.keys()).collect();
    let rows = entity_rows(env, &all).await;
    for (id, (v, _)) in &fin.expired {
        match rows.get(id).map(Vec::as_slice) {
            None | Some([]) => {
                let floor = floors.get(&logical_of_hex(id)).copied().unwrap_or(0);
                if floor < v + 1 {
                    shared.fail(format!(
                        "expired entity {id} (last written at version {v}) has no row, but its logical shard's floor is {floor}"
                    ));
                }
                sum.purged += 1;
            }
            Some(found) => {
                if found.iter().any(|(dead, w, _)| !dead || *w != v + 1) {
                    shared.fail(format!(
                        "expired entity {id} (last written at version {v}): rows {found:?} (tombstone, version, logical), \
                         not a tombstone at version {}",
                        v + 1
                    ));
                }
                sum.tombstones += 1;
            }
        }
    }
    for (id, (v, _)) in &fin.visible {
        let found = rows.get(id).cloned().unwrap_or_default();
        if found.is_empty() || found.iter().any(|(dead, w, _)| *dead || w != v) {
            shared.fail(format!("visible entity {id}: rows {found:?}, not one live row at version {v}"));
        }
    }
    // No index row names an expired entity.
    for (table, rows) in model::actual_rows(env).await {
        for (shard, key, eid) in rows.iter().filter(|r| fin.expired.contains_key(&r.2)) {
            shared.fail(format!(
                "{table} still has a row of the expired entity {eid}: key {key} on shard {shard}"
            ));
        }
    }
    sum
}

/// Invariant W with the tombstone purge (it replaces
/// `model::check_topic_order` here): per entity, the versions seen on the
/// topic for the first time go up, each exactly one above the one before,
/// except after a delete whose tombstone may have been purged: then (as
/// for an entity's first version) a version up to one above its logical
/// shard's floor (`floors`, read after the load). The store's version
/// (`stored`, tombstones included) is the last of them; an entity without
/// a row (purged) ended in a delete at or under its floor. A redelivery
/// must be the same event. Returns one line per breach.
pub(super) fn check_versions(
    events: &[model::TopicEvent],
    stored: &HashMap<String, u64>,
    floors: &HashMap<u16, u64>,
) -> Vec<String> {
    let (firsts, mut out) = model::first_occurrences(events);
    for (id, versions) in &firsts {
        let floor = floors.get(&logical_of_hex(id)).copied().unwrap_or(0);
        let mut before: Option<(u64, Op)> = None;
        for &(v, op) in versions {
            let fine = match before {
                None => v == 1 || v <= floor + 1,
                Some((p, Op::Delete)) => v == p + 1 || (v > p && v <= floor + 1),
                Some((p, Op::Put)) => v == p + 1,
            };
            if !fine {
                out.push(format!(
                    "entity {id}: version {v} first seen after {before:?} (logical shard floor {floor}); versions in topic order: {:?}",
                    versions.iter().map(|(v, _)| *v).collect::<Vec<_>>()
                ));
                break;
            }
            before = Some((v, op));
        }
        let (last, last_op) = *versions.last().expect("at least one");
        match stored.get(id) {
            Some(s) if *s == last => {}
            Some(s) => out.push(format!("entity {id}: the store is at version {s} but the topic's last is {last}")),
            None if last_op == Op::Delete && last <= floor => {}
            None => out.push(format!(
                "entity {id}: no row in the store, but the topic's last event is a {last_op:?} at version {last} \
                 (logical shard floor {floor})"
            )),
        }
    }
    for (id, v) in stored {
        if !firsts.contains_key(id) {
            out.push(format!("entity {id}: the store is at version {v} but the topic has none of it"));
        }
    }
    out
}

/// The newest version of every entity on the topic, with its kind.
pub(super) fn newest_on_topic(events: &[model::TopicEvent]) -> HashMap<String, (u64, Op)> {
    let mut out: HashMap<String, (u64, Op)> = HashMap::new();
    for e in events {
        let n = out.entry(e.event.id.to_hex()).or_insert((0, Op::Put));
        if e.event.version >= n.0 {
            *n = (e.event.version, e.event.op);
        }
    }
    out
}
