//! Read-your-writes and index freshness.
//!
//! A write response carries `write_token` = `<id>.<version>`. A read that
//! passes tokens in `consistent_with` never returns an older version of an
//! entity than a token names, wherever it reads:
//!
//! - Gets and batch gets compare each entity they read with the tokens
//!   that name it. A replica behind a token is read again for up to
//!   [`REPLICA_WAIT`] (with semi-sync replication it holds the write in its
//!   relay log before the write was acknowledged, and usually applies it
//!   within a millisecond or two); what is still behind is read from the
//!   primary. A tombstone counts: a deleted entity at the token's version
//!   or later is an exact answer (404, or left out).
//! - A query runs only once the chosen index reflects the tokens' writes,
//!   which the reader checks on the servers the query reads
//!   ([`Reader::wait_applied`]): it reads the entity as stored there (on a
//!   replica it must be at the token's version or later) and, for every
//!   key its stored properties produce in this index, looks for the row
//!   (on its shard) with a version at least the token's. A deleted entity,
//!   or one that produces no key, needs no row: the re-filter already
//!   keeps it out of results. The query then reads those same servers,
//!   which only gain transactions, so what was checked still holds. While
//!   the index itself is behind (on the primary) the query waits, polling,
//!   until the deadline, then answers 504 `index-behind`; once the primary
//!   reflects the writes, a replica gets [`REPLICA_WAIT`] to as well before
//!   the shards it lags on are read from the primary.
//!
//! Tokens stay what they were (`id.version`): an entity's version orders
//! its writes exactly, so no replication position is needed.
//!
//! Freshness (`index_lag_ms`, `index_applied_through_us` in answers) is
//! `service::freshness`, measured at most every `FRESHNESS_TTL` per index.

use schemas::{EntityId, IndexSpec};
use service::freshness::{self, Freshness};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use storage::entities::{self, EntityRecord};
use storage::shards::Routing;
use storage::{index_rows, topology, StoreError};

use crate::routing::{check_epoch, Fallback, Route, Target};
use crate::{ReadError, Reader};

/// How long a read carrying a write token waits for a replica that is
/// behind the token, before it reads the primary instead.
pub const REPLICA_WAIT: Duration = Duration::from_millis(50);

/// The write tokens a read carries: per entity, the newest version named.
#[derive(Debug, Clone, Default)]
pub struct Tokens(HashMap<EntityId, u64>);

impl Tokens {
    pub fn new(tokens: &[(EntityId, u64)]) -> Tokens {
        let mut by_id: HashMap<EntityId, u64> = HashMap::new();
        for (id, v) in tokens {
            let at = by_id.entry(*id).or_default();
            *at = (*at).max(*v);
        }
        Tokens(by_id)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The oldest version of `id` a read may return (None: no token names it).
    pub fn floor(&self, id: &EntityId) -> Option<u64> {
        self.0.get(id).copied()
    }

    /// Those of `ids` that `records` holds older than a token names
    /// (absent counts as older).
    fn behind(&self, ids: impl Iterator<Item = EntityId>, records: &[EntityRecord]) -> Vec<EntityId> {
        ids.filter(|id| {
            self.floor(id).is_some_and(|v| !records.iter().any(|r| r.id == *id && r.version >= v))
        })
        .collect()
    }
}

/// `records` with those of `ids` replaced by `fresh`.
fn replace(records: &mut Vec<EntityRecord>, ids: &[EntityId], fresh: Vec<EntityRecord>) {
    records.retain(|r| !ids.contains(&r.id));
    records.extend(fresh);
}

impl Reader {
    /// The rows of `ids` (all on `shard`), tombstones included, read on
    /// `target` with the shard's epoch checked against `map`.
    pub(crate) async fn records_by_id(
        &self,
        target: &Target,
        map: &Routing,
        shard: usize,
        ids: &[EntityId],
    ) -> Result<Vec<EntityRecord>, ReadError> {
        let fetched = read_on!(target.conns(self, shard), c => entities::read_entities_any(shard, c, ids));
        let epoch = match fetched.shard_epoch {
            Some(e) => e,
            None => read_on!(target.conns(self, shard), c => topology::shard_epoch(shard, c)),
        };
        check_epoch(map, shard, Some(epoch), target)?;
        Ok(fetched.records)
    }

