//! What each item of a transaction does, decided in memory: pure, the
//! database work is the caller's ([`super::transaction`]). Items are
//! decided in their order against the rows as locked, each seeing what the
//! ones before it made of its entity, so an id written twice in one
//! transaction sees its first write, and a failed precondition skips only
//! its own item.

use schemas::codec;
use schemas::event::{ChangeEvent, Op};
use schemas::expiry;
use schemas::value::BagJson;
use schemas::{Bag, EntityId};
use std::collections::HashMap;

use super::keys::KeyEffects;
use super::refusal::Refusal;
use super::{Change, Guard, Item, Outcome, Precondition, Rules, WriteError};
use crate::entities::EntityRecord;
use crate::idempotency::Record;

/// What the transaction's locking reads found: what its items are decided
/// against.
#[derive(Debug)]
pub(super) struct Found {
    /// Per logical shard written: its version floor (read by the proof of
    /// ownership).
    pub floors: HashMap<u16, u64>,
    /// The rows present when locked, decoded.
    pub rows: HashMap<EntityId, Staged>,
    /// The records of the items' idempotency keys, locked.
    pub records: HashMap<[u8; 16], Record>,
}

/// Every item of a transaction, decided.
#[derive(Debug, Default)]
pub(super) struct Decided {
    /// Each item's answer, in item order.
    pub results: Vec<Result<Outcome, WriteError>>,
    /// The kind of each write (see [`super::Committed::kinds`]).
    pub kinds: Vec<&'static str>,
    /// The change events, in item order (the order of `seq`).
    pub events: Vec<ChangeEvent>,
    /// The ids written, each once.
    pub written: Vec<EntityId>,
    /// Each written entity as the last item left it.
    pub rows: HashMap<EntityId, Staged>,
    /// Idempotency records to write: `(key hash, logical shard, record)`.
    pub records: Vec<([u8; 16], u16, Record)>,
}

/// Decides `items` in order (`logicals[i]` is item i's logical shard) at
/// commit time `now`. A guarded item whose key has a record within the
/// window gets that record's answer and writes nothing; any other guarded
/// item's answer (an outcome, or a refusal) is recorded under its key, so
/// a later item of the same key in this transaction replays it too.
pub(super) fn decide_items(
    shard: usize,
    items: &[Item],
    logicals: &[u16],
    found: Found,
    now: i64,
    rules: &Rules,
    mut keys: Option<&mut KeyEffects<'_>>,
) -> Decided {
    let Found { floors, mut rows, mut records } = found;
    let limits = Limits { max_bytes: rules.max_bytes, expiry: rules.expiry.as_deref() };
    let mut d = Decided::default();
    for (item, &logical) in items.iter().zip(logicals) {
        let guard = item.pre.guard;
        let first = guard.and_then(|g| replay(records.get(&g.key), g, now, rules.idempotency_window_us));
        if let Some(answer) = first {
            // A retry: the first answer, nothing written.
            d.results.push(answer);
            continue;
        }
        // An id with no row starts above its logical shard's floor (the
        // versions of purged tombstones).
        let floor = floors.get(&logical).copied().unwrap_or(0);
        let current = rows.get(&item.id);
        let mut decided = decide(shard, &item.id, current, floor, &item.change, item.pre, now, limits);
        // Unique keys after the preconditions: a write that fails both is
        // refused for its precondition.
        if let (Ok((row, _, _)), Some(keys)) = (&decided, keys.as_deref_mut()) {
            let before = current.filter(|c| c.live).and_then(|c| c.bag.as_ref());
            if let Err(e) = keys.check(item.id, before, row.bag.as_ref()) {
                decided = Err(e);
            }
        }
        let record = match (&decided, guard) {
            (_, None) => None,
            (Ok((_, _, o)), Some(g)) => Some((g, record(g, o.id, o.version, o.created, None, now))),
            (Err(e), Some(g)) => Refusal::record(e).map(|r| (g, record(g, item.id, 0, false, Some(r), now))),
        };
        if let Some((g, r)) = record {
            records.insert(g.key, r.clone());
            d.records.push((g.key, logical, r));
        }
        match decided {
            Ok((row, event, outcome)) => {
                d.kinds.push(item.change.kind());
                d.events.push(event);
                if !d.written.contains(&item.id) {
                    d.written.push(item.id);
                }
                rows.insert(item.id, row);
                d.results.push(Ok(outcome));
            }
            Err(e) => d.results.push(Err(e)),
        }
    }
    d.rows = rows;
    d
}

