//! Statements about a server's part in MariaDB replication: its role and
//! position, what semi-synchronous replication needs of it, and the steps
//! of pointing a replica at a primary, fencing a primary and promoting a
//! replica. Replication here is MariaDB's (GTID, built-in semi-sync,
//! `MASTER_GTID_WAIT`).
//!
//! Why each setting matters (see [`check_server`]):
//! - semi-sync with wait point `AFTER_SYNC`: a commit is acknowledged, and
//!   visible to other sessions (the relay among them), only once a replica
//!   has its transaction in its relay log; `AFTER_COMMIT`, MariaDB's
//!   default, makes it visible before, so a relay could publish a write a
//!   failover then loses. Only the primary waits: a replica that did would
//!   wait, for each transaction it applies, on replicas it does not have;
//! - a timeout near its maximum: past it MariaDB falls back to asynchronous
//!   replication without a word, and an acknowledged write then lives on
//!   the primary alone;
//! - GTID strict mode and `log_slave_updates`: every server's position is
//!   comparable and complete, so the most advanced replica can be told and
//!   can serve the others after a promotion;
//! - `read_only` on replicas, and an account without `SUPER` or
//!   `READ_ONLY ADMIN`: `read_only` then refuses bagstore's writes there;
//! - row format, and a binary log kept long enough for a replica that was
//!   down to catch up.

use schemas::gtid::{BadGtid, GtidPos};
use sqlx::{MySqlConnection, Row};
use std::time::Duration;

use crate::error::{OnShard, Result, StoreError};

/// The semi-sync timeout a server must have at least (ms): MariaDB takes
/// up to 2^64 - 1. Anything this long is never reached in practice, so a
/// commit waits for its acknowledgement instead of silently going
/// asynchronous.
pub const SEMI_SYNC_TIMEOUT_MIN_MS: u64 = 1 << 62;
/// The shortest binary-log retention accepted (0, keep forever, too): a
/// replica down for less than this catches up from the log.
pub const BINLOG_RETENTION_MIN_SECS: u64 = 86_400;

/// A replica's view of its primary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaState {
    pub master_host: String,
    pub master_port: u16,
    pub io_running: bool,
    pub sql_running: bool,
    /// What it has received from its primary (`Gtid_IO_Pos`).
    pub received: GtidPos,
    /// `Seconds_Behind_Master` (None while a thread is stopped).
    pub lag_secs: Option<u64>,
    /// The last I/O or SQL error, if any.
    pub last_error: Option<String>,
}

/// One server's replication state, as roles and lag are judged by it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerState {
    pub server_id: u32,
    pub read_only: bool,
    /// What the server holds, committed (`@@gtid_current_pos`).
    pub current: GtidPos,
    /// Set when the server replicates from a primary (or was told to).
    pub replica: Option<ReplicaState>,
    /// Semi-sync replicas connected to it now (`Rpl_semi_sync_master_clients`).
    pub semi_sync_clients: u64,
    /// Whether its commits wait for an acknowledgement now
    /// (`Rpl_semi_sync_master_status`): off means asynchronous.
    pub semi_sync_on: bool,
    /// Commits waiting for an acknowledgement now
    /// (`Rpl_semi_sync_master_wait_sessions`): a primary a failover left
    /// behind has them until it is restarted.
    pub waiting_commits: u64,
}

fn bad_gtid(shard: usize, e: BadGtid) -> StoreError {
    StoreError::BadTopology(format!("shard {shard}: {e}"))
}

/// Reads the server's state: its variables, its replica threads, its
/// semi-sync status.
pub async fn server_state(shard: usize, conn: &mut MySqlConnection) -> Result<ServerState> {
    let (server_id, read_only, current): (String, String, String) = sqlx::query_as(
        "SELECT CAST(@@server_id AS CHAR), CAST(@@read_only AS CHAR), CAST(@@gtid_current_pos AS CHAR)",
    )
    .fetch_one(&mut *conn)
    .await
    .on(shard)?;
    let SemiSync { clients, on, waiting } = semi_sync(shard, conn).await?;
    Ok(ServerState {
        server_id: server_id.trim().parse().unwrap_or(0),
        read_only: is_on(&read_only),
        current: GtidPos::parse(&current).map_err(|e| bad_gtid(shard, e))?,
        replica: replica_state(shard, conn).await?,
        semi_sync_clients: clients,
        semi_sync_on: on,
        waiting_commits: waiting,
    })
}

