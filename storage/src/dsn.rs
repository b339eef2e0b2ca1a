//! DSNs: what the map records of a server (its address, without the
//! password), the credentials a process adds back, and connections made
//! from them outside any pool.

use schemas::settings::Dsn;
use sqlx::mysql::MySqlConnectOptions;
use sqlx::{Connection, MySqlConnection};
use std::str::FromStr;

use crate::error::{Result, StoreError};

pub fn connect_options(dsn: &Dsn) -> Result<MySqlConnectOptions> {
    MySqlConnectOptions::from_str(dsn.expose())
        .map_err(|source| StoreError::BadDsn { dsn: dsn.redacted(), source })
}

/// `address` (a DSN whose password was left out) with the user and password
/// of `from` (another DSN). Only the part before `@` changes.
pub fn with_credentials_of(address: &str, from: &str) -> String {
    let userinfo = |s: &str| -> Option<(usize, usize)> {
        let start = s.find("://")? + 3;
        let at = s[start..].find('@')? + start;
        Some((start, at))
    };
    let Some((fs, fa)) = userinfo(from) else { return address.to_string() };
    let creds = &from[fs..fa];
    match (address.find("://"), userinfo(address)) {
        (_, Some((s, a))) => format!("{}{creds}{}", &address[..s], &address[a..]),
        (Some(p), None) => format!("{}{creds}@{}", &address[..p + 3], &address[p + 3..]),
        (None, None) => address.to_string(),
    }
}

/// `dsn` without its password: what the map records as a shard's address.
pub fn address_of(dsn: &Dsn) -> String {
    let s = dsn.expose();
    let Some(start) = s.find("://").map(|p| p + 3) else { return s.to_string() };
    let Some(at) = s[start..].find('@').map(|a| a + start) else { return s.to_string() };
    let user = s[start..at].split(':').next().unwrap_or("");
    // Query-string passwords go too.
    let (base, query) = s.split_once('?').unwrap_or((s, ""));
    let kept: Vec<&str> = query
        .split('&')
        .filter(|kv| !kv.is_empty() && !kv.to_ascii_lowercase().starts_with("password="))
        .collect();
    let base = format!("{}{user}{}", &base[..start], &base[at..]);
    if kept.is_empty() {
        base
    } else {
        format!("{base}?{}", kept.join("&"))
    }
}

/// `host:port/database` of a DSN, lower-cased host, what tells two
/// servers (or two databases on one) apart whatever the credentials and
/// options around them.
pub fn place_of(dsn: &str) -> String {
    let rest = dsn.split_once("://").map_or(dsn, |(_, r)| r);
    let rest = rest.split_once('?').map_or(rest, |(b, _)| b);
    let hostpart = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    let (host, db) = hostpart.split_once('/').unwrap_or((hostpart, ""));
    let host = host.to_ascii_lowercase();
    let host = if host.contains(':') { host } else { format!("{host}:3306") };
    format!("{host}/{db}")
}

/// A connection of its own to one server (outside any pool).
pub type ServerConnection = MySqlConnection;

/// A dedicated connection outside any pool (relay leadership lives on one).
pub async fn dedicated_connection(dsn: &Dsn) -> Result<MySqlConnection, sqlx::Error> {
    MySqlConnection::connect_with(&MySqlConnectOptions::from_str(dsn.expose())?).await
}

/// The database named by a DSN, and the DSN without it (for `CREATE DATABASE`).
pub fn split_database(dsn: &Dsn) -> Option<(String, Dsn)> {
    let s = dsn.expose();
    let (base, query) = match s.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (s, None),
    };
    let after_scheme = base.find("://")? + 3;
    let slash = base[after_scheme..].find('/')? + after_scheme;
    let db = &base[slash + 1..];
    if db.is_empty() {
        return None;
    }
    let server = match query {
        Some(q) => format!("{}?{}", &base[..slash], q),
        None => base[..slash].to_string(),
    };
    Some((db.to_string(), Dsn(server)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_place_is_host_port_and_database_whatever_the_credentials() {
        assert_eq!(place_of("mysql://app:pw@DB3:3306/bagstore?ssl-mode=REQUIRED"), "db3:3306/bagstore");
        assert_eq!(place_of("mysql://app@db3/bagstore"), "db3:3306/bagstore");
        assert_eq!(place_of("mysql://root@127.0.0.1:41231/b"), "127.0.0.1:41231/b");
        assert_ne!(place_of("mysql://r@h:1/a"), place_of("mysql://r@h:2/a"));
    }

    #[test]
    fn database_names_split_off_dsns() {
        let (db, server) =
            split_database(&Dsn("mysql://root:pw@127.0.0.1:3307/bagstore?ssl-mode=disabled".into())).unwrap();
        assert_eq!(db, "bagstore");
        assert_eq!(server.expose(), "mysql://root:pw@127.0.0.1:3307?ssl-mode=disabled");
        assert!(split_database(&Dsn("mysql://root@host:1".into())).is_none());
    }

    #[test]
    fn addresses_drop_passwords_and_take_credentials_back() {
        let dsn = Dsn("mysql://app:hunter2@db3:3306/bagstore?ssl-mode=REQUIRED&password=x".into());
        assert_eq!(address_of(&dsn), "mysql://app@db3:3306/bagstore?ssl-mode=REQUIRED");
        assert_eq!(address_of(&Dsn("mysql://root@h:1/b".into())), "mysql://root@h:1/b");
        let meta = "mysql://app:s3cret@db1:3306/bagstore";
        assert_eq!(
            with_credentials_of("mysql://app@db3:3306/bagstore?ssl-mode=REQUIRED", meta),
            "mysql://app:s3cret@db3:3306/bagstore?ssl-mode=REQUIRED"
        );
        assert_eq!(with_credentials_of("mysql://db3/b", meta), "mysql://app:s3cret@db3/b");
    }
}
