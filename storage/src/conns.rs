//! Connections to one shard for the hot paths, reused without a ping.
//!
//! sqlx 0.8's pool pings a connection when it hands it out *and* again when
//! it takes it back: two extra round trips per statement. The bench showed
//! it (issue 7): MariaDB's `Com_admin_commands` grew by two for every
//! statement, and on this 2-core machine each round trip is mostly kernel
//! and wake-up time on both sides. The reader's statements and the writer's
//! commits use this list instead:
//!
//! - a connection in steady use is handed out as is; one idle for longer
//!   than [`PING_AFTER_IDLE`] is pinged first (and replaced if dead);
//! - after an error that is not the server's answer to a statement (I/O,
//!   protocol, the server killed the connection) the connection is dropped,
//!   never reused;
//! - [`Conns::settle`] has a read run again, once, on a new connection
//!   when the connection it reused turns out dead (a `KILL`, a server
//!   restart), so that costs no failed request. Writes decide themselves
//!   what may be retried.
//!
//! At most `max` connections are open at once (`mysql.max_connections`),
//! on top of the services' sqlx pools.

use sqlx::mysql::MySqlConnectOptions;
use sqlx::{ConnectOptions, Connection, MySqlConnection};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{OnShard, Result};

/// A connection idle longer than this is pinged before use.
pub const PING_AFTER_IDLE: Duration = Duration::from_secs(1);

/// Idle connections of one shard, and a cap on how many are open.
#[derive(Debug)]
pub struct Conns {
    shard: usize,
    options: MySqlConnectOptions,
    idle: Mutex<Vec<(Instant, MySqlConnection)>>,
    open: std::sync::Arc<Semaphore>,
}

/// A connection taken from [`Conns`]: give it back with [`Conns::give_back`]
/// after a success; dropping it closes it.
#[derive(Debug)]
pub struct Taken {
    pub conn: MySqlConnection,
    /// It had been used before (so it may have died meanwhile).
    pub reused: bool,
    _open: OwnedSemaphorePermit,
}

impl Conns {
    pub fn new(shard: usize, options: MySqlConnectOptions, max: u32) -> Conns {
        Conns {
            shard,
            options,
            idle: Mutex::new(Vec::new()),
            open: std::sync::Arc::new(Semaphore::new(max.max(1) as usize)),
        }
    }

    /// An idle connection (pinged if it idled long), or a new one.
    pub async fn take(&self) -> Result<Taken> {
        let permit = self.open.clone().acquire_owned().await.expect("the semaphore is never closed");
        loop {
            let popped = self.idle.lock().expect("not poisoned").pop();
            let Some((since, mut conn)) = popped else { break };
            if since.elapsed() < PING_AFTER_IDLE || conn.ping().await.is_ok() {
                return Ok(Taken { conn, reused: true, _open: permit });
            }
        }
        let conn = self.connect().await?;
        Ok(Taken { conn, reused: false, _open: permit })
    }

    async fn connect(&self) -> Result<MySqlConnection> {
        let mut conn = self.options.connect().await.on(self.shard)?;
        // As the sqlx pools: READ COMMITTED (see `Shards::connect_lazy`).
        sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .execute(&mut conn)
            .await
            .on(self.shard)?;
        Ok(conn)
    }

    pub fn give_back(&self, taken: Taken) {
        self.idle.lock().expect("not poisoned").push((Instant::now(), taken.conn));
    }

    /// After a read on `taken` ended with `result`: a success or a
    /// database's answer (an SQL error) gives the connection back; a dead
    /// connection is dropped, and if it was a reused one the read should run
    /// again: `Some(new connection)`. Reads only, as they may run twice:
    ///
    /// (The reader's `read_on!` wraps the loop: take, read, settle, and
    /// read again on `Some`.)
    pub async fn settle<T>(&self, taken: Taken, result: &Result<T>) -> Result<Option<Taken>> {
        match result {
            Err(e) if e.is_dead_connection() => {
                let again = taken.reused;
                drop(taken);
                if again {
                    Ok(Some(self.take_new().await?))
                } else {
                    Ok(None)
                }
            }
            _ => {
                self.give_back(taken);
                Ok(None)
            }
        }
    }

    /// A new connection, not an idle one.
    pub async fn take_new(&self) -> Result<Taken> {
        let permit = self.open.clone().acquire_owned().await.expect("the semaphore is never closed");
        Ok(Taken { conn: self.connect().await?, reused: false, _open: permit })
    }
}
