//! Moving logical shards between physical shards: the SQL of every step.
//! The `mover` crate runs the steps in order, resumes them after a kill and
//! reports progress; this module only says what each step does to the
//! databases.
//!
//! While a move runs, the source journals which of its rows change
//! ([`crate::journal`]); catching up makes the target's rows of those
//! entities equal to the source's.
//!
//! The cutover ([`Fence`]) takes the moving logical shards' `bagstore_owned`
//! rows on the source exclusively: every write to them holds those rows
//! shared for its whole transaction, so the fence waits for writes in flight
//! to commit, and writes that come later wait behind it (they do not fail).
//!
//! What a logical shard carries besides its rows (version floors,
//! idempotency records) is read and written by [`crate::carry`].

use schemas::topology::{format_logicals, parse_logicals, PhysicalId};
use sqlx::mysql::MySqlPool;
use sqlx::{Executor, MySqlConnection, Row};
use std::collections::BTreeMap;

use crate::error::{id_column, OnShard, Result, StoreError};
use crate::rows::{marks, Rows, KEYS_PER_STATEMENT};
use crate::topology::META_SHARD;

/// `head`, an `IN (…)` list of logical shards, `tail`.
fn logicals_in(head: &str, tail: &str) -> Rows {
    Rows::new(format!("{head} IN ("), "?", format!("){tail}")).at_most(KEYS_PER_STATEMENT)
}

/// Where a move is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Copying, catching up and verifying; the source owns and serves.
    Copy,
    /// The fenced switch of ownership is under way.
    Cutover,
    /// The target owns; the source's copy goes once every process has the
    /// new map.
    Cleanup,
    Done,
    /// Undoing a move that did not reach its cutover.
    RollingBack,
    RolledBack,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Copy => "copy",
            Phase::Cutover => "cutover",
            Phase::Cleanup => "cleanup",
            Phase::Done => "done",
            Phase::RollingBack => "rolling_back",
            Phase::RolledBack => "rolled_back",
        }
    }

    fn parse(s: &str) -> Option<Phase> {
        [Phase::Copy, Phase::Cutover, Phase::Cleanup, Phase::Done, Phase::RollingBack, Phase::RolledBack]
            .into_iter()
            .find(|p| p.as_str() == s)
    }

    /// Whether the move still has work to do.
    pub fn in_flight(self) -> bool {
        !matches!(self, Phase::Done | Phase::RolledBack)
    }
}

/// One move as recorded on the metadata shard.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MoveRecord {
    pub id: u64,
    pub logicals: Vec<u16>,
    pub source: PhysicalId,
    pub target: PhysicalId,
    pub phase: Phase,
    /// Logical shards whose first copy is complete (a resumed copy skips them).
    pub copied: Vec<u16>,
    pub rows_copied: u64,
    pub started_us: i64,
    pub changed_us: i64,
}

const MOVE_COLUMNS: &str = "id, logicals, source, target, phase, done_logicals, rows_copied, \
     TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', started) AS started_us, \
     TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', changed) AS changed_us";

fn move_record(r: &sqlx::mysql::MySqlRow) -> Result<MoveRecord> {
    let s = META_SHARD;
    let bad =
        |what: &str, e: String| StoreError::BadTopology(format!("unreadable move record ({what}): {e}"));
    let phase: String = r.try_get("phase").on(s)?;
    let logicals: String = r.try_get("logicals").on(s)?;
    let copied: String = r.try_get("done_logicals").on(s)?;
    Ok(MoveRecord {
        id: r.try_get("id").on(s)?,
        logicals: parse_logicals(&logicals, u16::MAX).map_err(|e| bad("logicals", e))?,
        source: r.try_get("source").on(s)?,
        target: r.try_get("target").on(s)?,
        phase: Phase::parse(&phase).ok_or_else(|| bad("phase", phase.clone()))?,
        copied: parse_logicals(&copied, u16::MAX).map_err(|e| bad("done_logicals", e))?,
        rows_copied: r.try_get("rows_copied").on(s)?,
        started_us: r.try_get("started_us").on(s)?,
        changed_us: r.try_get("changed_us").on(s)?,
    })
}

