//! The write transaction. One InnoDB transaction on the entity's shard:
//! lock the row, check the precondition, write version+1, insert the change
//! event into the outbox, commit. Nothing reaches the database for a write
//! that fails validation or its precondition, except, for a guarded write
//! (an idempotency key), the record of that refusal, so a retry gets it.

use schemas::clock::now_micros;
use schemas::codec;
use schemas::event::{ChangeEvent, Op};
use schemas::expiry::{self, BadExpiry};
use schemas::patch::{Patch, PatchClash};
use schemas::value::BagJson;
use schemas::{Bag, EntityId};
use sqlx::Connection;
use std::collections::HashMap;
use std::sync::Arc;
use storage::entities::{self, EntityRecord, EntityWrite};
use storage::idempotency;
use storage::outbox::{self, OutboxInsert};
use storage::{topology, OnShard, StoreError};

use crate::Writer;

/// How many times a transaction rolled back by a deadlock is run again.
const CONFLICT_RETRIES: usize = 8;

/// Optional conditions on the current version (`If-Match`, `If-None-Match: *`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Precondition {
    pub if_version: Option<u64>,
    pub if_absent: bool,
    /// `If-Match: *`: the entity must exist (any version).
    pub if_exists: bool,
    /// `Idempotency-Key`: a retry within the window gets the first answer.
    pub guard: Option<Guard>,
}

/// An `Idempotency-Key` on a write: its hash and the request's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Guard {
    pub key: [u8; 16],
    pub request: [u8; 16],
}

