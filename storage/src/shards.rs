//! The shards of a cluster and how to reach them.

use schemas::settings::{Dsn, MysqlSettings};
use schemas::{shard_of, EntityId};
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::{Connection, MySqlConnection};
use std::str::FromStr;
use std::time::Duration;

use crate::error::{OnShard, Result, StoreError};

/// The shard that holds the cluster's own tables (see [`Shards::meta`]).
pub const META_SHARD: usize = 0;

/// Per shard, in shard order: a sqlx pool, and the ping-free connections
/// of the hot paths ([`crate::conns`]).
#[derive(Debug, Clone)]
pub struct Shards {
    pools: Vec<MySqlPool>,
    conns: Vec<std::sync::Arc<crate::conns::Conns>>,
    dsns: Vec<Dsn>,
}

pub fn connect_options(dsn: &Dsn) -> Result<MySqlConnectOptions> {
    MySqlConnectOptions::from_str(dsn.expose())
        .map_err(|source| StoreError::BadDsn { dsn: dsn.redacted(), source })
}

impl Shards {
    /// Pools connect lazily, so a service can start before MySQL is up and
    /// report the outage per request instead of refusing to start.
    pub fn connect_lazy(settings: &MysqlSettings) -> Result<Shards> {
        let mut pools = Vec::new();
        let mut conns = Vec::new();
        for (shard, dsn) in settings.shards.iter().enumerate() {
            let opts = connect_options(dsn)?;
            conns.push(std::sync::Arc::new(crate::conns::Conns::new(
                shard,
                opts.clone(),
                settings.max_connections,
            )));
            pools.push(
                MySqlPoolOptions::new()
                    .max_connections(settings.max_connections)
                    .acquire_timeout(Duration::from_millis(settings.connect_timeout_ms))
                    // READ COMMITTED: a locking read of an absent id takes no
                    // gap lock, so concurrent inserts of different new ids do
                    // not deadlock; two inserts of the same new id collide on
                    // the unique key instead, and the loser retries.
                    .after_connect(|conn, _| {
                        Box::pin(async move {
                            sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                                .execute(&mut *conn)
                                .await
                                .map(|_| ())
                        })
                    })
                    .connect_lazy_with(opts),
            );
        }
        Ok(Shards { pools, conns, dsns: settings.shards.clone() })
    }

    pub fn count(&self) -> usize {
        self.pools.len()
    }

    pub fn pool(&self, shard: usize) -> &MySqlPool {
        &self.pools[shard]
    }

    /// The metadata shard: the one well-known place of the cluster's own
    /// tables (index catalog, index progress; see [`crate::catalog`]).
    pub fn meta(&self) -> &MySqlPool {
        &self.pools[META_SHARD]
    }

    /// Runs `f` on every shard at once and returns the results in shard
    /// order: the one fan-out every cross-shard read and write uses.
    pub async fn each<'a, T, F, Fut>(&'a self, f: F) -> Vec<T>
    where
        F: Fn(usize, &'a MySqlPool) -> Fut,
        Fut: std::future::Future<Output = T> + 'a,
    {
        futures::future::join_all(self.pools.iter().enumerate().map(|(shard, pool)| f(shard, pool))).await
    }

    /// Runs `f` at once on every shard whose list in `work` (one per shard)
    /// is not empty; returns `(shard, result)` in shard order.
    pub async fn each_with<'a, W, T, F, Fut>(&'a self, work: &'a [Vec<W>], f: F) -> Vec<(usize, T)>
    where
        F: Fn(usize, &'a MySqlPool, &'a [W]) -> Fut,
        Fut: std::future::Future<Output = T> + 'a,
    {
        let jobs = work.iter().enumerate().filter(|(_, w)| !w.is_empty()).map(|(shard, w)| {
            let job = f(shard, &self.pools[shard], w);
            async move { (shard, job.await) }
        });
        futures::future::join_all(jobs).await
    }

    /// [`Shards::each`], stopping at the first error.
    pub async fn try_each<'a, T, F, Fut>(&'a self, f: F) -> Result<Vec<T>>
    where
        F: Fn(usize, &'a MySqlPool) -> Fut,
        Fut: std::future::Future<Output = Result<T>> + 'a,
    {
        self.each(f).await.into_iter().collect()
    }

    /// Ping-free connections for the hot paths (see [`crate::conns`]).
    pub fn conns(&self, shard: usize) -> &crate::conns::Conns {
        &self.conns[shard]
    }

    pub fn dsn(&self, shard: usize) -> &Dsn {
        &self.dsns[shard]
    }

    pub fn of_id(&self, id: &EntityId) -> usize {
        shard_of(id.as_bytes(), self.count())
    }

    /// `ids` grouped by the shard each lives on (one list per shard, in
    /// shard order, possibly empty), keeping their order: what a fan-out
    /// by entity needs.
    pub fn by_shard(&self, ids: &[EntityId]) -> Vec<Vec<EntityId>> {
        let mut out = vec![Vec::new(); self.count()];
        for id in ids {
            out[self.of_id(id)].push(*id);
        }
        out
    }

    /// Waits until every shard answers, up to `deadline`.
    pub async fn wait_ready(&self, deadline: Duration) -> Result<()> {
        let until = tokio::time::Instant::now() + deadline;
        for (shard, pool) in self.pools.iter().enumerate() {
            loop {
                match sqlx::query("SELECT 1").execute(pool).await {
                    Ok(_) => break,
                    Err(e) if tokio::time::Instant::now() >= until => return Err(e).on(shard),
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            }
        }
        Ok(())
    }

    pub async fn close(&self) {
        for p in &self.pools {
            p.close().await;
        }
    }
}

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
    fn database_names_split_off_dsns() {
        let (db, server) =
            split_database(&Dsn("mysql://root:pw@127.0.0.1:3307/bagstore?ssl-mode=disabled".into())).unwrap();
        assert_eq!(db, "bagstore");
        assert_eq!(server.expose(), "mysql://root:pw@127.0.0.1:3307?ssl-mode=disabled");
        assert!(split_database(&Dsn("mysql://root@host:1".into())).is_none());
    }
}
