//! A standalone Kafka-compatible broker for tests that kill it: `tansu`
//! 0.6.0 with its PostgreSQL storage on a private PostgreSQL cluster
//! ([`devstack::postgres`]). The broker process is what the tests
//! `kill -9`; PostgreSQL is never killed, so every record the broker
//! acknowledged is in a committed PostgreSQL transaction and survives,
//! as a real broker's replicated log would. tansu's statements need
//! PostgreSQL 16 or newer; `scripts/test` installs one (see
//! `devstack::postgres`).
//!
//! Why not tansu's SQLite storage: after `kill -9` it crash-looped in fresh
//! clones (panics in its storage task, then every request refused), so a
//! broker that corrupts itself when killed could not be the one the kill
//! tests kill.
//!
//! The binary is `$BAGSTORE_TANSU`, else [`DEFAULT_PATH`] under
//! `$CARGO_HOME` (`~/.cargo`), where `scripts/test` builds it with the
//! `postgres` feature. Not a `tansu` on PATH: it may lack that feature.

use anyhow::{bail, Context};
use devstack::postgres::Postgres;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Where `scripts/test` installs tansu, relative to `$CARGO_HOME`: a root
/// of its own, named for the version and the storage feature it needs.
pub const DEFAULT_PATH: &str = "bagstore/tansu-0.6.0-postgres-dev/bin/tansu";

/// The oldest PostgreSQL whose SQL dialect tansu 0.6.0's statements fit:
/// PostgreSQL 15 (Debian 12's) rejects a subquery in FROM without an alias.
const MIN_POSTGRES: u32 = 16;

/// The database tansu stores in, on its private cluster.
const DATABASE: &str = "tansu";

/// Where the tansu binary is, if anywhere.
pub fn tansu_bin() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("BAGSTORE_TANSU") {
        return Some(PathBuf::from(p));
    }
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")))?;
    let p = cargo_home.join(DEFAULT_PATH);
    p.is_file().then_some(p)
}

/// A running (or killed, until restarted) tansu broker and its storage.
#[derive(Debug)]
pub struct Tansu {
    bin: PathBuf,
    /// Holds the broker's log.
    dir: PathBuf,
    /// Kept across restarts: clients keep their bootstrap address.
    port: u16,
    child: Mutex<Option<Child>>,
    /// Length of the log when the current process started: a crash report
    /// after it belongs to this process.
    log_start: Mutex<u64>,
    /// Why each broker process that died or panicked without being killed
    /// by us broke (see [`Tansu::check`]).
    crashes: Mutex<Vec<String>>,
    /// Declared last: stopped after the broker.
    storage: Postgres,
}

impl Tansu {
    /// Starts a private PostgreSQL cluster with tansu's schema, then a
    /// broker storing in it with its log in `dir`, and waits until the
    /// broker answers metadata requests.
    pub async fn start(dir: &Path) -> anyhow::Result<Tansu> {
        let bin = tansu_bin().with_context(|| {
            format!(
                "the tansu broker is not installed: run scripts/test, or `cargo install tansu \
                 --version 0.6.0 --features postgres --locked --root $CARGO_HOME/{}`",
                DEFAULT_PATH.trim_end_matches("/bin/tansu")
            )
        })?;
        std::fs::create_dir_all(dir)?;
        let storage = Postgres::start().await.context("starting tansu's PostgreSQL")?;
        if storage.major_version() < MIN_POSTGRES {
            bail!(
                "tansu 0.6.0's PostgreSQL storage needs PostgreSQL {MIN_POSTGRES} or newer (its SQL has \
                 subqueries without an alias); found {}. scripts/test installs a newer one",
                storage.major_version()
            );
        }
        storage.create_database(DATABASE).await?;
        storage
            .run_sql(DATABASE, include_str!("tansu_postgres.sql"))
            .await
            .context("creating tansu's schema")?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let t = Tansu {
            bin,
            dir: dir.to_path_buf(),
            port,
            child: Mutex::new(None),
            log_start: Mutex::new(0),
            crashes: Mutex::new(Vec::new()),
            storage,
        };
        t.launch().await?;
        Ok(t)
    }

