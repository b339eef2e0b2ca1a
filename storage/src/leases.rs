//! Member leases: the consumers of a group (an index's indexers, the
//! writers' ingest) assign its partitions among themselves, never through
//! the broker's group protocol (see `service::leases`).
//!
//! Each member renews a lease on the metadata shard under a stable name
//! (Kubernetes' pod name survives a container restart). The live members
//! are those whose lease has not run out, by the metadata shard's clock,
//! the one clock every member reads. A process that starts under a name
//! takes it over at once, whoever held it: a restarted member picks up
//! where its predecessor was, with no wait for the old lease to expire.
//! The process it took the name from finds so at its next renewal
//! ([`Beat::Taken`]) and stops: two live processes under one name are a
//! misconfiguration, and the one started last wins.
//!
//! Which partitions a member applies follows from the sorted member list
//! alone ([`share`]); the partition claims and fences (`storage::fences`)
//! keep a member that still applies a partition another has taken from
//! landing a write after the new owner's.

use sqlx::Row;
use std::collections::BTreeSet;
use std::time::Duration;

use crate::error::{OnShard, Result};
use crate::{Shards, META_SHARD};

/// What a renewal found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Beat {
    /// The live members of the group, this one among them, sorted.
    Members(Vec<String>),
    /// A process started later holds this member's name now.
    Taken,
}

/// The live leases of a group (bind the group), by the metadata shard's clock.
const LIVE: &str = "FROM bagstore_group_members WHERE grp = ? AND expires > NOW(6)";

/// How long a lease that ran out is kept before it is deleted (a member
/// that comes back within it finds nothing changed but the time).
const FORGET_AFTER_SECS: u64 = 24 * 3600;

/// Renews `member`'s lease in `group` for `ttl` on behalf of the process
/// `incarnation`, then lists the live members ([`look`]). `first`: this
/// process's first renewal, which takes the name over from whoever held it.
pub async fn beat(
    shards: &Shards,
    group: &str,
    member: &str,
    incarnation: [u8; 16],
    ttl: Duration,
    first: bool,
) -> Result<Beat> {
    let mut tx = shards.meta().begin().await.on(META_SHARD)?;
    let holder: Option<Vec<u8>> =
        sqlx::query("SELECT incarnation FROM bagstore_group_members WHERE grp = ? AND member = ? FOR UPDATE")
            .bind(group)
            .bind(member)
            .fetch_optional(&mut *tx)
            .await
            .on(META_SHARD)?
            .map(|r| r.get(0));
    if !first && holder.as_deref().is_some_and(|h| h != incarnation) {
        return Ok(Beat::Taken);
    }
    sqlx::query(
        "INSERT INTO bagstore_group_members (grp, member, incarnation, expires) \
         VALUES (?, ?, ?, NOW(6) + INTERVAL ? MICROSECOND) \
         ON DUPLICATE KEY UPDATE incarnation = VALUES(incarnation), expires = VALUES(expires)",
    )
    .bind(group)
    .bind(member)
    .bind(&incarnation[..])
    .bind(ttl.as_micros() as u64)
    .execute(&mut *tx)
    .await
    .on(META_SHARD)?;
    if first {
        sqlx::query(
            "DELETE FROM bagstore_group_members WHERE grp = ? AND expires < NOW(6) - INTERVAL ? SECOND",
        )
        .bind(group)
        .bind(FORGET_AFTER_SECS)
        .execute(&mut *tx)
        .await
        .on(META_SHARD)?;
    }
    tx.commit().await.on(META_SHARD)?;
    look(shards, group, member, incarnation).await
}

/// Lists the live members of `group` without renewing anything (a read
/// between renewals: no write, no fsync); [`Beat::Taken`] if a process
/// other than `incarnation` now holds `member`'s name.
pub async fn look(shards: &Shards, group: &str, member: &str, incarnation: [u8; 16]) -> Result<Beat> {
    let rows = sqlx::query(&format!("SELECT member, incarnation {LIVE} ORDER BY member"))
        .bind(group)
        .fetch_all(shards.meta())
        .await
        .on(META_SHARD)?;
    let mut members = Vec::with_capacity(rows.len());
    for r in rows {
        let (name, holder): (String, Vec<u8>) = (r.get(0), r.get(1));
        if name == member && holder != incarnation {
            return Ok(Beat::Taken);
        }
        members.push(name);
    }
    Ok(Beat::Members(members))
}

/// How many members of `group` hold a live lease (the indexers of an
/// index).
pub async fn live_members(shards: &Shards, group: &str) -> Result<usize> {
    let (n,): (i64,) = sqlx::query_as(&format!("SELECT COUNT(*) {LIVE}"))
        .bind(group)
        .fetch_one(shards.meta())
        .await
        .on(META_SHARD)?;
    Ok(n as usize)
}

/// Ends `member`'s lease, if `incarnation` still holds the name: the
/// others take its partitions at their next renewal.
pub async fn leave(shards: &Shards, group: &str, member: &str, incarnation: [u8; 16]) -> Result<()> {
    sqlx::query("DELETE FROM bagstore_group_members WHERE grp = ? AND member = ? AND incarnation = ?")
        .bind(group)
        .bind(member)
        .bind(&incarnation[..])
        .execute(shards.meta())
        .await
        .on(META_SHARD)?;
    Ok(())
}

/// The partitions of a topic with `partitions` partitions that `me`
/// applies among the sorted live `members`: every n-th, from its place in
/// the list (none if it is not in it). Every member computes the same
/// split from the same list, so a partition has one owner once their
/// lists agree; a member joining or leaving moves partitions of every
/// member, which a rare event may afford.
pub fn share(members: &[String], me: &str, partitions: usize) -> BTreeSet<i32> {
    let Some(place) = members.iter().position(|m| m == me) else { return BTreeSet::new() };
    (0..partitions).filter(|p| p % members.len() == place).map(|p| p as i32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_members_split_every_partition_once() {
        let members = names(&["a", "b", "c"]);
        let mut seen = BTreeSet::new();
        for m in &members {
            let mine = share(&members, m, 8);
            assert!(mine.len() == 2 || mine.len() == 3, "{m}: {mine:?}");
            for p in mine {
                assert!(seen.insert(p), "partition {p} given twice");
            }
        }
        assert_eq!(seen, (0..8).collect());
    }

    #[test]
    fn a_stranger_gets_nothing_and_a_lone_member_everything() {
        assert!(share(&names(&["a", "b"]), "c", 6).is_empty());
        assert_eq!(share(&names(&["a"]), "a", 4), (0..4).collect());
        assert!(share(&[], "a", 4).is_empty());
    }
}