/// Records a new move, unless one is in flight already (one move at a time
/// per cluster: a rebalance runs its moves one after another).
pub async fn create_move(
    meta: &MySqlPool,
    logicals: &[u16],
    source: PhysicalId,
    target: PhysicalId,
) -> Result<MoveRecord> {
    let s = META_SHARD;
    let mut tx = meta.begin().await.on(s)?;
    // The cluster row serializes movers (and map changes).
    sqlx::query("SELECT epoch FROM bagstore_cluster WHERE id = 1 FOR UPDATE")
        .fetch_one(&mut *tx)
        .await
        .on(s)?;
    let busy = sqlx::query(&format!(
        "SELECT {MOVE_COLUMNS} FROM bagstore_moves WHERE phase NOT IN ('done', 'rolled_back') LIMIT 1"
    ))
    .fetch_optional(&mut *tx)
    .await
    .on(s)?;
    if let Some(r) = busy {
        let m = move_record(&r)?;
        return Err(StoreError::BadTopology(format!(
            "move {} ({} from shard {} to {}) is still in phase {}; resume it with `bagstore shards resume` \
             or wait for it",
            m.id,
            format_logicals(&m.logicals),
            m.source,
            m.target,
            m.phase.as_str()
        )));
    }
    let id = sqlx::query(
        "INSERT INTO bagstore_moves (logicals, source, target, phase, done_logicals) VALUES (?, ?, ?, 'copy', '')",
    )
    .bind(format_logicals(logicals))
    .bind(source)
    .bind(target)
    .execute(&mut *tx)
    .await
    .on(s)?
    .last_insert_id();
    tx.commit().await.on(s)?;
    get_move(meta, id).await?.ok_or_else(|| StoreError::BadTopology(format!("move {id} vanished")))
}

pub async fn get_move(meta: &MySqlPool, id: u64) -> Result<Option<MoveRecord>> {
    let row = sqlx::query(&format!("SELECT {MOVE_COLUMNS} FROM bagstore_moves WHERE id = ?"))
        .bind(id)
        .fetch_optional(meta)
        .await
        .on(META_SHARD)?;
    row.as_ref().map(move_record).transpose()
}

/// Moves not yet done or rolled back (at most one), oldest first.
pub async fn moves_in_flight(meta: &MySqlPool) -> Result<Vec<MoveRecord>> {
    let rows = sqlx::query(&format!(
        "SELECT {MOVE_COLUMNS} FROM bagstore_moves WHERE phase NOT IN ('done', 'rolled_back') ORDER BY id"
    ))
    .fetch_all(meta)
    .await
    .on(META_SHARD)?;
    rows.iter().map(move_record).collect()
}

/// Moves a move from phase `from` (the one the caller last saw) to `to`.
/// A run that lost the mover lock without knowing can still be driving the
/// move while another run has taken it over; changing the phase only from
/// the one it saw keeps such a run from writing over what the other wrote
/// (its flip's `cleanup`, or `done`, which a late `cutover` would turn back
/// into a move in flight): [`StoreError::MovePhaseMoved`] then.
pub async fn set_phase(meta: &MySqlPool, id: u64, from: Phase, to: Phase) -> Result<()> {
    // `changed` always changes, so a matched row always counts as affected.
    let done =
        sqlx::query("UPDATE bagstore_moves SET phase = ?, changed = NOW(6) WHERE id = ? AND phase = ?")
            .bind(to.as_str())
            .bind(id)
            .bind(from.as_str())
            .execute(meta)
            .await
            .on(META_SHARD)?;
    if done.rows_affected() == 0 {
        return Err(StoreError::MovePhaseMoved { id, expected: from.as_str() });
    }
    Ok(())
}

