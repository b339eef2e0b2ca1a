//! Private `mariadbd` instances for `bagstore dev` and the test harness.
//!
//! Each instance owns one directory (`data/`, `error.log`, socket, pid file) and listens on a
//! loopback port, so several can run side by side without touching a system MariaDB.
//!
//! It runs under the death-pipe wrapper of [`crate::supervise`], so it stops when we do,
//! however we die.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use sqlx::{Connection, MySqlConnection};
use tokio::process::Command;

use crate::supervise::{
    create_dir, find_program, flag, free_port, is_root, log_tail, output_text, ServerCommand, Supervised,
};

/// How long startup may take before we give up and show error.log.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);
/// Attempts at picking a free port when another process grabs it before mariadbd binds.
const PORT_ATTEMPTS: usize = 5;

/// A private mariadbd serving one data directory on a loopback TCP port.
#[derive(Debug)]
pub struct MariaDb {
    port: u16,
    dir: PathBuf,
    /// mariadbd under its death-pipe wrapper.
    server: Supervised,
}

/// Knobs for [`MariaDb::start_with`]; the defaults suit `bagstore dev`.
#[derive(Debug, Clone, Default)]
pub struct MariaDbOptions {
    /// Delete the directory once mariadbd has exited (tests), even if we were killed.
    pub ephemeral: bool,
    /// A fixed port instead of a free one; a clash is then an error rather than a retry.
    pub port: Option<u16>,
    /// `--innodb-buffer-pool-size` (default `128M`); tests running many servers may want less.
    pub innodb_buffer_pool_size: Option<String>,
    /// Further `--option=value` server flags, appended last so they win.
    pub extra_args: Vec<String>,
    /// Runs as a server of a replicated shard (see [`Replicated`]); `None`:
    /// a lone server without a binary log.
    pub replicated: Option<Replicated>,
}

impl MariaDbOptions {
    /// The benchmarks' server size, one home for `bench` and the replicated
    /// shards `bench_replicas` runs, so their figures compare: a 2 GiB
    /// buffer pool (256 MiB for `--quick`), a 512 MiB redo log, each
    /// commit's binary log write synced (`--sync-binlog=1`, where the
    /// server logs at all).
    pub fn bench_sized(quick: bool) -> MariaDbOptions {
        MariaDbOptions {
            innodb_buffer_pool_size: Some(if quick { "256M" } else { "2G" }.into()),
            extra_args: vec!["--innodb-log-file-size=512M".into(), "--sync-binlog=1".into()],
            ..Default::default()
        }
    }
}

/// How a private server of a replicated shard runs. Every server runs
/// with what any role needs, so a replica can be promoted and a primary
/// can rejoin as a replica: the binary log in ROW format with GTID strict
/// mode and `log_slave_updates`, semi-sync acknowledgements as a replica,
/// semi-sync's wait point `AFTER_SYNC` with a timeout that never passes,
/// replication started only when bagstore says so (`--skip-slave-start`),
/// and function creators trusted (a move's triggers are created by an
/// account without `SUPER`). Whether its commits wait for acknowledgements
/// (`rpl_semi_sync_master_enabled`) bagstore sets with its role: a
/// replica that waited would wait, for every transaction it applies, on
/// replicas of its own it does not have, and a primary whose replicas are
/// not connected yet would take no write at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replicated {
    /// Distinct among the shard's servers (MariaDB ignores events of its own id).
    pub server_id: u32,
    /// Starts as a replica (`--init-rpl-role=SLAVE`, read-only): its crash
    /// recovery truncates a binary-log tail no replica acknowledged, as a
    /// primary that died must before it rejoins (MDEV-33465; without it the
    /// prepared tail is committed, a transaction the new primary never had).
    pub as_replica: bool,
}

impl Replicated {
    fn args(&self) -> Vec<String> {
        let mut args: Vec<String> = vec![
            "--log-bin=binlog".into(),
            "--binlog-format=ROW".into(),
            format!("--server-id={}", self.server_id),
            "--log-slave-updates=1".into(),
            "--gtid-strict-mode=1".into(),
            "--rpl-semi-sync-master-enabled=0".into(),
            "--rpl-semi-sync-slave-enabled=1".into(),
            "--rpl-semi-sync-master-wait-point=AFTER_SYNC".into(),
            "--rpl-semi-sync-master-timeout=18446744073709551615".into(),
            "--skip-slave-start".into(),
            // Moves create triggers as the services' account (no SUPER).
            "--log-bin-trust-function-creators=1".into(),
        ];
        if self.as_replica {
            args.push("--init-rpl-role=SLAVE".into());
            args.push("--read-only=1".into());
        }
        args
    }
}

impl MariaDb {
    /// Starts (initialising the data dir with mariadb-install-db on first use) a mariadbd
    /// with its files under `dir` (created if missing). Reuses existing data if `dir` already
    /// holds an initialised data dir, so data survives restarts. Picks a free port on 127.0.0.1.
    /// Returns once root can log in over TCP.
    pub async fn start(dir: &Path) -> Result<MariaDb> {
        Self::start_with(dir, MariaDbOptions::default()).await
    }

