//! Private `mariadbd` instances for `bagstore dev` and the test harness.
//!
//! Each instance owns one directory (`data/`, `error.log`, socket, pid file) and listens on a
//! loopback port, so several can run side by side without touching a system MariaDB.
//!
//! Why `mariadbd` runs under a small `sh` wrapper instead of being our direct child: a test
//! binary or `bagstore dev` can die without running any destructor (SIGKILL, abort, OOM
//! killer), and a bare child `mariadbd` would then live on as an orphan holding a port, memory
//! and a temp dir. Tying a child's life to ours otherwise needs `prctl(PR_SET_PDEATHSIG)` from
//! `pre_exec` (unsafe) or a Rust task polling for our death (which dies with us). A pipe needs
//! neither: the kernel closes our write end however we die, so the wrapper, blocked in `read`
//! on the other end, sees EOF and stops `mariadbd` with SIGTERM (a clean InnoDB shutdown) and,
//! for ephemeral instances, deletes the directory. The wrapper also prints mariadbd's pid and,
//! later, a line when it exits, which lets startup notice a crash or a port clash at once.

use std::ffi::OsString;
use std::os::fd::AsFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use sqlx::{Connection, MySqlConnection};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};

/// `$1` = directory, `$2` = 1 if ephemeral, the rest = the mariadbd command line. The death
/// pipe moves to fd 3 because asynchronous commands get /dev/null as stdin, and mariadbd must
/// not hold it. The watcher is killed as soon as mariadbd exits on its own, so it can never
/// signal a recycled pid; an ephemeral wrapper then itself waits for EOF before deleting, so a
/// failed start can still read error.log.
const WRAPPER: &str = r#"dir=$1; ephemeral=$2; shift 2
exec 3<&0 </dev/null
"$@" >>"$dir/error.log" 2>&1 3<&- &
pid=$!
echo "$pid"
( read -r _ <&3; kill -TERM "$pid" ) >/dev/null 2>&1 &
watcher=$!
wait "$pid"
status=$?
kill "$watcher" 2>/dev/null
trap '' PIPE
echo "exited $status"
if [ "$ephemeral" = 1 ]; then read -r _ <&3; rm -rf -- "$dir"; fi
exit "$status"
"#;

/// How long startup may take before we give up and show error.log.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a SIGTERM'd mariadbd may take to flush and exit before it gets SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// Attempts at picking a free port when another process grabs it before mariadbd binds.
const PORT_ATTEMPTS: usize = 5;

