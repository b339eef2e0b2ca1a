//! Running a plan: index lookup → fetch → re-filter, until the limit is met
//! or every key is exhausted, so stale rows never shorten a result.

use schemas::codec;
use schemas::store::{self, StoreError, StoredEntity};
use schemas::{Bag, EntityId};
use std::collections::HashSet;

use crate::query::{Plan, Query};
use crate::Reader;

/// A live entity, decoded.
#[derive(Debug, Clone)]
pub struct Entity {
    pub id: EntityId,
    pub version: u64,
    pub updated_us: i64,
    pub properties: Bag,
}

/// What a query returned and what it cost.
#[derive(Debug, Default)]
pub struct Outcome {
    pub items: Vec<Entity>,
    pub shards_touched: usize,
    pub index_rows: u64,
    pub dropped: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("entity {id} on shard {shard} has a corrupt body")]
    Corrupt {
        id: EntityId,
        shard: usize,
        #[source]
        source: codec::CodecError,
    },
}

fn decode(shard: usize, s: StoredEntity) -> Result<Entity, ReadError> {
    let properties =
        codec::decode_body(&s.body).map_err(|source| ReadError::Corrupt { id: s.id, shard, source })?;
    Ok(Entity { id: s.id, version: s.version, updated_us: s.updated_us, properties })
}

impl Reader {
    pub async fn get(&self, id: &EntityId) -> Result<Option<Entity>, ReadError> {
        let shard = self.shards().of_id(id);
        match store::get_entity(shard, self.shards().pool(shard), id).await? {
            Some(s) => Ok(Some(decode(shard, s)?)),
            None => Ok(None),
        }
    }

    /// Live entities among `ids`, in the order asked, absent ones left out.
    /// One statement per shard, shards in parallel.
    pub async fn get_many(&self, ids: &[EntityId]) -> Result<Vec<Entity>, ReadError> {
        let n = self.shards().count();
        let mut per_shard: Vec<Vec<EntityId>> = vec![Vec::new(); n];
        for id in ids {
            per_shard[self.shards().of_id(id)].push(*id);
        }
        let jobs = per_shard.iter().enumerate().filter(|(_, v)| !v.is_empty()).map(|(shard, v)| async move {
            let rows = store::get_entities(shard, self.shards().pool(shard), v).await?;
            rows.into_iter().map(|s| decode(shard, s)).collect::<Result<Vec<_>, ReadError>>()
        });
        let mut found = std::collections::HashMap::new();
        for r in futures::future::join_all(jobs).await {
            for e in r? {
                found.insert(e.id, e);
            }
        }
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        for id in ids {
            if seen.insert(*id) {
                if let Some(e) = found.remove(id) {
                    out.push(e);
                }
            }
        }
        Ok(out)
    }

    /// Whether an entity really answers the query: every condition, typed
    /// for the index's own properties, plus the index's `match_on`.
    pub fn refilter(plan: &Plan, q: &Query, bag: &Bag) -> bool {
        plan.spec.matches_partial(bag)
            && q.conditions.iter().all(|(name, c)| match plan.spec.property(name) {
                Some(prop) => c.matches_typed(prop, bag.get(name)),
                None => c.matches(bag.get(name)),
            })
    }

    pub async fn run(&self, plan: &Plan, q: &Query) -> Result<Outcome, ReadError> {
        let table = plan.spec.table.as_str();
        let shards = self.shards().count();
        let mut out = Outcome::default();
        let mut seen: HashSet<EntityId> = HashSet::new();
        let mut touched = HashSet::new();
        'keys: for key in &plan.keys {
            let shard = plan.spec.shard_of_key(key, shards);
            touched.insert(shard);
            let mut after: Option<EntityId> = None;
            loop {
                // Ask for a little more than is missing: some candidates may be stale.
                let want = (q.limit - out.items.len()).clamp(16, 1000) * 2;
                let ids = store::lookup_index(
                    shard,
                    self.shards().pool(shard),
                    &plan.spec,
                    key,
                    after.as_ref(),
                    want,
                )
                .await?;
                self.inner.metrics.shard_reads.with_label_values(&[table, &shard.to_string()]).inc();
                out.index_rows += ids.len() as u64;
                let exhausted = ids.len() < want;
                after = ids.last().copied();
                let fresh: Vec<EntityId> = ids.into_iter().filter(|id| !seen.contains(id)).collect();
                for e in self.get_many(&fresh).await? {
                    seen.insert(e.id);
                    if Self::refilter(plan, q, &e.properties) {
                        out.items.push(e);
                        if out.items.len() == q.limit {
                            break 'keys;
                        }
                    } else {
                        out.dropped += 1;
                    }
                }
                // Ids the fetch did not find are dangling rows.
                out.dropped += fresh.iter().filter(|id| !seen.contains(id)).count() as u64;
                for id in fresh {
                    seen.insert(id);
                }
                if exhausted {
                    break;
                }
            }
        }
        out.shards_touched = touched.len();
        self.inner.metrics.index_rows.with_label_values(&[table]).inc_by(out.index_rows);
        self.inner.metrics.dropped.with_label_values(&[table]).inc_by(out.dropped);
        Ok(out)
    }
}