/// What the server holds, committed (`@@gtid_current_pos`): one statement,
/// for a watch that compares servers often.
pub async fn current_position(shard: usize, conn: impl sqlx::MySqlExecutor<'_>) -> Result<GtidPos> {
    let text: String =
        sqlx::query_scalar("SELECT CAST(@@gtid_current_pos AS CHAR)").fetch_one(conn).await.on(shard)?;
    GtidPos::parse(&text).map_err(|e| bad_gtid(shard, e))
}

/// A primary's semi-sync status.
struct SemiSync {
    /// Replicas connected now (`Rpl_semi_sync_master_clients`).
    clients: u64,
    /// Whether commits wait for one (`Rpl_semi_sync_master_status`).
    on: bool,
    /// Commits waiting now (`Rpl_semi_sync_master_wait_sessions`).
    waiting: u64,
}

async fn semi_sync(shard: usize, conn: &mut MySqlConnection) -> Result<SemiSync> {
    let status = sqlx::query(
        "SHOW GLOBAL STATUS WHERE Variable_name IN ('Rpl_semi_sync_master_clients', \
         'Rpl_semi_sync_master_status', 'Rpl_semi_sync_master_wait_sessions')",
    )
    .fetch_all(&mut *conn)
    .await
    .on(shard)?;
    let mut out = SemiSync { clients: 0, on: false, waiting: 0 };
    for row in status {
        let (name, value): (String, String) = (row.try_get(0).on(shard)?, row.try_get(1).on(shard)?);
        match name.as_str() {
            "Rpl_semi_sync_master_clients" => out.clients = value.trim().parse().unwrap_or(0),
            "Rpl_semi_sync_master_wait_sessions" => out.waiting = value.trim().parse().unwrap_or(0),
            _ => out.on = value.eq_ignore_ascii_case("ON"),
        }
    }
    Ok(out)
}

/// [`semi_sync`] of the primary behind `pool` (the writer's watch, see
/// the acks module): acknowledging replicas connected, commits waiting.
pub async fn acknowledging(shard: usize, pool: &sqlx::MySqlPool) -> Result<(u64, bool)> {
    let mut conn = pool.acquire().await.on(shard)?;
    let s = semi_sync(shard, &mut conn).await?;
    Ok((s.clients, s.on))
}

/// `SHOW SLAVE STATUS`, when the server has a primary configured.
pub async fn replica_state(shard: usize, conn: &mut MySqlConnection) -> Result<Option<ReplicaState>> {
    let Some(row) = sqlx::query("SHOW SLAVE STATUS").fetch_optional(&mut *conn).await.on(shard)? else {
        return Ok(None);
    };
    // Read every column as text: the server's types differ by column and
    // by version, the meaning does not.
    let text = |name: &str| -> Option<String> {
        row.try_get::<Option<String>, _>(name)
            .ok()
            .flatten()
            .or_else(|| row.try_get::<Option<i64>, _>(name).ok().flatten().map(|n| n.to_string()))
            .or_else(|| row.try_get::<Option<u64>, _>(name).ok().flatten().map(|n| n.to_string()))
    };
    let received = text("Gtid_IO_Pos").unwrap_or_default();
    let errors: Vec<String> = ["Last_IO_Error", "Last_SQL_Error"]
        .iter()
        .filter_map(|c| text(c))
        .filter(|e| !e.is_empty())
        .collect();
    Ok(Some(ReplicaState {
        master_host: text("Master_Host").unwrap_or_default(),
        master_port: text("Master_Port").and_then(|p| p.parse().ok()).unwrap_or(0),
        io_running: text("Slave_IO_Running").is_some_and(|v| v == "Yes"),
        sql_running: text("Slave_SQL_Running").is_some_and(|v| v == "Yes"),
        received: GtidPos::parse(&received).map_err(|e| bad_gtid(shard, e))?,
        lag_secs: text("Seconds_Behind_Master").and_then(|s| s.parse().ok()),
        last_error: (!errors.is_empty()).then(|| errors.join("; ")),
    }))
}

