//! Private replicated shards: a primary and its replicas, each a private
//! `mariadbd` started with [`Replicated`](crate::mariadb::Replicated)
//! settings, for `bagstore dev --replicas N` and the tests.
//!
//! Accounts, on every server: [`SERVICE_USER`], what bagstore's services
//! connect as (every privilege but `SUPER` and `READ_ONLY ADMIN`, so
//! `read_only` stops its writes, as production should run), and
//! [`REPLICATION_USER`], what replicas replicate as. `root` is the admin
//! account: it sets `read_only` when a server changes role.

use anyhow::{Context, Result};
use sqlx::{Connection, MySqlConnection};

use crate::mariadb::MariaDb;

/// The account bagstore's services use on a private replicated shard.
pub const SERVICE_USER: &str = "bagstore";
/// The account replicas replicate as, and its password (a private
/// loopback server's: nothing to keep secret).
pub const REPLICATION_USER: &str = "bagstore_repl";
pub const REPLICATION_PASSWORD: &str = "bagstore_repl";

/// Creates the accounts on `server` alone: with semi-sync on and no
/// replica connected yet, a write that goes to the binary log waits for an
/// acknowledgement that cannot come, so these are kept out of it (each
/// server gets its own, none replicates). Harmless to run again.
pub async fn create_accounts(server: &MariaDb) -> Result<()> {
    let mut conn = MySqlConnection::connect(&server.server_dsn()).await.context("connecting as root")?;
    for sql in [
        "SET SESSION sql_log_bin = 0".to_string(),
        format!("CREATE USER IF NOT EXISTS '{SERVICE_USER}'@'127.0.0.1'"),
        format!("GRANT ALL PRIVILEGES ON *.* TO '{SERVICE_USER}'@'127.0.0.1'"),
        format!("REVOKE SUPER, READ_ONLY ADMIN ON *.* FROM '{SERVICE_USER}'@'127.0.0.1'"),
        format!("CREATE USER IF NOT EXISTS '{REPLICATION_USER}'@'127.0.0.1' IDENTIFIED BY '{REPLICATION_PASSWORD}'"),
        format!("GRANT REPLICATION SLAVE ON *.* TO '{REPLICATION_USER}'@'127.0.0.1'"),
    ] {
        sqlx::Executor::execute(&mut conn, sql.as_str()).await.with_context(|| format!("running {sql}"))?;
    }
    let _ = conn.close().await;
    Ok(())
}

/// The DSN of database `db` on `server` as [`SERVICE_USER`].
pub fn service_dsn(server: &MariaDb, db: &str) -> String {
    format!("mysql://{SERVICE_USER}@127.0.0.1:{}/{db}", server.port())
}

/// Where replicas of `primary` replicate from.
pub fn source_of(primary: &MariaDb) -> storage::replication::Source {
    storage::replication::Source {
        host: "127.0.0.1".into(),
        port: primary.port(),
        user: REPLICATION_USER.into(),
        password: REPLICATION_PASSWORD.into(),
    }
}

/// Makes `replica` replicate from `primary` (as root: `read_only` needs
/// `READ_ONLY ADMIN`).
pub async fn replicate(replica: &MariaDb, primary: &MariaDb) -> Result<()> {
    let mut conn = MySqlConnection::connect(&replica.server_dsn()).await.context("connecting as root")?;
    storage::replication::replicate_from(0, &mut conn, &source_of(primary), None).await.with_context(
        || format!("making 127.0.0.1:{} a replica of 127.0.0.1:{}", replica.port(), primary.port()),
    )?;
    let _ = conn.close().await;
    Ok(())
}