/// The answer a guarded write gets without being decided: the first
/// answer under its key when the key's record is within the window (a
/// refusal when that was for another request); None when it is to be
/// decided (no record, an expired one, or one this version cannot read).
fn replay(first: Option<&Record>, g: Guard, now: i64, window_us: i64) -> Option<Result<Outcome, WriteError>> {
    let r = first.filter(|r| r.recorded_us.saturating_add(window_us) > now)?;
    match (r.request_hash == g.request, r.refusal.as_deref()) {
        (false, _) => Some(Err(WriteError::KeyReused)),
        (true, None) => {
            Some(Ok(Outcome { id: r.entity_id, version: r.version, created: r.created, replayed: true }))
        }
        (true, Some(refusal)) => Refusal::replay(refusal).map(Err),
    }
}

/// The record of a guarded write's answer.
fn record(g: Guard, id: EntityId, version: u64, created: bool, refusal: Option<String>, now: i64) -> Record {
    Record { request_hash: g.request, entity_id: id, version, created, refusal, recorded_us: now }
}

/// An entity as the transaction sees it: what is stored (decoded), then
/// what earlier items of the same transaction made of it.
#[derive(Debug, Clone)]
pub(super) struct Staged {
    pub version: u64,
    /// `None` for a tombstone (or a body that could not be decoded).
    pub bag: Option<Bag>,
    /// Visible: a body that is not expired.
    pub live: bool,
    /// The row's expiry (see `schemas::expiry`).
    pub expires_us: Option<i64>,
}

impl Staged {
    pub(super) fn stored(
        shard: usize,
        id: &EntityId,
        c: EntityRecord,
        expiry: Option<&str>,
        now: i64,
    ) -> Staged {
        let has_body = c.body.is_some();
        let bag = c.body.as_deref().and_then(|blob| match codec::decode_body(blob) {
            Ok(bag) => Some(bag),
            Err(e) => {
                // The write goes on (it replaces the broken body); the old index
                // rows cannot be derived, so the cleaner removes them later.
                tracing::error!(%id, shard, error = %e, "stored body is corrupt; overwriting it");
                None
            }
        });
        // An expired entity is absent to writes as to reads.
        let live = has_body && !bag.as_ref().is_some_and(|b| expiry::bag_is_expired(b, expiry, now));
        Staged { version: c.version, bag, live, expires_us: c.expires_us }
    }
}

/// What a write may produce.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits<'a> {
    /// The JSON size of a patched entity.
    pub max_bytes: usize,
    /// `expiry.property`.
    pub expiry: Option<&'a str>,
}

