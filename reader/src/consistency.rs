//! Read-your-writes and index freshness.
//!
//! A write response carries `write_token` = `<id>.<version>`. A query that
//! passes it in `consistent_with` runs only once the chosen index reflects
//! that write, which the reader checks on the index itself: it reads the
//! entity as stored now and, for every key the stored properties produce
//! in this index, looks for the row (on its shard) with a version at least
//! the token's. A deleted entity, or one that produces no key, needs no
//! row: the re-filter already keeps it out of results. The check is exact
//! per index and needs no Kafka access; it polls until the deadline, then
//! answers 504 `index-behind`.
//!
//! Freshness (`index_lag_ms`, `index_applied_through_us` in answers) is
//! `service::freshness`, measured at most every `FRESHNESS_TTL` per index.

use schemas::{EntityId, IndexSpec};
use service::freshness::{self, Freshness};
use std::time::{Duration, Instant};
use storage::{entities, index_rows, topology, StoreError};

use crate::{ReadError, Reader};

impl Reader {
    /// Whether `spec` reflects version `version` of `id` (or something newer).
    pub async fn applied(&self, spec: &IndexSpec, id: &EntityId, version: u64) -> Result<bool, StoreError> {
        let shards = self.shards();
        let map = shards.routing();
        let shard = map.of_id(id);
        let found = entities::read_entities_any(shard, shards.pool(shard), std::slice::from_ref(id)).await?;
        let epoch = match found.shard_epoch {
            Some(e) => e,
            None => topology::shard_epoch(shard, shards.pool(shard)).await?,
        };
        if epoch != map.epoch_of(shard) {
            // A move took the entity elsewhere since the map was loaded:
            // not known yet; the caller polls again with the new map.
            shards.reload().await?;
            return Ok(false);
        }
        let Some(e) = found.records.first() else { return Ok(true) };
        let Some(body) = e.body.as_deref() else { return Ok(true) };
        let Ok(bag) = schemas::codec::decode_body(body) else { return Ok(true) };
        for key in spec.keys(&bag) {
            let s = map.of_logical(spec.logical_of_key(&key, map.logical_shards()));
            match index_rows::index_row_version(s, shards.pool(s), spec, &key, id).await? {
                Some(v) if v >= version => {}
                _ => return Ok(false),
            }
        }
        Ok(true)
    }

    /// Waits until every token is reflected in `spec`, or fails at `deadline`.
    pub async fn wait_applied(
        &self,
        spec: &IndexSpec,
        tokens: &[(EntityId, u64)],
        deadline: tokio::time::Instant,
    ) -> Result<(), ReadError> {
        let mut pending: Vec<(EntityId, u64)> = tokens.to_vec();
        loop {
            let mut still = Vec::new();
            for (id, v) in pending {
                if !self.applied(spec, &id, v).await? {
                    still.push((id, v));
                }
            }
            pending = still;
            if pending.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                let pending = pending.iter().map(|(id, v)| format!("{id}.{v}")).collect();
                return Err(ReadError::IndexBehind { table: spec.table.clone(), pending });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
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
