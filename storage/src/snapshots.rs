//! Change stream snapshots (`bagstore changes snapshot --group G`): the
//! record of each group's scan on the metadata shard, and the scan itself.
//!
//! The group's offsets on the change stream are put at the topic's end
//! first; every entity read after that is emitted as an `r` message. A
//! write that committed before a read is in what the read returns, or was
//! published after the group's offsets (then the group reads it); one that
//! commits after the read has a higher version. So a consumer that keeps a
//! message only when its version is above the last it applied for the id
//! ends with every live entity, whatever order the two kinds arrive in.

use sqlx::mysql::MySqlPool;
use sqlx::Row;
use std::collections::BTreeMap;

use crate::entities::{record, COLUMNS};
use crate::error::{OnShard, Result};
use crate::{EntityRecord, META_SHARD};

/// A group's snapshot as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub group: String,
    pub topic: String,
    /// The map epoch the scan runs under: if the map changes (a move
    /// finished), entities may have changed shards and the scan starts over.
    pub epoch: u64,
    /// Per physical shard, the last `added_id` emitted.
    pub cursors: BTreeMap<usize, u64>,
    pub rows_emitted: u64,
    pub finished: bool,
}

/// The snapshot of `group`, if one was started.
pub async fn get(pool: &MySqlPool, group: &str) -> Result<Option<Snapshot>> {
    let row = sqlx::query(
        "SELECT grp, topic, epoch, cursors, rows_emitted, finished IS NOT NULL AS finished \
         FROM bagstore_snapshots WHERE grp = ?",
    )
    .bind(group)
    .fetch_optional(pool)
    .await
    .on(META_SHARD)?;
    row.map(|r| {
        let cursors: String = r.try_get("cursors").on(META_SHARD)?;
        Ok(Snapshot {
            group: r.try_get("grp").on(META_SHARD)?,
            topic: r.try_get("topic").on(META_SHARD)?,
            epoch: r.try_get("epoch").on(META_SHARD)?,
            cursors: serde_json::from_str(&cursors).unwrap_or_default(),
            rows_emitted: r.try_get("rows_emitted").on(META_SHARD)?,
            finished: r.try_get::<i64, _>("finished").on(META_SHARD)? != 0,
        })
    })
    .transpose()
}

/// Records a new scan of `group` (after its offsets were placed), or
/// starts an existing one over under `epoch`.
pub async fn start(pool: &MySqlPool, group: &str, topic: &str, epoch: u64) -> Result<()> {
    sqlx::query(
        "INSERT INTO bagstore_snapshots (grp, topic, epoch, cursors) VALUES (?, ?, ?, '{}') \
         ON DUPLICATE KEY UPDATE epoch = VALUES(epoch), cursors = '{}', finished = NULL",
    )
    .bind(group)
    .bind(topic)
    .bind(epoch)
    .execute(pool)
    .await
    .on(META_SHARD)?;
    Ok(())
}

/// Saves how far the scan has emitted.
pub async fn save(pool: &MySqlPool, s: &Snapshot) -> Result<()> {
    let cursors = serde_json::to_string(&s.cursors).expect("a map of numbers serializes");
    sqlx::query("UPDATE bagstore_snapshots SET cursors = ?, rows_emitted = ? WHERE grp = ?")
        .bind(cursors)
        .bind(s.rows_emitted)
        .bind(&s.group)
        .execute(pool)
        .await
        .on(META_SHARD)?;
    Ok(())
}

/// Marks the scan of `group` finished.
pub async fn finish(pool: &MySqlPool, group: &str) -> Result<()> {
    sqlx::query("UPDATE bagstore_snapshots SET finished = NOW(6) WHERE grp = ?")
        .bind(group)
        .execute(pool)
        .await
        .on(META_SHARD)?;
    Ok(())
}

/// Forgets `group`'s snapshot (`--restart`).
pub async fn forget(pool: &MySqlPool, group: &str) -> Result<()> {
    sqlx::query("DELETE FROM bagstore_snapshots WHERE grp = ?")
        .bind(group)
        .execute(pool)
        .await
        .on(META_SHARD)?;
    Ok(())
}

/// The next `limit` rows with a body after `after` in `added_id` order, of
/// logical shards this shard owns (a moved-away copy waiting for its
/// cleanup is not emitted twice).
pub async fn live_after(
    shard: usize,
    pool: &MySqlPool,
    after: u64,
    limit: usize,
) -> Result<Vec<EntityRecord>> {
    let sql = format!(
        "SELECT {COLUMNS} FROM entities WHERE added_id > ? AND body IS NOT NULL \
         AND logical IN (SELECT logical FROM bagstore_owned) ORDER BY added_id LIMIT ?"
    );
    let rows = sqlx::query(&sql).bind(after).bind(limit as u64).fetch_all(pool).await.on(shard)?;
    rows.iter().map(|r| record(shard, r)).collect()
}
