//! The cleaner's work on unique indexes (`storage::unique`): the backfill's
//! step (each live entity's keys held, clashes collected), and the sweep
//! of key rows: reservations that ran out resolved, held rows whose entity
//! no longer holds the key removed (each counted as dangling drift).

use futures::StreamExt;
use schemas::index::{IndexKey, KeyValue};
use schemas::{codec, expiry, EntityId, IndexSpec};
use serde_json::{json, Value as JsonValue};
use std::collections::{BTreeMap, BTreeSet};
use storage::unique::sweep::{self, Resolved};
use storage::unique::{self, Held};
use storage::{EntityRecord, StoreError};

use crate::{Cleaner, CleanerError, SweepState};

/// At most this many clashes are listed (`conflicts` in `GET /v1/indexes`).
pub const MAX_LISTED: usize = 100;

/// How many keys a backfill batch holds at once.
const AT_ONCE: usize = 16;

/// Rows of each kind one sweep cycle looks at per index and shard.
const PER_CYCLE: usize = 500;

/// A unique index's keys held by more than one live entity.
#[derive(Debug, Default)]
pub struct Clashes {
    /// By key bytes: the key (as JSON) and the entities holding it.
    listed: BTreeMap<Vec<u8>, (JsonValue, BTreeSet<String>)>,
    /// Every clashing key, listed or not.
    keys: BTreeSet<Vec<u8>>,
}

impl Clashes {
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn extend(&mut self, found: Vec<Clash>) {
        for (key, a, b) in found {
            let bytes = unique::key_id(&key);
            self.keys.insert(bytes.clone());
            if self.listed.len() < MAX_LISTED || self.listed.contains_key(&bytes) {
                let (_, ids) = self.listed.entry(bytes).or_insert_with(|| (key_json(&key), BTreeSet::new()));
                ids.extend([a.to_hex(), b.to_hex()]);
            }
        }
    }

    /// `[{"key": […], "ids": […]}, …]`, at most [`MAX_LISTED`].
    pub fn to_json(&self) -> JsonValue {
        JsonValue::Array(self.listed.values().map(|(key, ids)| json!({"key": key, "ids": ids})).collect())
    }
}

/// A key's values as JSON (a uuid as 32 hex digits).
fn key_json(key: &IndexKey) -> JsonValue {
    key.iter()
        .map(|v| match v {
            KeyValue::Uuid(b) => json!(EntityId(*b).to_hex()),
            KeyValue::Str(s) => json!(s),
            KeyValue::Int(i) => json!(i),
            KeyValue::Float(f) => json!(f),
            KeyValue::Bool(b) => json!(b),
        })
        .collect()
}

/// A key, the entity whose row has it, and another live entity holding it.
type Clash = (IndexKey, EntityId, EntityId);

/// Holds the keys of a backfill batch's live entities; returns the clashes
/// found.
pub(crate) async fn hold_batch(
    cleaner: &Cleaner,
    spec: &IndexSpec,
    batch: &[EntityRecord],
) -> Result<Vec<Clash>, StoreError> {
    let s = cleaner.settings();
    let expiry = s.expiry.property.as_deref();
    let hold_us = (s.writer.unique_reservation_ms as i64).saturating_mul(1_000);
    let now = schemas::clock::now_micros();
    let mut keys = Vec::new();
    for e in batch {
        let Some(bag) = e.body.as_deref().and_then(|b| codec::decode_body(b).ok()) else { continue };
        if expiry::bag_is_expired(&bag, expiry, now) {
            continue;
        }
        keys.extend(spec.keys(&bag).into_iter().map(|k| (k, e.id)));
    }
    let shards = cleaner.shards();
    let held: Vec<Result<Option<Clash>, StoreError>> =
        futures::stream::iter(keys.into_iter().map(|(key, id)| async move {
            match unique::hold(shards, expiry, spec, &key, id, hold_us).await? {
                Held::Clash(other) => Ok(Some((key, other, id))),
                Held::Kept | Held::NotHeld => Ok(None),
            }
        }))
        .buffer_unordered(AT_ONCE)
        .collect()
        .await;
    held.into_iter().filter_map(Result::transpose).collect()
}

/// Margin for the writers' clocks (an entity's `updated` is its writer's
/// clock) and for writes decided before a recheck and committed after.
const RECHECK_MARGIN_US: i64 = 5_000_000;

/// The clashes among the entities of every shard updated since `since_us`
/// (less a margin): the backfill's recheck once the index is enforced.
pub(crate) async fn recheck_since(
    cleaner: &Cleaner,
    spec: &IndexSpec,
    since_us: i64,
) -> Result<Clashes, CleanerError> {
    let shards = cleaner.shards();
    let since = since_us.saturating_sub(RECHECK_MARGIN_US);
    let mut clashes = Clashes::default();
    for shard in shards.ids() {
        let mut before = None;
        loop {
            let page =
                storage::entities::scan_entities_by_updated(shard, shards.pool(shard), since, before, 500)
                    .await?
                    .records;
            let Some(last) = page.last() else { break };
            before = Some(storage::entities::UpdatedCursor::after(last));
            clashes.extend(hold_batch(cleaner, spec, &page).await?);
        }
    }
    Ok(clashes)
}

impl Cleaner {
    /// One step of the unique indexes' sweep on every live shard: every
    /// reservation that ran out, and the next page of held rows.
    pub(crate) async fn sweep_unique(&self, st: &mut SweepState) -> Result<(), CleanerError> {
        let specs = self.write_context().unique().get(self.shards()).await?;
        let expiry = self.settings().expiry.property.clone();
        let shards = self.shards();
        for u in specs.iter() {
            let spec = &u.spec;
            for shard in shards.ids() {
                let now = schemas::clock::now_micros();
                let mut rows = sweep::ran_out(shard, shards.pool(shard), spec, now, PER_CYCLE).await?;
                let key = (spec.table.clone(), shard);
                let after = st.unique_pass.get(&key).copied().flatten();
                let held = sweep::held_after(shard, shards.pool(shard), spec, after, PER_CYCLE).await?;
                st.unique_pass.insert(key, held.last().map(|r| r.owner));
                rows.extend(held);
                for row in &rows {
                    if sweep::resolve(shards, expiry.as_deref(), spec, row).await? == Resolved::Removed {
                        let m = self.metrics();
                        m.drift_found.with_label_values(&[&spec.table, "dangling"]).inc();
                        m.drift_fixed.with_label_values(&[&spec.table, "dangling"]).inc();
                        tracing::info!(index = %spec.table, owner = %row.owner, "removed a unique key row its entity does not hold");
                    }
                }
            }
        }
        Ok(())
    }
}