    pub fn bootstrap_servers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn url(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.port)
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("tansu.log")
    }

    async fn launch(&self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.log_path())?;
        *self.log_start.lock().unwrap() = log.metadata()?.len();
        let child = crate::std_command(&self.bin)
            .arg("broker")
            .args(["--listener-url", &self.url(), "--advertised-listener-url", &self.url()])
            .args(["--storage-engine", &self.storage.url(DATABASE)])
            .current_dir(&self.dir)
            // BAGSTORE_TANSU_LOG (e.g. "info") to see what the broker did.
            .env("RUST_LOG", std::env::var("BAGSTORE_TANSU_LOG").unwrap_or_else(|_| "warn".into()))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("spawning {}", self.bin.display()))?;
        *self.child.lock().unwrap() = Some(child);
        self.until_ready(Duration::from_secs(30)).await
    }

    /// Polls a metadata request until the broker answers it.
    async fn until_ready(&self, deadline: Duration) -> anyhow::Result<()> {
        let brokers = self.bootstrap_servers();
        let until = Instant::now() + deadline;
        loop {
            let b = brokers.clone();
            let answered = tokio::task::spawn_blocking(move || {
                let c: BaseConsumer = ClientConfig::new().set("bootstrap.servers", &b).create().ok()?;
                c.fetch_metadata(None, Duration::from_secs(2)).ok()
            })
            .await?
            .is_some();
            if answered {
                return Ok(());
            }
            if let Some(why) = self.crash() {
                bail!("tansu broke while starting: {why}");
            }
            if Instant::now() >= until {
                bail!("tansu did not answer within {deadline:?}; see {}", self.log_path().display());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The broker process's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.lock().unwrap().as_ref().map(Child::id)
    }

    /// SIGKILL: the broker dies mid-request; its storage lives on.
    pub fn kill9(&self) {
        if let Some(mut c) = self.child.lock().unwrap().take() {
            c.kill().ok();
            c.wait().ok();
        }
    }

    /// Why the broker is broken, if it is: its process exited although we
    /// did not kill it, or it panicked inside (a task of tansu can panic
    /// while the process lives on, answering every request with an error).
    pub fn crash(&self) -> Option<String> {
        let exited = self.child.lock().unwrap().as_mut().and_then(|c| c.try_wait().ok().flatten());
        let start = *self.log_start.lock().unwrap();
        let log = std::fs::read(self.log_path()).unwrap_or_default();
        let tail = String::from_utf8_lossy(log.get(start as usize..).unwrap_or_default()).into_owned();
        let panic = tail.lines().find(|l| l.contains("panicked at")).map(str::to_string);
        match (exited, panic) {
            (None, None) => None,
            (Some(status), panic) => Some(format!(
                "the tansu process exited with {status}{}; see {}",
                panic.map_or(String::new(), |p| format!(" after a panic: {p}")),
                self.log_path().display()
            )),
            (None, Some(p)) => Some(format!("tansu panicked: {p}; see {}", self.log_path().display())),
        }
    }

    /// Checks for a [crash](Tansu::crash). A crashed broker is recorded
    /// in [`Tansu::crashes`] and started again, so that a suite goes on to
    /// its report, where every recorded crash is a failure.
    pub async fn check(&self) -> anyhow::Result<Option<String>> {
        let Some(why) = self.crash() else { return Ok(None) };
        self.crashes.lock().unwrap().push(why.clone());
        self.restart().await?;
        Ok(Some(why))
    }

    /// The broker's crashes so far, each with its reason.
    pub fn crashes(&self) -> Vec<String> {
        self.crashes.lock().unwrap().clone()
    }

    /// Starts the broker again on the same port and storage.
    pub async fn restart(&self) -> anyhow::Result<()> {
        self.kill9();
        self.launch().await
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        self.kill9();
    }
}