    /// Brings `records`, read on replica `target` for `ids` of `shard`,
    /// up to the tokens: those behind one are read again on the replica
    /// for up to [`REPLICA_WAIT`], then from the primary.
    pub(crate) async fn catch_up(
        &self,
        route: &Route<'_>,
        target: &Target,
        map: &Routing,
        (shard, ids): (usize, &[EntityId]),
        records: &mut Vec<EntityRecord>,
        tokens: &Tokens,
    ) -> Result<(), ReadError> {
        let mut behind = tokens.behind(ids.iter().copied(), records);
        if behind.is_empty() {
            return Ok(());
        }
        let until = Instant::now() + REPLICA_WAIT;
        let mut pause = Duration::from_millis(1);
        while Instant::now() + pause < until {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(16));
            let fresh = match self.records_by_id(target, map, shard, &behind).await {
                Ok(fresh) => fresh,
                Err(e) if Fallback::after(&e).is_some() => break,
                Err(e) => return Err(e),
            };
            replace(records, &behind, fresh);
            behind = tokens.behind(behind.into_iter(), records);
            if behind.is_empty() {
                self.inner.metrics.token_waits.with_label_values(&["caught_up"]).inc();
                return Ok(());
            }
        }
        self.inner.metrics.token_waits.with_label_values(&["primary"]).inc();
        route.count_fallback(Fallback::WriteToken);
        let fresh = self.records_by_id(&Target::Primary, map, shard, &behind).await?;
        replace(records, &behind, fresh);
        Ok(())
    }

    /// Whether `spec`, as `route` reads it, reflects version `version` of
    /// `id` (or something newer): None if so, else the shard whose server
    /// does not show it yet.
    async fn applied_on(
        &self,
        route: &Route<'_>,
        map: &Routing,
        spec: &IndexSpec,
        (id, version): (EntityId, u64),
    ) -> Result<Option<usize>, ReadError> {
        let shard = map.of_id(&id);
        let target = route.target(shard);
        let found = match self.records_by_id(&target, map, shard, &[id]).await {
            Ok(found) => found,
            Err(e) => return Self::not_yet(route, &target, shard, e).map(|()| Some(shard)),
        };
        // On a replica, absent or older is not there yet; on the primary,
        // absent is gone (a purged tombstone).
        let e = match found.first() {
            Some(e) if e.version >= version || !target.is_replica() => e,
            _ if target.is_replica() => return Ok(Some(shard)),
            _ => return Ok(None),
        };
        let Some(body) = e.body.as_deref() else { return Ok(None) };
        let Ok(bag) = schemas::codec::decode_body(body) else { return Ok(None) };
        for key in spec.keys(&bag) {
            let s = map.of_logical(spec.logical_of_key(&key, map.logical_shards()));
            let t = route.target(s);
            match index_rows::index_row_version(s, t.pool(self, s), spec, &key, &id).await {
                Ok(Some(v)) if v >= version => {}
                Ok(_) => return Ok(Some(s)),
                Err(e) => return Self::not_yet(route, &t, s, e.into()).map(|()| Some(s)),
            }
        }
        Ok(None)
    }

    /// A check that failed with `e` on `target` of `shard`: on a replica
    /// that the primary would answer better, the shard is read from the
    /// primary from now on (and the check is not passed yet).
    fn not_yet(route: &Route<'_>, target: &Target, shard: usize, e: ReadError) -> Result<(), ReadError> {
        match Fallback::after(&e) {
            Some(why) if target.is_replica() => {
                route.demote(shard, why);
                Ok(())
            }
            _ => Err(e),
        }
    }