/// What a server's role needs of it, as a replicated shard's server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Primary,
    Replica,
}

/// What is wrong with the server for replication without loss, one
/// sentence each naming the setting and what to set it to (empty: all
/// is well). `server_id` uniqueness across a shard's servers is the
/// caller's to compare. Whether the server waits for acknowledgements
/// (`rpl_semi_sync_master_enabled`) is not checked: bagstore sets it with
/// the server's role ([`replicate_from`], [`promote`], [`require_acks`]).
pub async fn check_server(shard: usize, conn: &mut MySqlConnection, role: Role) -> Result<Vec<String>> {
    let row = sqlx::query(
        "SELECT CAST(@@log_bin AS CHAR) AS log_bin, CAST(@@binlog_format AS CHAR) AS format, \
         CAST(@@gtid_strict_mode AS CHAR) AS strict, CAST(@@log_slave_updates AS CHAR) AS slave_updates, \
         CAST(@@rpl_semi_sync_slave_enabled AS CHAR) AS slave_on, \
         CAST(@@rpl_semi_sync_master_wait_point AS CHAR) AS wait_point, \
         CAST(@@rpl_semi_sync_master_timeout AS CHAR) AS timeout, \
         CAST(@@read_only AS CHAR) AS read_only, \
         CAST(@@binlog_expire_logs_seconds AS CHAR) AS retention, \
         CAST(@@log_bin_trust_function_creators AS CHAR) AS trust_creators",
    )
    .fetch_one(&mut *conn)
    .await
    .on(shard)?;
    let get = |c: &str| row.try_get::<String, _>(c).unwrap_or_default();
    let mut wrong = Vec::new();
    let mut want = |ok: bool, what: &str| {
        if !ok {
            wrong.push(what.to_string());
        }
    };
    want(is_on(&get("log_bin")), "the binary log is off (set log_bin)");
    want(get("format") == "ROW", "binlog_format must be ROW");
    want(is_on(&get("strict")), "gtid_strict_mode must be ON");
    want(is_on(&get("slave_updates")), "log_slave_updates must be ON (a promoted replica serves the others)");
    want(is_on(&get("slave_on")), "rpl_semi_sync_slave_enabled must be ON (a replica acknowledges commits)");
    want(
        get("wait_point").eq_ignore_ascii_case("AFTER_SYNC"),
        "rpl_semi_sync_master_wait_point must be AFTER_SYNC (MariaDB's default AFTER_COMMIT shows a write \
         before a replica holds it)",
    );
    want(
        get("timeout").parse::<u64>().is_ok_and(|t| t >= SEMI_SYNC_TIMEOUT_MIN_MS),
        "rpl_semi_sync_master_timeout must be near its maximum (18446744073709551615): past it MariaDB \
         silently falls back to asynchronous replication",
    );
    let retention: u64 = get("retention").parse().unwrap_or(0);
    want(
        retention == 0 || retention >= BINLOG_RETENTION_MIN_SECS,
        "binlog_expire_logs_seconds must be 0 or at least 86400, so a replica that was down can catch up",
    );
    // A move creates its journal triggers as the services' account, which
    // holds no SUPER: with the binary log on, MariaDB refuses that unless
    // it trusts function creators.
    want(
        is_on(&get("trust_creators")),
        "log_bin_trust_function_creators must be ON (a move creates triggers as an account without SUPER, \
         which the binary log otherwise refuses)",
    );
    if role == Role::Replica {
        want(is_on(&get("read_only")), "read_only must be ON on a replica");
    }
    if let Some(privilege) = unsafe_privilege(shard, conn).await? {
        wrong.push(format!(
            "the account holds {privilege}, so read_only does not stop its writes: revoke SUPER and \
             READ_ONLY ADMIN from the account bagstore's services use"
        ));
    }
    Ok(wrong)
}