/// Records copy progress: logical shards fully copied, rows copied so far.
pub async fn set_copied(meta: &MySqlPool, id: u64, copied: &[u16], rows_copied: u64) -> Result<()> {
    sqlx::query(
        "UPDATE bagstore_moves SET done_logicals = ?, rows_copied = ?, changed = NOW(6) WHERE id = ?",
    )
    .bind(format_logicals(copied))
    .bind(rows_copied)
    .bind(id)
    .execute(meta)
    .await
    .on(META_SHARD)?;
    Ok(())
}

/// The cutover's hold on the source: its `bagstore_owned` rows of the
/// moving logical shards, taken exclusively on a connection of its own.
#[derive(Debug)]
pub struct Fence {
    shard: usize,
    conn: MySqlConnection,
    logicals: Vec<u16>,
    /// The newest outbox event at the moment the fence closed: every event
    /// up to it must reach Kafka before the target takes writes.
    pub outbox_upto: u64,
}

impl Fence {
    /// Waits up to `wait_secs` for writes in flight to the moving logical
    /// shards to commit, and holds off new ones. Fails with a lock wait
    /// timeout (nothing changed) if they do not finish in time.
    pub async fn close(
        shard: usize,
        mut conn: MySqlConnection,
        logicals: &[u16],
        wait_secs: u32,
    ) -> Result<Fence> {
        sqlx::query("SET SESSION innodb_lock_wait_timeout = ?")
            .bind(wait_secs.max(1))
            .execute(&mut conn)
            .await
            .on(shard)?;
        sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .execute(&mut conn)
            .await
            .on(shard)?;
        conn.execute("BEGIN").await.on(shard)?;
        let sql = format!(
            "SELECT logical FROM bagstore_owned WHERE logical IN ({}) FOR UPDATE",
            marks(logicals.len())
        );
        let mut q = sqlx::query(&sql);
        for k in logicals {
            q = q.bind(*k);
        }
        let held = q.fetch_all(&mut conn).await.on(shard)?;
        if held.len() != logicals.len() {
            let _ = conn.execute("ROLLBACK").await;
            return Err(StoreError::BadTopology(format!(
                "physical shard {shard} owns only {} of the {} logical shards being moved",
                held.len(),
                logicals.len()
            )));
        }
        let (upto,): (u64,) = sqlx::query_as("SELECT CAST(COALESCE(MAX(seq), 0) AS UNSIGNED) FROM outbox")
            .fetch_one(&mut conn)
            .await
            .on(shard)?;
        Ok(Fence { shard, conn, logicals: logicals.to_vec(), outbox_upto: upto })
    }

    /// Gives the logical shards up: deletes their ownership rows and sets
    /// the shard's epoch, so waiting writes find they no longer own them
    /// and reads see the epoch move. Ends the fence.
    pub async fn release(mut self, epoch: u64) -> Result<()> {
        let s = self.shard;
        let release = logicals_in("DELETE FROM bagstore_owned WHERE logical", "");
        for st in release.statements(&self.logicals) {
            st.bind(sqlx::query(&st.sql), |q, k| q.bind(*k)).execute(&mut self.conn).await.on(s)?;
        }
        sqlx::query("UPDATE bagstore_shard SET epoch = GREATEST(epoch, ?) WHERE id = 1")
            .bind(epoch)
            .execute(&mut self.conn)
            .await
            .on(s)?;
        self.conn.execute("COMMIT").await.on(s)?;
        Ok(())
    }

    /// Lets writes continue with nothing changed.
    pub async fn open(mut self) {
        let _ = self.conn.execute("ROLLBACK").await;
    }
}