    /// Same as [`MariaDb::start`]; `opts.ephemeral` deletes `dir` after mariadbd exits.
    pub async fn start_with(dir: &Path, opts: MariaDbOptions) -> Result<MariaDb> {
        let mariadbd = find_program(&["mariadbd", "mysqld"], &[])
            .context("mariadbd not found on PATH or in /usr/sbin: install mariadb-server (./scripts/dev and ./scripts/test do)")?;
        create_dir(dir).await?;
        // Absolute, because the wrapper may `rm -rf` it and mariadbd resolves paths itself.
        let dir = dir.canonicalize().with_context(|| format!("resolving {}", dir.display()))?;
        for _ in 0..PORT_ATTEMPTS {
            // Again each time: a failed ephemeral attempt removes the directory.
            create_dir(&dir.join("tmp")).await?;
            init_datadir(&dir).await?;
            let port = match opts.port {
                Some(port) => port,
                None => free_port()?,
            };
            if let Some(db) = launch(&dir, &mariadbd, port, &opts).await? {
                return Ok(db);
            }
            ensure!(opts.port.is_none(), "port {port} on 127.0.0.1 is already in use");
            tracing::warn!(port, "port taken before mariadbd could bind it; retrying");
        }
        bail!("mariadbd lost the race for a free port {PORT_ATTEMPTS} times")
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's pid, for tests that want to check it really went away.
    pub fn pid(&self) -> u32 {
        self.server.pid()
    }

    /// DSN for database `db`: `mysql://root@127.0.0.1:<port>/<db>`
    pub fn dsn(&self, db: &str) -> String {
        format!("{}/{db}", self.server_dsn())
    }

    /// DSN with no database: `mysql://root@127.0.0.1:<port>`
    pub fn server_dsn(&self) -> String {
        format!("mysql://root@127.0.0.1:{}", self.port)
    }

    /// Graceful stop: SIGTERM (via the wrapper), wait up to 30 s for exit, then SIGKILL.
    /// Fails if mariadbd exited unsuccessfully, e.g. because it had crashed earlier.
    pub async fn stop(mut self) -> Result<()> {
        let status = self.server.shutdown().await?;
        ensure!(
            status.success(),
            "mariadbd (pid {}) exited with {status}; see {}",
            self.server.pid(),
            self.dir.join("error.log").display()
        );
        Ok(())
    }

    /// Polls a TCP login as root to this very server until it succeeds. If the server rejects
    /// it (a data dir initialised elsewhere, e.g. with socket auth), fixes the accounts once
    /// over the unix socket and goes on polling.
    async fn wait_ready(&self) -> Result<()> {
        let ours = self.dir.join("mysqld.sock");
        let mut fixed = false;
        loop {
            match MySqlConnection::connect(&self.server_dsn()).await {
                Ok(mut conn) => {
                    let socket = storage::server::socket(&mut conn).await;
                    let _ = conn.close().await;
                    // Someone else's mariadbd may hold "our" port; ours then exits with a bind
                    // error, which `launch` sees. Until then, that server does not count.
                    if socket.is_ok_and(|s| ours.to_str().is_none_or(|o| o == s)) {
                        return Ok(());
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(sqlx::Error::Database(e)) if is_access_denied(e.as_ref()) => {
                    ensure!(!fixed, "root still cannot log in over TCP after fixing accounts: {e}");
                    tracing::info!(error = %e, "root cannot log in over TCP; fixing via socket");
                    self.allow_root_over_tcp().await?;
                    fixed = true;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    async fn allow_root_over_tcp(&self) -> Result<()> {
        let client = find_program(&["mariadb", "mysql"], &[]).context("no mariadb client found")?;
        let sql = storage::server::ALLOW_ROOT_OVER_TCP;
        let out = Command::new(client)
            .args(["--no-defaults", "--user=root", "-e", sql])
            .arg(flag("--socket=", &self.dir.join("mysqld.sock")))
            .stdin(Stdio::null())
            .output()
            .await
            .context("running the mariadb client")?;
        ensure!(out.status.success(), "fixing root accounts failed: {}", output_text(&out));
        Ok(())
    }
}

/// Starts mariadbd on `port` and waits for it. `Ok(None)` means it lost the port to someone
/// else and has been cleaned up.
async fn launch(dir: &Path, mariadbd: &Path, port: u16, opts: &MariaDbOptions) -> Result<Option<MariaDb>> {
    let started = Instant::now();
    let log = dir.join("error.log");
    let log_start = std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
    let (server, mut exit) = Supervised::spawn(ServerCommand {
        name: "mariadbd",
        dir,
        ephemeral: opts.ephemeral,
        stop_signal: "TERM", // a clean InnoDB shutdown
        program: mariadbd,
        args: server_args(dir, port, opts),
    })
    .await?;
    let pid = server.pid();
    let mut db = MariaDb { port, dir: dir.to_owned(), server };

    let outcome = tokio::time::timeout(STARTUP_TIMEOUT, async {
        tokio::select! {
            ready = db.wait_ready() => ready.map(|()| true),
            _ = exit.exited() => Ok(false), // the wrapper reports mariadbd's exit
        }
    })
    .await;
    if let Ok(Ok(true)) = outcome {
        tracing::info!(pid, port, dir = %dir.display(), elapsed = ?started.elapsed(), "mariadbd ready");
        return Ok(Some(db));
    }
    // Read the log before shutting down: an ephemeral wrapper deletes it.
    let tail = log_tail(&log, log_start);
    let _ = db.server.shutdown().await;
    let why = match outcome {
        Ok(Ok(_)) if tail.contains("Address already in use") => return Ok(None),
        Ok(Ok(_)) => "mariadbd exited during startup".to_owned(),
        Ok(Err(e)) => format!("{e:#}"),
        Err(_) => format!("mariadbd did not accept connections within {STARTUP_TIMEOUT:?}"),
    };
    bail!("starting mariadbd in {}: {why}\n--- tail of error.log ---\n{tail}", dir.display())
}

fn server_args(dir: &Path, port: u16, opts: &MariaDbOptions) -> Vec<OsString> {
    let pool = opts.innodb_buffer_pool_size.as_deref().unwrap_or("128M");
    let mut args = vec![
        "--no-defaults".into(), // must come first; ignores /etc/mysql
        flag("--datadir=", &dir.join("data")),
        flag("--socket=", &dir.join("mysqld.sock")),
        flag("--pid-file=", &dir.join("mysqld.pid")),
        flag("--log-error=", &dir.join("error.log")),
        tmpdir_flag(dir),
        format!("--port={port}").into(),
        "--bind-address=127.0.0.1".into(),
        "--skip-name-resolve".into(),
        format!("--innodb-buffer-pool-size={pool}").into(),
        "--innodb-log-file-size=64M".into(),
        "--innodb-flush-log-at-trx-commit=1".into(),
        "--max-connections=500".into(),
        "--character-set-server=utf8mb4".into(),
    ];
    match opts.replicated {
        Some(r) => args.extend(r.args().into_iter().map(OsString::from)),
        None => args.push("--skip-log-bin".into()),
    }
    args.extend(run_as_root_flag());
    args.extend(opts.extra_args.iter().map(OsString::from));
    args
}

/// Initialises `<dir>/data` unless it exists. Initialising into `data.tmp` and renaming it
/// when complete means an interrupted run leaves no half-made `data` behind; it is redone.
async fn init_datadir(dir: &Path) -> Result<()> {
    let data = dir.join("data");
    if data.is_dir() {
        return Ok(());
    }
    let tmp = dir.join("data.tmp");
    if tmp.exists() {
        tokio::fs::remove_dir_all(&tmp).await.with_context(|| format!("removing stale {}", tmp.display()))?;
    }
    let install = find_program(&["mariadb-install-db", "mysql_install_db"], &[])
        .context("mariadb-install-db not found; install mariadb-server")?;
    let out = Command::new(&install)
        .arg("--no-defaults")
        .arg(flag("--datadir=", &tmp))
        .arg(tmpdir_flag(dir))
        .args(run_as_root_flag())
        // `normal`: root@localhost/127.0.0.1/::1 without a password, as tests and dev expect.
        // `--force` skips its DNS lookup of the hostname, which can hang without DNS.
        .args(["--auth-root-authentication-method=normal", "--skip-test-db", "--force"])
        // Passed through to the bootstrap server, so the first start need not resize the log.
        .arg("--innodb-log-file-size=64M")
        .stdin(Stdio::null())
        .output()
        .await
        .with_context(|| format!("running {}", install.display()))?;
    ensure!(out.status.success(), "{} failed ({}):\n{}", install.display(), out.status, output_text(&out));
    tokio::fs::rename(&tmp, &data).await.with_context(|| format!("renaming {} to data", tmp.display()))?;
    Ok(())
}

/// `--user=root` when we are root (mariadbd refuses to run as root without it); nothing
/// otherwise, so developers can run `bagstore dev` unprivileged. Our euid owns /proc/self.
fn run_as_root_flag() -> Option<OsString> {
    is_root().then(|| "--user=root".into())
}

fn is_access_denied(e: &dyn sqlx::error::DatabaseError) -> bool {
    // 1045 access denied, 1130 host not allowed, 1698 access denied without password.
    e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .is_some_and(|e| matches!(e.number(), 1045 | 1130 | 1698))
}

/// A private tmpdir: every mariadbd deletes all `#sql*` files in its tmpdir when it starts, so
/// with a shared /tmp, starting one instance breaks the temporary tables of those already
/// running (mariadb-install-db runs in parallel failed ~8% of the time that way).
fn tmpdir_flag(dir: &Path) -> OsString {
    flag("--tmpdir=", &dir.join("tmp"))
}
