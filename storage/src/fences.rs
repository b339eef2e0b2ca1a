//! Partition fences: an indexer consumer proves, inside each index write
//! transaction, that no consumer has been assigned its partitions since.
//!
//! A consumer group can give a partition to a new member while the old one
//! still applies a batch it fetched (a broker that does not tell a replaced
//! member, a member stalled on a lock or retrying a failed write). The old
//! member's events are older than what the new one applies, so its late
//! write could bring back an index row a newer event deleted. Comparing
//! claims before each batch narrows that to one batch; this closes it.
//!
//! Each assignment is a *claim* on the metadata shard with a generation one
//! above the partition's last ([`claim`]). The claimant then raises the
//! partition's *fence* on every shard to that generation ([`raise`]). Every
//! index write transaction reads the fences of the partitions its events
//! came from with a shared lock and is refused if one is above its claim
//! ([`check`]); a fence below it (a shard that missed the raise, or was
//! added since) is raised in the same transaction. Raising takes the row
//! exclusively, so it waits for the old member's transaction in flight on
//! that shard, and every later one of the old member's is refused: its
//! writes on a shard all commit before the new member's first.

use sqlx::{MySqlConnection, MySqlPool, Row};
use std::collections::BTreeMap;

use crate::error::{OnShard, Result, StoreError};
use crate::rows::marks;
use crate::{Shards, META_SHARD};

/// A consumer's claim on one partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Claim {
    pub partition: i32,
    pub gen: u64,
}

/// Records `consumer`'s claims on `partitions` of `group` (each a
/// generation above the last) on the metadata shard, then raises their
/// fences on every shard that answers. Returns the claims.
pub async fn claim(
    shards: &Shards,
    group: &str,
    consumer: [u8; 16],
    partitions: &[i32],
) -> Result<Vec<Claim>> {
    if partitions.is_empty() {
        return Ok(Vec::new());
    }
    let meta = shards.meta();
    let mut tx = meta.begin().await.on(META_SHARD)?;
    let sql = format!(
        "INSERT INTO bagstore_partition_claims (grp, part, consumer, gen) VALUES {} \
         ON DUPLICATE KEY UPDATE consumer = VALUES(consumer), claimed = NOW(6), gen = gen + 1",
        vec!["(?, ?, ?, 1)"; partitions.len()].join(", ")
    );
    let mut q = sqlx::query(&sql);
    for p in partitions {
        q = q.bind(group).bind(p).bind(&consumer[..]);
    }
    q.execute(&mut *tx).await.on(META_SHARD)?;
    // Our own rows, locked by the insert until the commit.
    let sql = format!(
        "SELECT part, gen FROM bagstore_partition_claims WHERE grp = ? AND part IN ({})",
        marks(partitions.len())
    );
    let mut q = sqlx::query_as::<_, (i32, u64)>(&sql).bind(group);
    for p in partitions {
        q = q.bind(p);
    }
    let claims: Vec<Claim> = q
        .fetch_all(&mut *tx)
        .await
        .on(META_SHARD)?
        .into_iter()
        .map(|(partition, gen)| Claim { partition, gen })
        .collect();
    tx.commit().await.on(META_SHARD)?;
    let claims_ref = &claims;
    let done = shards.each(|shard, pool| async move { raise(shard, pool, group, claims_ref).await }).await;
    for e in done.into_iter().filter_map(|r| r.err()) {
        // That shard's fences are raised by our first write there.
        tracing::debug!(error = %e, "cannot raise partition fences yet");
    }
    Ok(claims)
}

/// Raises the fences of `claims` on one shard to at least their generations.
pub async fn raise(shard: usize, pool: &MySqlPool, group: &str, claims: &[Claim]) -> Result<()> {
    let mut conn = pool.acquire().await.on(shard)?;
    raise_on(shard, &mut conn, group, claims).await
}

async fn raise_on(shard: usize, conn: &mut MySqlConnection, group: &str, claims: &[Claim]) -> Result<()> {
    if claims.is_empty() {
        return Ok(());
    }
    let sql = format!(
        "INSERT INTO bagstore_partition_fences (grp, part, gen) VALUES {} \
         ON DUPLICATE KEY UPDATE gen = GREATEST(gen, VALUES(gen))",
        vec!["(?, ?, ?)"; claims.len()].join(", ")
    );
    let mut q = sqlx::query(&sql);
    for c in claims {
        q = q.bind(group).bind(c.partition).bind(c.gen);
    }
    q.execute(conn).await.on(shard)?;
    Ok(())
}

/// Proves, inside the caller's transaction on `shard`, that `claims` are
/// the newest of their partitions there: reads their fences with a shared
/// lock (held to the commit, so a newer claim's raise waits for it),
/// raises those below a claim, and refuses with [`StoreError::Fenced`] if
/// any is above.
pub async fn check(shard: usize, tx: &mut MySqlConnection, group: &str, claims: &[Claim]) -> Result<()> {
    if claims.is_empty() {
        return Ok(());
    }
    let sql = format!(
        "SELECT part, gen FROM bagstore_partition_fences WHERE grp = ? AND part IN ({}) LOCK IN SHARE MODE",
        marks(claims.len())
    );
    let mut q = sqlx::query(&sql).bind(group);
    for c in claims {
        q = q.bind(c.partition);
    }
    let mut fences: BTreeMap<i32, u64> = BTreeMap::new();
    for r in q.fetch_all(&mut *tx).await.on(shard)? {
        fences.insert(r.try_get("part").on(shard)?, r.try_get("gen").on(shard)?);
    }
    let newer: Vec<i32> = claims
        .iter()
        .filter(|c| fences.get(&c.partition).is_some_and(|g| *g > c.gen))
        .map(|c| c.partition)
        .collect();
    if !newer.is_empty() {
        return Err(StoreError::Fenced { shard, group: group.to_string(), partitions: newer });
    }
    let behind: Vec<Claim> =
        claims.iter().filter(|c| fences.get(&c.partition).is_none_or(|g| *g < c.gen)).copied().collect();
    raise_on(shard, tx, group, &behind).await
}

/// Of `partitions` of `group`, those claimed by a consumer other than
/// `consumer` (the metadata shard's claims; compared before each batch so
/// a replaced consumer stops before it even tries to write).
pub async fn claimed_by_others(
    shards: &Shards,
    group: &str,
    consumer: [u8; 16],
    partitions: &[i32],
) -> Result<Vec<i32>> {
    if partitions.is_empty() {
        return Ok(Vec::new());
    }
    let sql = format!(
        "SELECT part FROM bagstore_partition_claims WHERE grp = ? AND consumer <> ? AND part IN ({})",
        marks(partitions.len())
    );
    let mut q = sqlx::query_as::<_, (i32,)>(&sql).bind(group).bind(&consumer[..]);
    for p in partitions {
        q = q.bind(p);
    }
    Ok(q.fetch_all(shards.meta()).await.on(META_SHARD)?.into_iter().map(|r| r.0).collect())
}