/// `SUPER` or `READ_ONLY ADMIN` (or all privileges) among the current
/// account's global grants, if held.
pub async fn unsafe_privilege(shard: usize, conn: &mut MySqlConnection) -> Result<Option<&'static str>> {
    let grants: Vec<String> = sqlx::query_scalar("SHOW GRANTS").fetch_all(&mut *conn).await.on(shard)?;
    for g in grants.iter().map(|g| g.to_ascii_uppercase()) {
        if !g.contains(" ON *.* ") {
            continue;
        }
        if g.starts_with("GRANT ALL PRIVILEGES") {
            return Ok(Some("ALL PRIVILEGES"));
        }
        for p in ["SUPER", "READ_ONLY ADMIN"] {
            if g.contains(&format!(" {p},"))
                || g.contains(&format!(" {p} ON"))
                || g.contains(&format!(", {p}"))
            {
                return Ok(Some(if p == "SUPER" { "SUPER" } else { "READ_ONLY ADMIN" }));
            }
        }
    }
    Ok(None)
}

/// Where a replica replicates from, and as whom.
#[derive(Clone)]
pub struct Source {
    pub host: String,
    pub port: u16,
    pub user: String,
    pub password: String,
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}:{}", self.user, self.host, self.port)
    }
}

/// Makes the server a replica of `source`, from position `from` (a seed's:
/// the position its copy was taken at) or else from the transactions it
/// holds (`gtid_slave_pos` set to its own current position, so a revived
/// primary continues where it is), read-only, no longer waiting for
/// acknowledgements of its own, and starts it. Needs `READ_ONLY ADMIN`
/// (the admin account).
pub async fn replicate_from(
    shard: usize,
    conn: &mut MySqlConnection,
    source: &Source,
    from: Option<&GtidPos>,
) -> Result<()> {
    sqlx::query("SET GLOBAL read_only = 1").execute(&mut *conn).await.on(shard)?;
    sqlx::query("SET GLOBAL rpl_semi_sync_master_enabled = 0").execute(&mut *conn).await.on(shard)?;
    sqlx::query("STOP SLAVE").execute(&mut *conn).await.on(shard)?;
    match from {
        Some(pos) => {
            sqlx::query("SET GLOBAL gtid_slave_pos = ?").bind(pos.to_string()).execute(&mut *conn).await
        }
        None => sqlx::query("SET GLOBAL gtid_slave_pos = @@gtid_current_pos").execute(&mut *conn).await,
    }
    .on(shard)?;
    // CHANGE MASTER takes no placeholders; the values are quoted here.
    let sql = format!(
        "CHANGE MASTER TO MASTER_HOST = {}, MASTER_PORT = {}, MASTER_USER = {}, MASTER_PASSWORD = {}, \
         MASTER_USE_GTID = slave_pos, MASTER_CONNECT_RETRY = 1",
        quote(&source.host),
        source.port,
        quote(&source.user),
        quote(&source.password)
    );
    sqlx::Executor::execute(&mut *conn, sql.as_str()).await.on(shard)?;
    sqlx::query("START SLAVE").execute(&mut *conn).await.on(shard)?;
    Ok(())
}

/// Whether the server's binary log still holds every transaction it ever
/// logged (none purged): a new replica can then start from nothing
/// instead of from a seed. MariaDB tells it by the GTID state at the start
/// of the oldest log file (empty when nothing came before it).
pub async fn history_complete(shard: usize, conn: &mut MySqlConnection) -> Result<bool> {
    let logs = sqlx::query("SHOW BINARY LOGS").fetch_all(&mut *conn).await.on(shard)?;
    let Some(first) = logs.first() else { return Ok(false) };
    let file: String = first.try_get(0).on(shard)?;
    let before: Option<String> = sqlx::query_scalar("SELECT BINLOG_GTID_POS(?, 4)")
        .bind(&file)
        .fetch_one(&mut *conn)
        .await
        .on(shard)?;
    Ok(before.is_some_and(|p| p.trim().is_empty()))
}

/// Stops the server replicating and forgets its primary (a replica taken
/// out of its shard; it stays read-only).
pub async fn stop_replicating(shard: usize, conn: &mut MySqlConnection) -> Result<()> {
    sqlx::query("STOP SLAVE").execute(&mut *conn).await.on(shard)?;
    sqlx::query("RESET SLAVE ALL").execute(&mut *conn).await.on(shard)?;
    Ok(())
}

