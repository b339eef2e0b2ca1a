//! Applying row operations: one transaction per shard, shards in parallel,
//! operations of one shard in event order. Any failure fails the whole
//! apply; re-running it is harmless (see [`crate::plan`]).

use schemas::store::Shards;
use schemas::store::{self, StoreError};
use schemas::IndexSpec;

use crate::plan::{RowOp, RowOpKind};

pub async fn apply(shards: &Shards, spec: &IndexSpec, ops: &[RowOp]) -> Result<(), StoreError> {
    let mut per_shard: Vec<Vec<&RowOp>> = vec![Vec::new(); shards.count()];
    for op in ops {
        per_shard[op.shard].push(op);
    }
    let jobs =
        per_shard.into_iter().enumerate().filter(|(_, ops)| !ops.is_empty()).map(|(shard, ops)| async move {
            let mut tx =
                shards.pool(shard).begin().await.map_err(|source| StoreError::Shard { shard, source })?;
            for op in ops {
                match op.kind {
                    RowOpKind::Upsert => {
                        store::upsert_index_row(shard, &mut tx, spec, &op.key, &op.entity, op.version).await?
                    }
                    RowOpKind::DeleteOlder => {
                        store::delete_index_row_before(shard, &mut tx, spec, &op.key, &op.entity, op.version)
                            .await?
                    }
                }
            }
            tx.commit().await.map_err(|source| StoreError::Shard { shard, source })
        });
    for r in futures::future::join_all(jobs).await {
        r?;
    }
    Ok(())
}
