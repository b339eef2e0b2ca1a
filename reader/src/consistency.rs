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
//! Freshness: indexers record, per index, the commit time of the newest
//! event they applied (`bagstore_index_progress`). `index_lag_ms` is the
//! newest commit on any shard minus that, never negative: 0 when the index
//! has applied everything committed.

use axum::http::StatusCode;
use schemas::store::{self, StoreError};
use schemas::web::Problem;
use schemas::{EntityId, IndexSpec};
use std::time::{Duration, Instant};

use crate::Reader;

/// How current an index is.
#[derive(Debug, Clone, Copy)]
pub struct Freshness {
    pub applied_through_us: Option<i64>,
    pub lag_ms: Option<i64>,
}

impl Reader {
    /// Whether `spec` reflects version `version` of `id` (or something newer).
    pub async fn applied(&self, spec: &IndexSpec, id: &EntityId, version: u64) -> Result<bool, StoreError> {
        let shards = self.shards();
        let shard = shards.of_id(id);
        let found = store::read_entities_any(shard, shards.pool(shard), std::slice::from_ref(id)).await?;
        let Some(e) = found.first() else { return Ok(true) };
        let Some(body) = e.body.as_deref() else { return Ok(true) };
        let Ok(bag) = schemas::codec::decode_body(body) else { return Ok(true) };
        for key in spec.keys(&bag) {
            let s = spec.shard_of_key(&key, shards.count());
            match store::index_row_version(s, shards.pool(s), spec, &key, id).await? {
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
    ) -> Result<(), Problem> {
        let mut pending: Vec<(EntityId, u64)> = tokens.to_vec();
        loop {
            let mut still = Vec::new();
            for (id, v) in pending {
                if !self.applied(spec, &id, v).await.map_err(|e| Problem::internal(&e))? {
                    still.push((id, v));
                }
            }
            pending = still;
            if pending.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                let shown: Vec<String> = pending.iter().map(|(id, v)| format!("{id}.{v}")).collect();
                return Err(Problem::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "index-behind",
                    "Index behind",
                    format!("index {:?} has not applied these writes yet; retry later", spec.table),
                )
                .with("pending", shown));
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
        let f = self.measure_freshness(table).await?;
        self.inner.freshness.lock().expect("not poisoned").insert(table.to_string(), (Instant::now(), f));
        Ok(f)
    }

    async fn measure_freshness(&self, table: &str) -> Result<Freshness, StoreError> {
        let shards = self.shards();
        let newest_jobs = (0..shards.count()).map(|shard| store::newest_commit_us(shard, shards.pool(shard)));
        let (applied, per_shard) = tokio::join!(
            store::index_progress(shards.pool(0), table),
            futures::future::join_all(newest_jobs)
        );
        let applied = applied?;
        let mut newest = None;
        for n in per_shard {
            newest = newest.max(n?);
        }
        let lag_ms = match (newest, applied) {
            (Some(n), Some(a)) => Some(((n - a) / 1000).max(0)),
            (Some(n), None) => Some((schemas::web::now_micros() - n).max(0) / 1000),
            (None, _) => Some(0),
        };
        Ok(Freshness { applied_through_us: applied, lag_ms })
    }
}