/// A private mariadbd serving one data directory on a loopback TCP port.
#[derive(Debug)]
pub struct MariaDb {
    pid: u32,
    port: u16,
    dir: PathBuf,
    /// The `sh` wrapper; it exits only after mariadbd has.
    child: Child,
    /// Write end of the death pipe: closing it (or our death) makes the wrapper stop mariadbd.
    death_pipe: Option<ChildStdin>,
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
        let mariadbd = find_program(&["mariadbd", "mysqld"])
            .context("mariadbd not found on PATH or in /usr/sbin; install mariadb-server")?;
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
        self.pid
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
        let status = self.shutdown().await?;
        ensure!(
            status.success(),
            "mariadbd (pid {}) exited with {status}; see {}",
            self.pid,
            self.dir.join("error.log").display()
        );
        Ok(())
    }

    /// Closes the death pipe and waits for the wrapper, i.e. for mariadbd (and an ephemeral
    /// directory) to be gone.
    async fn shutdown(&mut self) -> Result<ExitStatus> {
        drop(self.death_pipe.take());
        if let Ok(status) = tokio::time::timeout(STOP_TIMEOUT, self.child.wait()).await {
            return status.context("waiting for the mariadbd wrapper");
        }
        tracing::warn!(pid = self.pid, "mariadbd ignored SIGTERM for 30 s; sending SIGKILL");
        let _ = Command::new("kill").arg("-KILL").arg(self.pid.to_string()).status().await;
        tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .context("the mariadbd wrapper did not exit after SIGKILL")?
            .context("waiting for the mariadbd wrapper")?;
        Ok(ExitStatus::default()) // we killed it on purpose; that is not a crash
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
                    let socket: sqlx::Result<String> =
                        sqlx::query_scalar("SELECT @@socket").fetch_one(&mut conn).await;
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
        let client = find_program(&["mariadb", "mysql"]).context("no mariadb client found")?;
        let sql = "CREATE USER IF NOT EXISTS 'root'@'127.0.0.1'; \
                   CREATE USER IF NOT EXISTS 'root'@'localhost'; \
                   ALTER USER 'root'@'127.0.0.1', 'root'@'localhost' IDENTIFIED BY ''; \
                   GRANT ALL ON *.* TO 'root'@'127.0.0.1', 'root'@'localhost' WITH GRANT OPTION;";
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

impl Drop for MariaDb {
    /// Closing the pipe is the whole shutdown protocol: the wrapper stops mariadbd in the
    /// background (tokio reaps it), so dropping never blocks.
    fn drop(&mut self) {
        drop(self.death_pipe.take());
    }
}

/// Starts mariadbd on `port` and waits for it. `Ok(None)` means it lost the port to someone
/// else and has been cleaned up.
async fn launch(dir: &Path, mariadbd: &Path, port: u16, opts: &MariaDbOptions) -> Result<Option<MariaDb>> {
    let started = Instant::now();
    let log = dir.join("error.log");
    let log_start = std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
    let mut child = Command::new("sh")
        .args(["-c", WRAPPER, "mariadbd-wrapper"])
        .arg(dir)
        .arg(if opts.ephemeral { "1" } else { "0" })
        .arg(mariadbd)
        .args(server_args(dir, port, opts))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        // Out of our process group, so Ctrl-C reaches only us and we decide how to stop.
        .process_group(0)
        .spawn()
        .context("spawning sh to run mariadbd")?;
    let death_pipe = child.stdin.take();
    let mut out = BufReader::new(child.stdout.take().context("wrapper stdout")?).lines();
    let pid_line = out.next_line().await.context("reading mariadbd's pid")?;
    let pid = pid_line.and_then(|l| l.parse().ok()).context("the wrapper printed no pid")?;
    let mut db = MariaDb { pid, port, dir: dir.to_owned(), child, death_pipe };

    let outcome = tokio::time::timeout(STARTUP_TIMEOUT, async {
        tokio::select! {
            ready = db.wait_ready() => ready.map(|()| true),
            _ = out.next_line() => Ok(false), // the wrapper reports mariadbd's exit
        }
    })
    .await;
    if let Ok(Ok(true)) = outcome {
        tracing::info!(pid, port, dir = %dir.display(), elapsed = ?started.elapsed(), "mariadbd ready");
        return Ok(Some(db));
    }
    // Read the log before shutting down: an ephemeral wrapper deletes it.
    let tail = log_tail(&log, log_start);
    let _ = db.shutdown().await;
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
        "--skip-log-bin".into(),
        "--character-set-server=utf8mb4".into(),
    ];
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
    let install = find_program(&["mariadb-install-db", "mysql_install_db"])
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

/// Makes sure mariadbd is installed: if `mariadbd` is not found on PATH or in /usr/sbin,
/// runs `apt-get update` then `DEBIAN_FRONTEND=noninteractive apt-get install -y mariadb-server`
/// (printing what it does to stderr), failing with a clear message if that fails.
pub fn ensure_installed() -> Result<PathBuf> {
    if let Some(path) = find_program(&["mariadbd"]) {
        return Ok(path);
    }
    eprintln!("mariadbd not found; installing mariadb-server with apt-get");
    for args in [&["update"][..], &["install", "-y", "mariadb-server"]] {
        eprintln!("+ apt-get {}", args.join(" "));
        // apt's chatter goes to our stderr so stdout stays clean for callers.
        let to_stderr = std::io::stderr().as_fd().try_clone_to_owned().context("duplicating stderr")?;
        let status = std::process::Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(Stdio::null())
            .stdout(to_stderr)
            .status()
            .context("running apt-get (is this Debian/Ubuntu?)")?;
        ensure!(
            status.success(),
            "`apt-get {}` failed ({status}); install mariadb-server yourself (needs root) \
             or point the config at existing MySQL shards",
            args.join(" ")
        );
    }
    find_program(&["mariadbd"])
        .context("mariadb-server is installed but mariadbd is not on PATH or in /usr/sbin")
}

/// The first executable among `names` on PATH or in the sbin directories PATH often lacks.
fn find_program(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs: Vec<PathBuf> = std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/local/sbin", "/sbin", "/usr/bin"].map(PathBuf::from))
        .collect();
    names
        .iter()
        .flat_map(|name| dirs.iter().map(move |d| d.join(name)))
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// `--user=root` when we are root (mariadbd refuses to run as root without it); nothing
/// otherwise, so developers can run `bagstore dev` unprivileged. Our euid owns /proc/self.
fn run_as_root_flag() -> Option<OsString> {
    let root = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
    root.then(|| "--user=root".into())
}

fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

fn is_access_denied(e: &dyn sqlx::error::DatabaseError) -> bool {
    // 1045 access denied, 1130 host not allowed, 1698 access denied without password.
    e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .is_some_and(|e| matches!(e.number(), 1045 | 1130 | 1698))
}

async fn create_dir(dir: &Path) -> Result<()> {
    tokio::fs::create_dir_all(dir).await.with_context(|| format!("creating {}", dir.display()))
}

/// A private tmpdir: every mariadbd deletes all `#sql*` files in its tmpdir when it starts, so
/// with a shared /tmp, starting one instance breaks the temporary tables of those already
/// running (mariadb-install-db runs in parallel failed ~8% of the time that way).
fn tmpdir_flag(dir: &Path) -> OsString {
    flag("--tmpdir=", &dir.join("tmp"))
}

fn flag(name: &str, path: &Path) -> OsString {
    let mut flag = OsString::from(name);
    flag.push(path);
    flag
}

/// The last 30 lines written to `log` since byte `from`.
fn log_tail(log: &Path, from: u64) -> String {
    let bytes = std::fs::read(log).unwrap_or_default();
    last_lines(&String::from_utf8_lossy(bytes.get(from as usize..).unwrap_or_default()))
}

fn output_text(out: &std::process::Output) -> String {
    let [stdout, stderr] = [&out.stdout, &out.stderr].map(|b| String::from_utf8_lossy(b));
    last_lines(&format!("{stdout}{stderr}"))
}

fn last_lines(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}