/// Outbox events at or below `seq`, of entities in `logicals` (sorted; of
/// `logical_shards`), not yet acknowledged by Kafka.
pub async fn outbox_pending_in(
    shard: usize,
    pool: &MySqlPool,
    seq: u64,
    logicals: &[u16],
    logical_shards: u16,
) -> Result<u64> {
    let rows = sqlx::query("SELECT entity_id FROM outbox WHERE seq <= ?")
        .bind(seq)
        .fetch_all(pool)
        .await
        .on(shard)?;
    let mut n = 0;
    for r in &rows {
        let id = id_column(shard, r, "entity_id")?;
        if logicals.binary_search(&schemas::logical_of(id.as_bytes(), logical_shards)).is_ok() {
            n += 1;
        }
    }
    Ok(n)
}

/// Takes `logicals` away from a shard that was granted them for a cutover
/// that did not happen (nothing can have written there: no map routed to
/// it).
pub async fn revoke(shard: usize, pool: &MySqlPool, logicals: &[u16]) -> Result<()> {
    let revoke = logicals_in("DELETE FROM bagstore_owned WHERE logical", "");
    for st in revoke.statements(logicals) {
        st.bind(sqlx::query(&st.sql), |q, k| q.bind(*k)).execute(pool).await.on(shard)?;
    }
    Ok(())
}

/// Makes the mover run `token` the one that may copy `logicals` into this
/// (target) shard. Waits for copy transactions of an earlier run in flight;
/// their later ones fail ([`begin_incoming`]).
pub async fn claim_incoming(shard: usize, pool: &MySqlPool, logicals: &[u16], token: u64) -> Result<()> {
    let claim = Rows::new(
        "INSERT INTO bagstore_incoming (logical, token) VALUES ",
        "(?, ?)",
        " ON DUPLICATE KEY UPDATE token = VALUES(token)",
    )
    .at_most(KEYS_PER_STATEMENT);
    for st in claim.statements(logicals) {
        st.bind(sqlx::query(&st.sql), |q, k| q.bind(*k).bind(token)).execute(pool).await.on(shard)?;
    }
    Ok(())
}

/// Checks, inside `conn`'s transaction and with a shared lock held to its
/// end, that run `token` still may copy `logicals` into this shard.
async fn check_incoming(
    shard: usize,
    conn: &mut MySqlConnection,
    logicals: &[u16],
    token: u64,
    lock: &str,
) -> Result<()> {
    let mut held = 0;
    let check =
        logicals_in("SELECT logical FROM bagstore_incoming WHERE logical", &format!(" AND token = ? {lock}"));
    for st in check.statements(logicals) {
        let q = st.bind(sqlx::query(&st.sql), |q, k| q.bind(*k));
        held += q.bind(token).fetch_all(&mut *conn).await.on(shard)?.len();
    }
    if held == logicals.len() {
        return Ok(());
    }
    Err(StoreError::MoveTakenOver { shard })
}

/// Begins a copy transaction into a target shard: fails unless run
/// `token` still may write `logicals` there.
pub async fn begin_incoming(
    shard: usize,
    pool: &MySqlPool,
    logicals: &[u16],
    token: u64,
) -> Result<sqlx::Transaction<'static, sqlx::MySql>> {
    let mut tx = pool.begin().await.on(shard)?;
    check_incoming(shard, &mut tx, logicals, token, "LOCK IN SHARE MODE").await?;
    Ok(tx)
}

