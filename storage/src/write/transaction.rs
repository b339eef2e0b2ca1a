//! The write transaction on one shard, and its retries.
//!
//! At most five statements whatever the number of items: one locking read
//! of every id, then the decisions in memory (`super::decide`), one
//! multi-row write of the rows that existed and one insert of the new ones
//! (a concurrent creator of the same id makes it fail, and the whole
//! transaction is retried), one multi-row outbox insert, commit (up to 500
//! rows per statement). Events carry where each entity's row is (see
//! `entities::insert_entities`: on a server that does not number a
//! multi-row insert consecutively, one more statement reads the new rows'
//! keys back). An item whose precondition fails is skipped (its error is
//! its result); a database error rolls back everything and is returned as
//! the outer error.

use schemas::clock::now_micros;
use schemas::codec;
use schemas::EntityId;
use sqlx::{Connection, MySqlConnection};
use std::collections::{HashMap, HashSet};

use super::decide::{decide_items, Decided, Found, Staged};
use super::keys::{KeyEffects, Keys, Settled, Wanted};
use super::{Committed, Item, WriteContext};
use crate::entities::{self, EntityRecord, EntityWrite};
use crate::idempotency::Record;
use crate::outbox::{self, OutboxInsert};
use crate::{idempotency, topology, unique, OnShard, StoreError};

/// How many times a transaction rolled back by a deadlock is run again.
const CONFLICT_RETRIES: usize = 8;

/// Runs `items` in one transaction on `shard`, on one of the shard's
/// ping-free connections, run again after a deadlock or a lost race to
/// create an id. Items are decided in their order (see `super::decide`).
/// With unique indexes, it runs as tries that reserve their keys (see
/// `super::keys`). The caller wakes whoever publishes the shard's outbox.
pub async fn commit(ctx: &WriteContext, shard: usize, items: &[Item]) -> Result<Committed, StoreError> {
    let specs = ctx.unique().get(ctx.shards()).await?;
    if !specs.is_empty() {
        return super::keys::commit(ctx, shard, items, specs).await;
    }
    match attempt(ctx, shard, items, None).await? {
        Tried::Done(committed, _) => Ok(committed),
        // Without unique indexes a try wants no key.
        Tried::NeedKeys(_) | Tried::Revoked => unreachable!("no unique index, no key"),
    }
}

/// How one try of a transaction ended.
#[derive(Debug)]
pub(super) enum Tried {
    /// It committed (with what its unique keys leave to settle).
    Done(Committed, Option<Settled>),
    /// Rolled back: its writes need these keys reserved first.
    NeedKeys(Vec<Wanted>),
    /// Rolled back: a reservation of its token was taken over.
    Revoked,
}

/// One try of `items` (see [`commit`]), with the keys reserved so far.
pub(super) async fn attempt(
    ctx: &WriteContext,
    shard: usize,
    items: &[Item],
    keys: Option<&Keys>,
) -> Result<Tried, StoreError> {
    ctx.acks().check(shard)?;
    let conns = ctx.shards().conns(shard);
    let mut taken = conns.take().await?;
    let mut attempt = 0;
    loop {
        let result = match taken.conn.begin().await.on(shard) {
            Ok(tx) => transaction(ctx, shard, tx, items, keys).await.map_err(|e| (e, true)),
            Err(e) => Err((e, false)),
        };
        match result {
            Ok(r) => {
                conns.give_back(taken);
                return Ok(r);
            }
            // A reused connection found dead at BEGIN carried nothing of
            // this write: the write goes on a new connection.
            Err((e, false)) if e.is_dead_connection() && taken.reused => {
                drop(taken);
                taken = conns.take_new().await?;
            }
            // Dropped, not given back; whether a COMMIT that died on the
            // way took effect is unknown, so the write is not run again.
            Err((e, _)) if e.is_dead_connection() => return Err(e),
            Err((e, _)) if e.is_retryable_conflict() && attempt < CONFLICT_RETRIES => attempt += 1,
            Err((e, _)) => {
                // The dropped transaction's ROLLBACK is only queued: sent
                // now, so an idle connection holds no locks (a metadata
                // lock kept would stall the next DDL on its tables, a
                // move's journal triggers among them).
                if taken.conn.ping().await.is_ok() {
                    conns.give_back(taken);
                }
                return Err(e);
            }
        }
    }
}