/// How many tables database `db` has on the server (0: absent or empty).
pub async fn tables_in(shard: usize, conn: &mut MySqlConnection, db: &str) -> Result<u64> {
    let (n,): (i64,) =
        sqlx::query_as("SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = ?")
            .bind(db)
            .fetch_one(&mut *conn)
            .await
            .on(shard)?;
    Ok(n as u64)
}

/// A boolean variable cast to text: `ON`, or `1` from older servers.
fn is_on(v: &str) -> bool {
    let v = v.trim();
    v == "1" || v.eq_ignore_ascii_case("ON")
}

/// A string literal for a statement that takes no placeholders.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\\', "\\\\").replace('\'', "''"))
}

/// Stops taking transactions from the primary (the I/O thread): the
/// primary then has one acknowledging replica less. The SQL thread goes
/// on applying what was received.
pub async fn stop_receiving(shard: usize, conn: &mut MySqlConnection) -> Result<()> {
    sqlx::query("STOP SLAVE IO_THREAD").execute(&mut *conn).await.on(shard)?;
    Ok(())
}

/// Waits until the replica has applied everything it received (up to
/// `timeout`); true when it has.
pub async fn wait_applied(shard: usize, conn: &mut MySqlConnection, timeout: Duration) -> Result<bool> {
    let Some(r) = replica_state(shard, conn).await? else { return Ok(true) };
    wait_for(shard, conn, &r.received, timeout).await
}

/// `MASTER_GTID_WAIT`: waits until the server holds `pos` (up to
/// `timeout`); true when it does.
pub async fn wait_for(
    shard: usize,
    conn: &mut MySqlConnection,
    pos: &GtidPos,
    timeout: Duration,
) -> Result<bool> {
    if pos.is_empty() {
        return Ok(true);
    }
    let waited: Option<i64> = sqlx::query_scalar("SELECT MASTER_GTID_WAIT(?, ?)")
        .bind(pos.to_string())
        .bind(timeout.as_secs_f64())
        .fetch_one(&mut *conn)
        .await
        .on(shard)?;
    Ok(waited == Some(0))
}

/// Makes the server a primary: replication stopped and forgotten, its
/// commits waiting for a replica's acknowledgement, writes allowed (in
/// that order: no write is taken before semi-sync is on). Needs
/// `READ_ONLY ADMIN` (the admin account).
pub async fn promote(shard: usize, conn: &mut MySqlConnection) -> Result<()> {
    sqlx::query("STOP SLAVE").execute(&mut *conn).await.on(shard)?;
    sqlx::query("RESET SLAVE ALL").execute(&mut *conn).await.on(shard)?;
    sqlx::query("SET GLOBAL rpl_semi_sync_master_enabled = 1").execute(&mut *conn).await.on(shard)?;
    sqlx::query("SET GLOBAL read_only = 0").execute(&mut *conn).await.on(shard)?;
    Ok(())
}

/// Makes the server's commits wait for a replica's acknowledgement (a
/// primary of a shard with replicas), or not (a shard without).
pub async fn require_acks(shard: usize, conn: &mut MySqlConnection, on: bool) -> Result<()> {
    let sql = if on {
        "SET GLOBAL rpl_semi_sync_master_enabled = 1"
    } else {
        "SET GLOBAL rpl_semi_sync_master_enabled = 0"
    };
    sqlx::query(sql).execute(&mut *conn).await.on(shard)?;
    Ok(())
}

/// Refuses writes on the server from accounts without `READ_ONLY ADMIN`.
pub async fn set_read_only(shard: usize, conn: &mut MySqlConnection, on: bool) -> Result<()> {
    let sql = if on { "SET GLOBAL read_only = 1" } else { "SET GLOBAL read_only = 0" };
    sqlx::query(sql).execute(&mut *conn).await.on(shard)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_in_change_master_are_quoted() {
        assert_eq!(quote("plain"), "'plain'");
        assert_eq!(quote("it's"), "'it''s'");
        assert_eq!(quote("back\\slash"), "'back\\\\slash'");
    }
}