/// One item's effect: the row after it, its change event, its answer; or
/// why it does nothing. Pure: the database work is the caller's. `floor`
/// is the version floor of the id's logical shard: an id with no row
/// starts above it.
#[allow(clippy::too_many_arguments)]
pub(super) fn decide(
    shard: usize,
    id: &EntityId,
    current: Option<&Staged>,
    floor: u64,
    change: &Change,
    pre: Precondition,
    now: i64,
    limits: Limits<'_>,
) -> Result<(Staged, ChangeEvent, Outcome), WriteError> {
    if matches!(change, Change::Expire) && !current.is_some_and(|c| c.bag.is_some() && !c.live) {
        return Err(WriteError::NotExpired);
    }
    let live_version = current.filter(|c| c.live).map(|c| c.version);
    if let Some(expected) = pre.if_version {
        if live_version != Some(expected) {
            return Err(WriteError::VersionConflict { expected, actual: live_version });
        }
    }
    if pre.if_absent {
        if let Some(current) = live_version {
            return Err(WriteError::AlreadyExists { current });
        }
    }
    if pre.if_exists && live_version.is_none() {
        return Err(WriteError::NotFound);
    }
    let must_exist = match change {
        Change::Delete => true,
        Change::Patch { upsert, .. } => !upsert,
        Change::Put(_) | Change::Expire => false,
    };
    if must_exist && live_version.is_none() {
        return Err(WriteError::NotFound);
    }
    // Tombstones keep their version, so a re-created entity continues from
    // it; a purged one's is under the floor.
    let version = current.map_or(floor, |c| c.version) + 1;
    // What the row holds, expired or not: the indexes remove its rows.
    let before = current.and_then(|c| c.bag.clone());
    let visible = current.filter(|c| c.live).and_then(|c| c.bag.as_ref());
    let (op, after) = match change {
        Change::Put(bag) => (Op::Put, Some(bag.clone())),
        Change::Delete | Change::Expire => (Op::Delete, None),
        Change::Patch { patch, .. } => {
            let bag = patch.apply(visible)?;
            let bytes = serde_json::to_vec(&BagJson(&bag)).map_or(usize::MAX, |b| b.len());
            if bytes > limits.max_bytes {
                return Err(WriteError::TooLarge { bytes, max: limits.max_bytes });
            }
            (Op::Put, Some(bag))
        }
    };
    let expires_us = match &after {
        Some(bag) => expiry::expires_us(bag, limits.expiry)?,
        None => None,
    };
    let row = Staged { version, bag: after.clone(), live: after.is_some(), expires_us };
    // The row's location is filled in once it is known (after the insert).
    let event = ChangeEvent {
        id: *id,
        version,
        op,
        committed_at_us: now,
        shard: shard as u32,
        before,
        after,
        added_id: None,
    };
    Ok((row, event, Outcome { id: *id, version, created: live_version.is_none(), replayed: false }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use schemas::value::Value;

    const LIMITS: Limits<'static> = Limits { max_bytes: 1 << 20, expiry: Some("expires_at") };

    fn stored(version: u64, bag: Option<Bag>, now: i64) -> Staged {
        let c = EntityRecord {
            id: EntityId([1; 16]),
            logical: 0,
            added_id: 1,
            version,
            updated_us: 0,
            body: bag.as_ref().map(codec::encode_body),
            expires_us: None,
        };
        Staged::stored(0, &EntityId([1; 16]), c, LIMITS.expiry, now)
    }

    fn bag(pairs: &[(&str, Value)]) -> Bag {
        pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
    }

    fn run(
        current: Option<&Staged>,
        floor: u64,
        change: Change,
        pre: Precondition,
        now: i64,
    ) -> Result<Outcome, WriteError> {
        decide(0, &EntityId([1; 16]), current, floor, &change, pre, now, LIMITS).map(|(_, _, o)| o)
    }

    #[test]
    fn an_id_without_a_row_starts_above_the_floor_and_a_live_one_goes_up_by_one() {
        let put = || Change::Put(bag(&[("a", Value::Int(1))]));
        assert_eq!(run(None, 0, put(), Precondition::default(), 0).unwrap().version, 1);
        assert_eq!(run(None, 41, put(), Precondition::default(), 0).unwrap().version, 42);
        // A row (live or tombstone) continues from its own version, whatever the floor.
        let live = stored(7, Some(bag(&[])), 0);
        assert_eq!(run(Some(&live), 41, put(), Precondition::default(), 0).unwrap().version, 8);
        let tomb = stored(7, None, 0);
        assert_eq!(run(Some(&tomb), 41, put(), Precondition::default(), 0).unwrap().version, 8);
    }

    #[test]
    fn an_expired_entity_is_absent_to_writes_and_its_expiry_deletes_it() {
        let old = bag(&[("expires_at", Value::Int(100)), ("a", Value::Int(1))]);
        let now = 100_000_000; // the expiry second itself
        let expired = stored(3, Some(old.clone()), now);
        let create = Precondition { if_absent: true, ..Precondition::default() };
        let o = run(Some(&expired), 0, Change::Put(bag(&[])), create, now).unwrap();
        assert_eq!((o.version, o.created), (4, true));
        assert!(matches!(
            run(Some(&expired), 0, Change::Delete, Precondition::default(), now),
            Err(WriteError::NotFound)
        ));
        // The expiry's delete carries the stored bag as `before`, so the
        // indexes remove its rows.
        let (row, event, _) = decide(
            0,
            &EntityId([1; 16]),
            Some(&expired),
            0,
            &Change::Expire,
            Precondition::default(),
            now,
            LIMITS,
        )
        .unwrap();
        assert_eq!((row.live, event.op, event.before.as_ref()), (false, Op::Delete, Some(&old)));
        // A second before, nothing expires.
        let fresh = stored(3, Some(old), now - 1);
        assert!(matches!(
            run(Some(&fresh), 0, Change::Expire, Precondition::default(), now - 1),
            Err(WriteError::NotExpired)
        ));
        // A malformed expiry is refused, naming the property.
        let bad = Change::Put(bag(&[("expires_at", Value::String("soon".into()))]));
        match run(None, 0, bad, Precondition::default(), now) {
            Err(WriteError::BadExpiry(e)) => assert_eq!(e.property, "expires_at"),
            other => panic!("{other:?}"),
        }
    }

    fn put(n: i64, pre: Precondition) -> Item {
        Item { id: EntityId([1; 16]), change: Change::Put(bag(&[("n", Value::Int(n))])), pre }
    }

    fn answers(d: &Decided) -> Vec<Result<(u64, bool), String>> {
        d.results
            .iter()
            .map(|r| r.as_ref().map(|o| (o.version, o.replayed)).map_err(|e| e.to_string()))
            .collect()
    }

    #[test]
    fn items_are_decided_in_order_and_a_guarded_retry_gets_the_first_answer() {
        let rules = Rules {
            max_bytes: 1 << 20,
            expiry: None,
            idempotency_window_us: 1_000,
            unique_reservation_us: 1_000,
            drill_exit_after_reserve: false,
        };
        let found =
            || Found { floors: HashMap::from([(0, 10)]), rows: HashMap::new(), records: HashMap::new() };
        let g = Guard { key: [7; 16], request: [1; 16] };
        let guarded = Precondition { guard: Some(g), ..Precondition::default() };
        let refused = Guard { key: [8; 16], request: [1; 16] };
        let conflict = Precondition { if_version: Some(99), guard: Some(refused), ..Precondition::default() };
        // The second write of the id sees the first; a failed precondition
        // skips only its item; the key again replays its first answer.
        let items = [put(1, guarded), put(2, Precondition::default()), put(3, conflict), put(1, guarded)];
        let d = decide_items(0, &items, &[0; 4], found(), 500, &rules, None);
        let conflict_text = "expected version 99, but the entity is at 12".to_string();
        assert_eq!(
            answers(&d),
            [Ok((11, false)), Ok((12, false)), Err(conflict_text.clone()), Ok((11, true))]
        );
        assert_eq!(
            (d.kinds.as_slice(), d.written.as_slice()),
            (&["put", "put"][..], &[EntityId([1; 16])][..])
        );
        assert_eq!((d.events.len(), d.rows[&EntityId([1; 16])].version), (2, 12));
        let keys: Vec<[u8; 16]> = d.records.iter().map(|(k, _, _)| *k).collect();
        assert_eq!(keys, [g.key, refused.key], "the write and the refusal are recorded, the replay is not");

        // A later transaction: within the window, the first answers, the
        // refusal too; another request under the key is refused; past the
        // window the write is decided again.
        let mut later = found();
        later.records.extend(d.records.iter().map(|(k, _, r)| (*k, r.clone())));
        let other = Precondition { guard: Some(Guard { request: [2; 16], ..g }), ..Precondition::default() };
        let again = [put(5, guarded), put(5, conflict), put(5, other)];
        let d2 = decide_items(0, &again, &[0; 3], later, 1_499, &rules, None);
        let reused = WriteError::KeyReused.to_string();
        assert_eq!(answers(&d2), [Ok((11, true)), Err(conflict_text), Err(reused)]);
        assert!(d2.events.is_empty() && d2.records.is_empty());
        let mut later = found();
        later.records.extend(d.records.iter().map(|(k, _, r)| (*k, r.clone())));
        let d3 = decide_items(0, &again[..1], &[0], later, 1_500, &rules, None);
        assert_eq!(answers(&d3), [Ok((11, false))], "past the window, decided again");
        assert_eq!(d3.records.len(), 1);
    }
}