    /// Waits until every token is reflected in `spec` as `route` reads it,
    /// or fails at `deadline` (see the module's documentation).
    pub async fn wait_applied(
        &self,
        route: &Route<'_>,
        map: &Routing,
        spec: &IndexSpec,
        tokens: &[(EntityId, u64)],
        deadline: tokio::time::Instant,
    ) -> Result<(), ReadError> {
        let primaries = Route::primaries(self);
        let mut pending: Vec<(EntityId, u64)> = tokens.to_vec();
        // Since when the primaries reflect every pending token while a
        // replica this route reads does not.
        let mut primaries_since: Option<Instant> = None;
        loop {
            let (mut still, mut lagging) = (Vec::new(), Vec::new());
            for token in pending {
                if let Some(shard) = self.applied_on(route, map, spec, token).await? {
                    still.push(token);
                    lagging.push(shard);
                }
            }
            pending = still;
            if pending.is_empty() {
                if primaries_since.is_some() {
                    self.inner.metrics.token_waits.with_label_values(&["caught_up"]).inc();
                }
                return Ok(());
            }
            // Those of the shards behind that this route reads on replicas.
            lagging.retain(|s| route.on_replica(*s));
            if !lagging.is_empty() {
                if primaries_since.is_none() && self.all_applied(&primaries, map, spec, &pending).await? {
                    primaries_since = Some(Instant::now());
                }
                if primaries_since.is_some_and(|at| at.elapsed() >= REPLICA_WAIT) {
                    self.inner.metrics.token_waits.with_label_values(&["primary"]).inc();
                    lagging.sort_unstable();
                    lagging.dedup();
                    for s in lagging {
                        route.demote(s, Fallback::WriteToken);
                    }
                    primaries_since = None;
                    continue;
                }
            }
            if tokio::time::Instant::now() >= deadline {
                let pending = pending.iter().map(|(id, v)| format!("{id}.{v}")).collect();
                return Err(ReadError::IndexBehind { table: spec.table.clone(), pending });
            }
            let pause = if primaries_since.is_some() { 5 } else { 20 };
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
    }

    /// Whether `spec` reflects every token as `route` reads it.
    async fn all_applied(
        &self,
        route: &Route<'_>,
        map: &Routing,
        spec: &IndexSpec,
        tokens: &[(EntityId, u64)],
    ) -> Result<bool, ReadError> {
        for token in tokens {
            if self.applied_on(route, map, spec, *token).await?.is_some() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    pub async fn freshness(&self, table: &str) -> Result<Freshness, StoreError> {
        if let Some((at, f)) = self.inner.freshness.lock().expect("not poisoned").get(table) {
            if at.elapsed() < crate::FRESHNESS_TTL {
                return Ok(*f);
            }
        }
        let f = freshness::measure(self.shards(), table).await?;
        self.inner.freshness.lock().expect("not poisoned").insert(table.to_string(), (Instant::now(), f));
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> EntityId {
        EntityId([n; 16])
    }

    fn record(n: u8, version: u64) -> EntityRecord {
        EntityRecord {
            id: id(n),
            logical: 0,
            added_id: u64::from(n),
            version,
            updated_us: 0,
            body: None,
            expires_us: None,
        }
    }

    #[test]
    fn tokens_keep_the_newest_version_per_entity() {
        let t = Tokens::new(&[(id(1), 3), (id(1), 7), (id(1), 5), (id(2), 1)]);
        assert_eq!(t.floor(&id(1)), Some(7));
        assert_eq!(t.floor(&id(2)), Some(1));
        assert_eq!(t.floor(&id(3)), None);
        assert!(Tokens::new(&[]).is_empty());
    }

    #[test]
    fn an_entity_is_behind_a_token_when_older_or_absent_and_a_tombstone_counts() {
        let t = Tokens::new(&[(id(1), 3), (id(2), 3), (id(3), 3), (id(4), 3)]);
        // 1 older, 2 absent, 3 a tombstone at the token's version, 4 newer;
        // 5 no token names.
        let records = [record(1, 2), record(3, 3), record(4, 9), record(5, 1)];
        let behind = t.behind((1..=5).map(id), &records);
        assert_eq!(behind, vec![id(1), id(2)]);
    }

    #[test]
    fn replacing_keeps_the_others_and_drops_what_is_gone() {
        let mut records = vec![record(1, 2), record(2, 2), record(3, 2)];
        replace(&mut records, &[id(1), id(3)], vec![record(1, 4)]);
        records.sort_by_key(|r| r.id);
        assert_eq!(records, vec![record(1, 4), record(2, 2)]);
    }
}
