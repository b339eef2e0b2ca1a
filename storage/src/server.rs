//! Statements about a MySQL server itself rather than a cluster's data,
//! for `devstack`, which brings up private servers for `bagstore dev` and
//! the tests.

use sqlx::MySqlConnection;

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