/// One try: lock, decide, write, commit.
async fn transaction(
    ctx: &WriteContext,
    shard: usize,
    mut tx: sqlx::Transaction<'_, sqlx::MySql>,
    items: &[Item],
    keys: Option<&Keys>,
) -> Result<Tried, StoreError> {
    let logicals: Vec<u16> = items.iter().map(|item| ctx.shards().logical_of_id(&item.id)).collect();
    let locked = lock(shard, &mut tx, items, &logicals).await?;
    // Expired records found here are replaced; other keys are inserted,
    // and a concurrent insert of the same key fails (1062, run again).
    let expired: HashSet<[u8; 16]> = locked.records.keys().copied().collect();
    let now = now_micros();
    let expiry = ctx.rules().expiry.as_deref();
    // Where each entity's row is (its clustered key): the existing ones
    // now, the new ones once inserted. Events carry it for the indexes.
    let located: HashMap<EntityId, u64> = locked.rows.iter().map(|(id, c)| (*id, c.added_id)).collect();
    let rows =
        locked.rows.into_iter().map(|(id, c)| (id, Staged::stored(shard, &id, c, expiry, now))).collect();
    let found = Found { floors: locked.floors, rows, records: locked.records };
    let mut effects = keys.map(|k| KeyEffects::new(k, &found.rows));
    let mut decided = decide_items(shard, items, &logicals, found, now, ctx.rules(), effects.as_mut());
    let mut settled = None;
    if let (Some(fx), Some(keys)) = (effects, keys) {
        match unique_step(shard, &mut tx, fx, keys, &decided, now).await? {
            Ok(s) => settled = Some(s),
            Err(back) => {
                tx.rollback().await.on(shard)?;
                return Ok(back);
            }
        }
    }
    let logical_of: HashMap<EntityId, u16> = items.iter().map(|item| item.id).zip(logicals).collect();
    if !decided.events.is_empty() {
        write_rows(ctx, shard, &mut tx, &mut decided, &logical_of, located, now).await?;
    }
    // Also when nothing was written: a guarded refusal is recorded.
    if !decided.records.is_empty() {
        let (replaced, inserted): (Vec<_>, Vec<_>) =
            decided.records.iter().cloned().partition(|(key, _, _)| expired.contains(key));
        idempotency::put_records(shard, &mut tx, &replaced).await?;
        idempotency::insert_records(shard, &mut tx, &inserted).await?;
    }
    tx.commit().await.map_err(|source| StoreError::Shard { shard, source })?;
    let committed =
        Committed { results: decided.results, kinds: decided.kinds, recorded: !decided.records.is_empty() };
    Ok(Tried::Done(committed, settled))
}

/// The unique keys of a decided try: sent back when a key is still to be
/// reserved or the token was revoked, else the token claimed (when any
/// key is newly given) and what to settle after the commit.
async fn unique_step(
    shard: usize,
    tx: &mut MySqlConnection,
    mut fx: KeyEffects<'_>,
    keys: &Keys,
    decided: &Decided,
    now: i64,
) -> Result<Result<Settled, Tried>, StoreError> {
    if !fx.missing.is_empty() {
        return Ok(Err(Tried::NeedKeys(std::mem::take(&mut fx.missing))));
    }
    let claimed = !fx.acquired.is_empty();
    if claimed && (now_micros() >= keys.until_us || !unique::claim(shard, tx, &keys.token, now).await?) {
        return Ok(Err(Tried::Revoked));
    }
    fx.finish(&decided.rows);
    Ok(Ok(Settled { settle: fx.settle, freed: fx.freed }))
}

