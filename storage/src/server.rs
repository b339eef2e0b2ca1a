//! Statements about a MySQL server itself rather than a cluster's data:
//! for `devstack`, which brings up private servers for `bagstore dev` and
//! the tests, and for the mover's throttle.

use sqlx::mysql::MySqlPool;
use sqlx::{MySqlConnection, Row};

use crate::error::{OnShard, Result};

/// Queries running on the server right now (`Threads_running`): how busy
/// it is.
pub async fn threads_running(shard: usize, pool: &MySqlPool) -> Result<u64> {
    let row = sqlx::query("SHOW GLOBAL STATUS LIKE 'Threads_running'").fetch_one(pool).await.on(shard)?;
    let v: String = row.try_get(1).on(shard)?;
    Ok(v.trim().parse().unwrap_or(0))
}

/// The unix socket the server listens on (`@@socket`): tells a private
/// server from another one that took its port.
pub async fn socket(conn: &mut MySqlConnection) -> Result<String, sqlx::Error> {
    sqlx::query_scalar("SELECT @@socket").fetch_one(conn).await
}

/// Lets `root` log in over TCP without a password, for a data dir made
/// with socket authentication. Run through the `mariadb` client on the
/// server's socket (TCP is what it unlocks).
pub const ALLOW_ROOT_OVER_TCP: &str = "CREATE USER IF NOT EXISTS 'root'@'127.0.0.1'; \
     CREATE USER IF NOT EXISTS 'root'@'localhost'; \
     ALTER USER 'root'@'127.0.0.1', 'root'@'localhost' IDENTIFIED BY ''; \
     GRANT ALL ON *.* TO 'root'@'127.0.0.1', 'root'@'localhost' WITH GRANT OPTION;";