/// A committed write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    pub id: EntityId,
    pub version: u64,
    /// No live entity had this id before.
    pub created: bool,
    /// A retry under an idempotency key: the first answer, nothing written.
    pub replayed: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("expected version {expected}, but the entity is at {}", actual.map_or("(absent)".to_string(), |v| v.to_string()))]
    VersionConflict { expected: u64, actual: Option<u64> },
    #[error("the entity already exists at version {current}")]
    AlreadyExists { current: u64 },
    #[error("no entity with this id")]
    NotFound,
    /// A patch that cannot apply to what is stored (nothing is written).
    #[error(transparent)]
    PatchClash(#[from] PatchClash),
    /// The `Idempotency-Key` was used within the window for another request.
    #[error("this Idempotency-Key was used for a different request")]
    KeyReused,
    /// A patch whose result would be larger than an entity may be.
    #[error("the patched entity would take {bytes} bytes of JSON, over the {max} byte limit")]
    TooLarge { bytes: usize, max: usize },
    /// The entity's expiry property is not a number of Unix seconds.
    #[error(transparent)]
    BadExpiry(#[from] BadExpiry),
    /// An expiry (the cleaner's delete) found the entity not expired:
    /// rewritten since it was found, or already deleted.
    #[error("the entity is not expired")]
    NotExpired,
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The transaction this item shared with others (a batch, or a group
    /// commit) failed on its shard; the error is shared by those items.
    #[error("the shared transaction on shard {shard} failed")]
    ShardFailed {
        shard: usize,
        #[source]
        source: std::sync::Arc<StoreError>,
    },
}

/// A refusal as a guarded write records it: a retry under the same key is
/// refused the same way, whatever the entity became meanwhile (a Kafka
/// ingest command redelivered after a crash must not apply where it was
/// refused, nor answer differently).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
enum Refusal {
    VersionConflict { expected: u64, actual: Option<u64> },
    AlreadyExists { current: u64 },
    NotFound,
    PatchClash { property: String, reason: String },
    TooLarge { bytes: usize, max: usize },
    BadExpiry { property: String, found: String },
}

impl Refusal {
    /// The record of `e`; None for what is not a refusal of this write
    /// (storage failures, a reused key, an expiry's "not expired").
    fn record(e: &WriteError) -> Option<String> {
        let r = match e {
            WriteError::VersionConflict { expected, actual } => {
                Refusal::VersionConflict { expected: *expected, actual: *actual }
            }
            WriteError::AlreadyExists { current } => Refusal::AlreadyExists { current: *current },
            WriteError::NotFound => Refusal::NotFound,
            WriteError::PatchClash(c) => {
                Refusal::PatchClash { property: c.property.clone(), reason: c.reason.clone() }
            }
            WriteError::TooLarge { bytes, max } => Refusal::TooLarge { bytes: *bytes, max: *max },
            WriteError::BadExpiry(b) => {
                Refusal::BadExpiry { property: b.property.clone(), found: b.found.clone() }
            }
            _ => return None,
        };
        serde_json::to_string(&r).ok()
    }

    /// The refusal a record holds (None if it does not parse: then the
    /// write is decided again).
    fn replay(recorded: &str) -> Option<WriteError> {
        Some(match serde_json::from_str(recorded).ok()? {
            Refusal::VersionConflict { expected, actual } => WriteError::VersionConflict { expected, actual },
            Refusal::AlreadyExists { current } => WriteError::AlreadyExists { current },
            Refusal::NotFound => WriteError::NotFound,
            Refusal::PatchClash { property, reason } => {
                WriteError::PatchClash(PatchClash { property, reason })
            }
            Refusal::TooLarge { bytes, max } => WriteError::TooLarge { bytes, max },
            Refusal::BadExpiry { property, found } => WriteError::BadExpiry(BadExpiry { property, found }),
        })
    }
}

impl WriteError {
    /// The shard the write went to did not own it (the map was stale): the
    /// write may go again to the owner the reloaded map names.
    pub fn is_stale_map(&self) -> bool {
        match self {
            WriteError::Store(e) => e.is_stale_map(),
            WriteError::ShardFailed { source, .. } => source.is_stale_map(),
            _ => false,
        }
    }
}

/// What one write does to the entity.
#[derive(Debug, Clone)]
pub enum Change {
    Put(Bag),
    Delete,
    /// Applied to the row as locked; `upsert` creates a missing entity
    /// from an empty bag (otherwise a missing one is not found).
    Patch {
        patch: Arc<Patch>,
        upsert: bool,
    },
    /// The cleaner's delete of an expired entity: a delete if the entity
    /// as locked is expired, else nothing ([`WriteError::NotExpired`]).
    Expire,
}

impl Change {
    /// The `kind` label of the writes counter.
    fn kind(&self) -> &'static str {
        match self {
            Change::Put(_) => "put",
            Change::Delete => "delete",
            Change::Patch { .. } => "patch",
            Change::Expire => "expire",
        }
    }
}

impl Writer {
    pub async fn put(&self, id: EntityId, bag: Bag, pre: Precondition) -> Result<Outcome, WriteError> {
        self.write_one(id, Change::Put(bag), pre).await
    }

    pub async fn delete(&self, id: EntityId, pre: Precondition) -> Result<Outcome, WriteError> {
        self.write_one(id, Change::Delete, pre).await
    }

    /// Applies `patch` to the entity inside the write transaction (the
    /// same group commit as a put), so concurrent patches never lose each
    /// other's changes.
    pub async fn patch(
        &self,
        id: EntityId,
        patch: Patch,
        upsert: bool,
        pre: Precondition,
    ) -> Result<Outcome, WriteError> {
        self.write_one(id, Change::Patch { patch: Arc::new(patch), upsert }, pre).await
    }

    /// Deletes the entity if it is expired when its row is locked (the
    /// cleaner's expiry: a delete event like any other, so indexes and
    /// every consumer follow).
    pub async fn expire(&self, id: EntityId) -> Result<Outcome, WriteError> {
        self.write_one(id, Change::Expire, Precondition::default()).await
    }

    /// Puts many entities; those on one shard commit in one transaction.
    /// Results come back in input order. Items whose shard turned out not to
    /// own them (a stale map) go again to the new owner.
    pub async fn put_batch(
        &self,
        items: Vec<(EntityId, Bag, Precondition)>,
    ) -> Vec<Result<Outcome, WriteError>> {
        let mut out: Vec<Option<Result<Outcome, WriteError>>> = (0..items.len()).map(|_| None).collect();
        let mut todo: Vec<usize> = (0..items.len()).collect();
        let mut stale = crate::StaleMapRetry::new();
        loop {
            for (i, r) in todo.iter().copied().zip(self.put_batch_once(&items, &todo).await) {
                out[i] = Some(r);
            }
            todo.retain(|&i| out[i].as_ref().is_some_and(|r| matches!(r, Err(e) if e.is_stale_map())));
            if todo.is_empty() || !stale.again(self.shards(), &self.inner.metrics).await {
                break;
            }
        }
        out.into_iter().map(|r| r.expect("every item belongs to one shard")).collect()
    }

    /// Whether a keyed item's key was used within the window for another
    /// request: a keyed batch that would be a 422 is refused whole before
    /// anything is written (its transactions check each key again, locked).
    pub async fn keys_reused(&self, items: &[(EntityId, Bag, Precondition)]) -> Result<bool, StoreError> {
        let mut per_shard: std::collections::BTreeMap<usize, Vec<Guard>> = Default::default();
        for (id, _, pre) in items {
            if let Some(g) = pre.guard {
                per_shard.entry(self.shards().of_id(id)).or_default().push(g);
            }
        }
        let window_us = (self.settings().writer.idempotency_window_secs as i64).saturating_mul(1_000_000);
        let now = now_micros();
        for (shard, guards) in per_shard {
            let keys: Vec<[u8; 16]> = guards.iter().map(|g| g.key).collect();
            let found = idempotency::read_records(shard, self.shards().pool(shard), &keys).await?;
            let reused = guards.iter().any(|g| {
                found.get(&g.key).is_some_and(|r| {
                    r.recorded_us.saturating_add(window_us) > now && r.request_hash != g.request
                })
            });
            if reused {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// One attempt at the items `todo` of `items`; results in `todo`'s order.
    async fn put_batch_once(
        &self,
        items: &[(EntityId, Bag, Precondition)],
        todo: &[usize],
    ) -> Vec<Result<Outcome, WriteError>> {
        let mut per_shard: Vec<Vec<usize>> = vec![Vec::new(); self.shards().slots_len()];
        for &i in todo {
            per_shard[self.shards().of_id(&items[i].0)].push(i);
        }
        // Lock rows in id order in every batch, so two batches touching the
        // same ids cannot deadlock; the sort is stable, so repeated ids keep
        // their order within the batch.
        for idx in &mut per_shard {
            idx.sort_by_key(|&i| items[i].0);
        }
        let done = self
            .shards()
            .each_with(&per_shard, |shard, _, idx| async move {
                let batch: Vec<(EntityId, Change, Precondition)> =
                    idx.iter().map(|&i| (items[i].0, Change::Put(items[i].1.clone()), items[i].2)).collect();
                self.transaction_with_retries(shard, &batch).await
            })
            .await;
        let mut by_item: std::collections::HashMap<usize, Result<Outcome, WriteError>> = HashMap::new();
        for (shard, result) in done {
            by_item.extend(per_shard[shard].iter().copied().zip(per_item(
                shard,
                result,
                per_shard[shard].len(),
            )));
        }
        todo.iter().map(|i| by_item.remove(i).expect("every item belongs to one shard")).collect()
    }

    /// [`Writer::transaction`] on one of the shard's ping-free connections,
    /// run again after a deadlock or a lost race to create an id; a commit
    /// wakes the shard's relay.
    pub(crate) async fn transaction_with_retries(
        &self,
        shard: usize,
        items: &[(EntityId, Change, Precondition)],
    ) -> Result<Vec<Result<Outcome, WriteError>>, StoreError> {
        let conns = self.shards().conns(shard);
        let mut taken = conns.take().await?;
        let mut attempt = 0;
        loop {
            let result = match taken.conn.begin().await.on(shard) {
                Ok(tx) => self.transaction(shard, tx, items).await.map_err(|e| (e, true)),
                Err(e) => Err((e, false)),
            };
            match result {
                Ok(r) => {
                    conns.give_back(taken);
                    self.inner.wake[shard].notify_one();
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
                    conns.give_back(taken);
                    return Err(e);
                }
            }
        }
    }

    /// Runs the items in one transaction on `shard`, in at most five
    /// statements whatever their number: one locking read of every id, then
    /// the decisions in memory (in item order, so an id written twice sees
    /// its first write), one multi-row write of the rows that existed and one
    /// insert of the new ones (a concurrent creator of the same id makes it
    /// fail, and the whole transaction is retried), one multi-row outbox
    /// insert, commit (up to 500 rows per statement). Events carry where
    /// each entity's row is (see `store::insert_entities`: on a server that
    /// does not number a multi-row insert consecutively, one more statement
    /// reads the new rows' keys back). An item whose precondition fails is skipped
    /// (its error is its result); a database error rolls back everything and
    /// is returned as the outer error.
    async fn transaction(
        &self,
        shard: usize,
        mut tx: sqlx::Transaction<'_, sqlx::MySql>,
        items: &[(EntityId, Change, Precondition)],
    ) -> Result<Vec<Result<Outcome, WriteError>>, StoreError> {
        let ids: Vec<EntityId> = items.iter().map(|(id, _, _)| *id).collect();
        // First the proof that this shard owns every logical shard written
        // (a cutover cannot take them until this transaction ends).
        let logicals: Vec<u16> = ids.iter().map(|id| self.shards().logical_of_id(id)).collect();
        let floors = topology::check_owned(shard, &mut tx, &logicals).await?;
        let current = entities::lock_entities(shard, &mut tx, &ids).await?;
        // Keyed writes: their records, read after the rows they guard are
        // locked. Under READ COMMITTED a locking read of an absent key
        // locks nothing, so two tries of one key could both find none; the
        // entity's row lock orders them, and the second then finds the
        // first's record. (Two tries creating one new id: the second's
        // insert fails on the unique key and is run again.)
        let keys: Vec<[u8; 16]> = items.iter().filter_map(|(_, _, p)| p.guard.map(|g| g.key)).collect();
        let mut records = if keys.is_empty() {
            HashMap::new()
        } else {
            idempotency::lock_records(shard, &mut tx, &keys).await?
        };
        // Expired records found here are replaced; other keys are inserted,
        // and a concurrent insert of the same key fails (1062, run again).
        let expired: std::collections::HashSet<[u8; 16]> = records.keys().copied().collect();
        let mut new_records = Vec::new();
        let window_us = (self.settings().writer.idempotency_window_secs as i64).saturating_mul(1_000_000);
        let now = now_micros();
        let expiry = self.settings().expiry.property.as_deref();
        // Where each entity's row is (its clustered key): the existing ones
        // now, the new ones once inserted. Events carry it for the indexes.
        let mut located: HashMap<EntityId, u64> = current.iter().map(|(id, c)| (*id, c.added_id)).collect();
        let mut rows: HashMap<EntityId, Staged> =
            current.into_iter().map(|(id, c)| (id, Staged::stored(shard, &id, c, expiry, now))).collect();
        let locked: std::collections::HashSet<EntityId> = rows.keys().copied().collect();
        let limits = Limits { max_bytes: self.settings().writer.max_body_bytes, expiry };
        let mut results = Vec::with_capacity(items.len());
        let mut kinds = Vec::new();
        let mut events = Vec::new();
        let mut written: Vec<EntityId> = Vec::new();
        for (id, change, pre) in items {
            if let Some(g) = pre.guard {
                let first = records.get(&g.key).filter(|r| r.recorded_us.saturating_add(window_us) > now);
                let replay = first.map(|r| match (r.request_hash == g.request, r.refusal.as_deref()) {
                    (false, _) => Some(Err(WriteError::KeyReused)),
                    (true, None) => Some(Ok(Outcome {
                        id: r.entity_id,
                        version: r.version,
                        created: r.created,
                        replayed: true,
                    })),
                    (true, Some(refusal)) => Refusal::replay(refusal).map(Err),
                });
                if let Some(Some(answer)) = replay {
                    // A retry: the first answer, nothing written.
                    results.push(answer);
                    continue;
                }
            }
            // An id with no row starts above its logical shard's floor (the
            // versions of purged tombstones).
            let floor = floors.get(&self.shards().logical_of_id(id)).copied().unwrap_or(0);
            match decide(shard, id, rows.get(id), floor, change, *pre, now, limits) {
                Ok((row, event, outcome)) => {
                    if let Some(g) = pre.guard {
                        let r = idempotency::Record {
                            request_hash: g.request,
                            entity_id: outcome.id,
                            version: outcome.version,
                            created: outcome.created,
                            refusal: None,
                            recorded_us: now,
                        };
                        records.insert(g.key, r.clone());
                        new_records.push((g.key, self.shards().logical_of_id(id), r));
                    }
                    kinds.push(change.kind());
                    events.push(event);
                    if !written.contains(id) {
                        written.push(*id);
                    }
                    rows.insert(*id, row);
                    results.push(Ok(outcome));
                }
                Err(e) => {
                    if let (Some(g), Some(refusal)) = (pre.guard, Refusal::record(&e)) {
                        let r = idempotency::Record {
                            request_hash: g.request,
                            entity_id: *id,
                            version: 0,
                            created: false,
                            refusal: Some(refusal),
                            recorded_us: now,
                        };
                        records.insert(g.key, r.clone());
                        new_records.push((g.key, self.shards().logical_of_id(id), r));
                    }
                    results.push(Err(e))
                }
            }
        }
        if !events.is_empty() {
            // Rows are written in id order, so two transactions creating the
            // same new ids cannot wait on each other in opposite orders.
            written.sort_unstable();
            let (present, absent): (Vec<_>, Vec<_>) = written
                .iter()
                .map(|id| {
                    let r = &rows[id];
                    EntityWrite {
                        id: *id,
                        logical: self.shards().logical_of_id(id),
                        version: r.version,
                        updated_us: now,
                        body: r.bag.as_ref().map(codec::encode_body),
                        expires_us: r.expires_us,
                    }
                })
                .partition(|w| locked.contains(&w.id));
            if !present.is_empty() {
                entities::update_entities(shard, &mut tx, &present).await?;
            }
            if !absent.is_empty() {
                let consecutive = match absent.len() {
                    1 => true, // one row: LAST_INSERT_ID() is its own
                    _ => {
                        *self.inner.consecutive[shard]
                            .get_or_try_init(|| entities::autoinc_is_consecutive(shard, &mut tx))
                            .await?
                    }
                };
                let added = entities::insert_entities(shard, &mut tx, &absent, consecutive).await?;
                for (w, at) in absent.iter().zip(added) {
                    if let Some(at) = at {
                        located.insert(w.id, at);
                    }
                }
            }
            let events: Vec<_> = events
                .into_iter()
                .map(|mut e| {
                    e.added_id = located.get(&e.id).copied();
                    OutboxInsert { entity_id: e.id, version: e.version, committed_us: now, event: e.encode() }
                })
                .collect();
            outbox::insert_outbox_rows(shard, &mut tx, &events).await?;
        }
        // Also when nothing was written: a guarded refusal is recorded.
        if !new_records.is_empty() {
            let (replaced, inserted): (Vec<_>, Vec<_>) =
                new_records.iter().cloned().partition(|(key, _, _)| expired.contains(key));
            idempotency::put_records(shard, &mut tx, &replaced).await?;
            idempotency::insert_records(shard, &mut tx, &inserted).await?;
        }
        tx.commit().await.map_err(|source| StoreError::Shard { shard, source })?;
        if self.settings().writer.drill_exit_after_commit && !new_records.is_empty() {
            tracing::warn!(shard, "drill: exiting after a committed keyed write, before answering");
            std::process::exit(137);
        }
        let shard_label = shard.to_string();
        for kind in kinds {
            self.inner.metrics.writes.with_label_values(&[&shard_label, kind]).inc();
        }
        Ok(results)
    }
}

/// Each of the `n` items' results from one transaction they shared: their
/// own when it committed, else its error (shared when there are several).
pub(crate) fn per_item(
    shard: usize,
    result: Result<Vec<Result<Outcome, WriteError>>, StoreError>,
    n: usize,
) -> Vec<Result<Outcome, WriteError>> {
    match result {
        Ok(results) => results,
        Err(e) if n == 1 => vec![Err(WriteError::Store(e))],
        Err(e) => {
            let source = std::sync::Arc::new(e);
            (0..n).map(|_| Err(WriteError::ShardFailed { shard, source: source.clone() })).collect()
        }
    }
}

/// An entity as the transaction sees it: what is stored (decoded), then
/// what earlier items of the same transaction made of it.
#[derive(Debug, Clone)]
struct Staged {
    version: u64,
    /// `None` for a tombstone (or a body that could not be decoded).
    bag: Option<Bag>,
    /// Visible: a body that is not expired.
    live: bool,
    /// The row's expiry (see `schemas::expiry`).
    expires_us: Option<i64>,
}

impl Staged {
    fn stored(shard: usize, id: &EntityId, c: EntityRecord, expiry: Option<&str>, now: i64) -> Staged {
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
struct Limits<'a> {
    /// The JSON size of a patched entity.
    max_bytes: usize,
    /// `expiry.property`.
    expiry: Option<&'a str>,
}

/// One item's effect: the row after it, its change event, its answer; or
/// why it does nothing. Pure: the database work is the caller's. `floor`
/// is the version floor of the id's logical shard: an id with no row
/// starts above it.
#[allow(clippy::too_many_arguments)]
fn decide(
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
}