/// What the locking reads found, as stored.
#[derive(Debug)]
struct Locked {
    /// Per logical shard written: its version floor.
    floors: HashMap<u16, u64>,
    /// The rows present.
    rows: HashMap<EntityId, EntityRecord>,
    /// The records of the items' idempotency keys.
    records: HashMap<[u8; 16], Record>,
}

/// The locking reads: the proof of ownership, the rows, the keys' records.
async fn lock(
    shard: usize,
    tx: &mut MySqlConnection,
    items: &[Item],
    logicals: &[u16],
) -> Result<Locked, StoreError> {
    let ids: Vec<EntityId> = items.iter().map(|item| item.id).collect();
    // First the proof that this shard owns every logical shard written
    // (a cutover cannot take them until this transaction ends).
    let floors = topology::check_owned(shard, &mut *tx, logicals).await?;
    let rows = entities::lock_entities(shard, &mut *tx, &ids).await?;
    // Keyed writes: their records, read after the rows they guard are
    // locked. Under READ COMMITTED a locking read of an absent key
    // locks nothing, so two tries of one key could both find none; the
    // entity's row lock orders them, and the second then finds the
    // first's record. (Two tries creating one new id: the second's
    // insert fails on the unique key and is run again.)
    let keys: Vec<[u8; 16]> = items.iter().filter_map(|item| item.pre.guard.map(|g| g.key)).collect();
    let records = if keys.is_empty() {
        HashMap::new()
    } else {
        idempotency::lock_records(shard, &mut *tx, &keys).await?
    };
    Ok(Locked { floors, rows, records })
}

/// Writes the entity rows and the outbox rows (taking its events) of what
/// `decided` wrote.
/// `located` has where each present row is; a new row's location is
/// learnt from its insert, and every event carries its entity's.
async fn write_rows(
    ctx: &WriteContext,
    shard: usize,
    tx: &mut MySqlConnection,
    decided: &mut Decided,
    logical_of: &HashMap<EntityId, u16>,
    mut located: HashMap<EntityId, u64>,
    now: i64,
) -> Result<(), StoreError> {
    // Rows are written in id order, so two transactions creating the
    // same new ids cannot wait on each other in opposite orders.
    let mut written = decided.written.clone();
    written.sort_unstable();
    let (present, absent): (Vec<_>, Vec<_>) = written
        .iter()
        .map(|id| {
            let r = &decided.rows[id];
            EntityWrite {
                id: *id,
                logical: logical_of[id],
                version: r.version,
                updated_us: now,
                body: r.bag.as_ref().map(codec::encode_body),
                expires_us: r.expires_us,
            }
        })
        .partition(|w| located.contains_key(&w.id));
    if !present.is_empty() {
        entities::update_entities(shard, &mut *tx, &present).await?;
    }
    if !absent.is_empty() {
        let consecutive = match absent.len() {
            1 => true, // one row: LAST_INSERT_ID() is its own
            _ => {
                *ctx.consecutive[shard]
                    .get_or_try_init(|| entities::autoinc_is_consecutive(shard, &mut *tx))
                    .await?
            }
        };
        let added = entities::insert_entities(shard, &mut *tx, &absent, consecutive).await?;
        for (w, at) in absent.iter().zip(added) {
            if let Some(at) = at {
                located.insert(w.id, at);
            }
        }
    }
    let events: Vec<_> = std::mem::take(&mut decided.events)
        .into_iter()
        .map(|mut e| {
            e.added_id = located.get(&e.id).copied();
            OutboxInsert { entity_id: e.id, version: e.version, committed_us: now, event: e.encode() }
        })
        .collect();
    outbox::insert_outbox_rows(shard, &mut *tx, &events).await
}