/// The target's half of a cutover, in one transaction: run `token` still
/// holds the incoming rows, which go, and the shard owns `logicals`, each
/// with a version floor at least the source's (`floors`, read under the
/// fence: see [`crate::carry::version_floors`]; a logical shard missing
/// from it has 0). Floors and ownership arrive together, so a shard that
/// owns a logical shard always has its floor.
pub async fn take_over(
    shard: usize,
    pool: &MySqlPool,
    logicals: &[u16],
    token: u64,
    floors: &BTreeMap<u16, u64>,
) -> Result<()> {
    let mut tx = pool.begin().await.on(shard)?;
    check_incoming(shard, &mut tx, logicals, token, "FOR UPDATE").await?;
    let forget = logicals_in("DELETE FROM bagstore_incoming WHERE logical", "");
    let own = Rows::new(
        "INSERT INTO bagstore_owned (logical, version_floor) VALUES ",
        "(?, ?)",
        " ON DUPLICATE KEY UPDATE version_floor = GREATEST(version_floor, VALUES(version_floor))",
    )
    .at_most(KEYS_PER_STATEMENT);
    // Each statement's logical shards leave incoming and become owned
    // before the next statement's.
    for st in forget.statements(logicals) {
        st.bind(sqlx::query(&st.sql), |q, k| q.bind(*k)).execute(&mut *tx).await.on(shard)?;
        let st = own.statement(st.rows);
        let q = st.bind(sqlx::query(&st.sql), |q, k| q.bind(*k).bind(floors.get(k).copied().unwrap_or(0)));
        q.execute(&mut *tx).await.on(shard)?;
    }
    tx.commit().await.on(shard)
}

/// The target's epoch raised to `epoch` (the one the source's release set)
/// after the release: the map's flip then gives both shards that epoch.
/// Before it, the target already served what it had; a server of the
/// target (a replica) that shows the older epoch has not applied the copy
/// and the take-over, so a reader routed by the flipped map takes it for
/// lag rather than reading the moved rows there as absent. Not in the
/// take-over itself: a cutover that never releases takes the grant back,
/// and the map would never learn an epoch raised with it. Idempotent;
/// returns the target's epoch now.
pub async fn raise_epoch(shard: usize, pool: &MySqlPool, epoch: u64) -> Result<u64> {
    let mut conn = pool.acquire().await.on(shard)?;
    crate::topology::raise_shard_epoch(shard, &mut conn, epoch).await
}

/// Forgets the incoming rows of `logicals` (a rolled-back move).
pub async fn drop_incoming(shard: usize, pool: &MySqlPool, logicals: &[u16]) -> Result<()> {
    let forget = logicals_in("DELETE FROM bagstore_incoming WHERE logical", "");
    for st in forget.statements(logicals) {
        st.bind(sqlx::query(&st.sql), |q, k| q.bind(*k)).execute(pool).await.on(shard)?;
    }
    Ok(())
}

/// Which of `logicals` a shard's database owns.
pub async fn owns(shard: usize, pool: &MySqlPool, logicals: &[u16]) -> Result<Vec<u16>> {
    if logicals.is_empty() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    let owned = logicals_in("SELECT logical FROM bagstore_owned WHERE logical", " ORDER BY logical");
    for st in owned.statements(logicals) {
        let q = st.bind(sqlx::query_as::<_, (u16,)>(&st.sql), |q, k| q.bind(*k));
        out.extend(q.fetch_all(pool).await.on(shard)?.into_iter().map(|r| r.0));
    }
    Ok(out)
}

/// Flips the map: `logicals` now belong to `target`; the cluster's epoch
/// rises past `source_epoch` (what the source's database now says), the
/// source's entry records it and the target's records `target_epoch` (what
/// the target's says, see [`raise_epoch`]); the move enters
/// [`Phase::Cleanup`]. One
/// transaction on the metadata shard, and only from [`Phase::Cutover`]: a
/// run that lost the mover lock without knowing, whose cutover released
/// the source while another run (waiting on its fence) took the move over,
/// flips late; by then the other run has flipped and maybe finished the
/// move, and recording `cleanup` again would make it a move in flight
/// whose cleanup runs a second time, beside the moves after it. Such a
/// flip changes nothing and fails with [`StoreError::MovePhaseMoved`].
///
/// `failovers`: the source's and target's counts of primary changes when
/// the cutover began. If either changed since, a failover (or switchover)
/// ran during the cutover: the flip changes nothing and fails with
/// [`StoreError::FailedOverMidCutover`] (the caller recovers the cutover
/// on the new primaries, with their epochs).
pub async fn flip(
    meta: &MySqlPool,
    move_id: u64,
    logicals: &[u16],
    source: PhysicalId,
    target: PhysicalId,
    (source_epoch, target_epoch): (u64, u64),
    failovers: (u64, u64),
) -> Result<u64> {
    let s = META_SHARD;
    let mut tx = meta.begin().await.on(s)?;
    for (shard, seen) in [(source, failovers.0), (target, failovers.1)] {
        let (now,): (u64,) =
            sqlx::query_as("SELECT failovers FROM bagstore_physical WHERE id = ? FOR UPDATE")
                .bind(shard)
                .fetch_one(&mut *tx)
                .await
                .on(s)?;
        if now != seen {
            return Err(StoreError::FailedOverMidCutover { id: move_id, shard });
        }
    }
    let (epoch,): (u64,) = sqlx::query_as("SELECT epoch FROM bagstore_cluster WHERE id = 1 FOR UPDATE")
        .fetch_one(&mut *tx)
        .await
        .on(s)?;
    let new_epoch = epoch.max(source_epoch).max(target_epoch) + 1;
    let remap = logicals_in("UPDATE bagstore_map SET physical = ? WHERE logical", "");
    for st in remap.statements(logicals) {
        st.bind(sqlx::query(&st.sql).bind(target), |q, k| q.bind(*k)).execute(&mut *tx).await.on(s)?;
    }
    for (shard, shard_epoch) in [(source, source_epoch), (target, target_epoch)] {
        sqlx::query("UPDATE bagstore_physical SET epoch = GREATEST(epoch, ?) WHERE id = ?")
            .bind(shard_epoch)
            .bind(shard)
            .execute(&mut *tx)
            .await
            .on(s)?;
    }
    sqlx::query("UPDATE bagstore_cluster SET epoch = ? WHERE id = 1")
        .bind(new_epoch)
        .execute(&mut *tx)
        .await
        .on(s)?;
    // `changed` always changes, so a matched row always counts as affected.
    let moved = sqlx::query(
        "UPDATE bagstore_moves SET phase = 'cleanup', changed = NOW(6) WHERE id = ? AND phase = 'cutover'",
    )
    .bind(move_id)
    .execute(&mut *tx)
    .await
    .on(s)?;
    if moved.rows_affected() == 0 {
        // Rolled back with the transaction: the map as the other run left it.
        return Err(StoreError::MovePhaseMoved { id: move_id, expected: Phase::Cutover.as_str() });
    }
    tx.commit().await.on(s)?;
    Ok(new_epoch)
}

/// The cluster's current epoch (a cheap check for a changed map).
pub async fn cluster_epoch(meta: &MySqlPool) -> Result<u64> {
    let (e,): (u64,) = sqlx::query_as("SELECT epoch FROM bagstore_cluster WHERE id = 1")
        .fetch_one(meta)
        .await
        .on(META_SHARD)?;
    Ok(e)
}

/// Entity rows per logical shard on one shard (for `shards list` and the
/// rebalance's progress).
pub async fn rows_per_logical(shard: usize, pool: &MySqlPool) -> Result<BTreeMap<u16, u64>> {
    let rows: Vec<(u16, i64)> = sqlx::query_as("SELECT logical, COUNT(*) FROM entities GROUP BY logical")
        .fetch_all(pool)
        .await
        .on(shard)?;
    Ok(rows.into_iter().map(|(k, n)| (k, n as u64)).collect())
}

/// How many times the primaries of `source` and `target` changed, as the
/// metadata shard's map says now (see [`flip`]).
pub async fn failovers(meta: &MySqlPool, source: PhysicalId, target: PhysicalId) -> Result<(u64, u64)> {
    let count = |id: PhysicalId| async move {
        let (n,): (u64,) = sqlx::query_as("SELECT failovers FROM bagstore_physical WHERE id = ?")
            .bind(id)
            .fetch_one(meta)
            .await
            .on(META_SHARD)?;
        Ok::<u64, StoreError>(n)
    };
    Ok((count(source).await?, count(target).await?))
}
