//! A standalone Kafka-compatible broker for tests that kill it: `tansu`
//! (0.6.0, sqlite storage in the test's directory), so a `kill -9` and a
//! restart keep every acknowledged record, as a real broker's disk would.
//!
//! The binary is `$BAGSTORE_TANSU`, else `tansu` on the PATH, else
//! `$CARGO_HOME/bin/tansu` (`~/.cargo/bin`); `scripts/test` installs it
//! there when missing.

use anyhow::{bail, Context};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Where the tansu binary is, if anywhere.
pub fn tansu_bin() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("BAGSTORE_TANSU") {
        return Some(PathBuf::from(p));
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("tansu"))
        .find(|p| p.is_file());
    on_path.or_else(|| {
        let cargo_home = std::env::var_os("CARGO_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")))?;
        let p = cargo_home.join("bin/tansu");
        p.is_file().then_some(p)
    })
}

/// A running (or killed, until restarted) tansu broker.
#[derive(Debug)]
pub struct Tansu {
    bin: PathBuf,
    /// Holds `tansu.db` and the broker's log.
    dir: PathBuf,
    /// Kept across restarts: clients keep their bootstrap address.
    port: u16,
    child: Mutex<Option<Child>>,
    /// Length of the log when the current process started: a crash report
    /// after it belongs to this process.
    log_start: Mutex<u64>,
    /// Restarts after tansu broke on its own (see [`Tansu::heal`]).
    pub heals: std::sync::atomic::AtomicU32,
}

impl Tansu {
    /// Starts a broker with its data in `dir` and waits until it answers
    /// metadata requests.
    pub async fn start(dir: &Path) -> anyhow::Result<Tansu> {
        let bin = tansu_bin().context(
            "the tansu broker is not installed: run scripts/test, or \
             `cargo install tansu --version 0.6.0 --features libsql --locked`",
        )?;
        std::fs::create_dir_all(dir)?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let t = Tansu {
            bin,
            dir: dir.to_path_buf(),
            port,
            child: Mutex::new(None),
            log_start: Mutex::new(0),
            heals: Default::default(),
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

    async fn launch(&self) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("tansu.log"))?;
        *self.log_start.lock().unwrap() = log.metadata()?.len();
        let child = Command::new(&self.bin)
            .arg("broker")
            .args(["--listener-url", &self.url(), "--advertised-listener-url", &self.url()])
            .args(["--storage-engine", "sqlite://tansu.db"])
            .current_dir(&self.dir)
            .env("RUST_LOG", "warn")
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
            if self.crashed() {
                bail!("tansu crashed while starting; see {}", self.dir.join("tansu.log").display());
            }
            if let Some(status) =
                self.child.lock().unwrap().as_mut().and_then(|c| c.try_wait().ok().flatten())
            {
                bail!("tansu exited with {status}; see {}", self.dir.join("tansu.log").display());
            }
            if Instant::now() >= until {
                bail!(
                    "tansu did not answer within {deadline:?}; see {}",
                    self.dir.join("tansu.log").display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// SIGKILL: the broker dies mid-request; its sqlite file stays.
    pub fn kill9(&self) {
        if let Some(mut c) = self.child.lock().unwrap().take() {
            c.kill().ok();
            c.wait().ok();
        }
    }

    /// Whether the running broker has crashed inside while its process
    /// lives on. tansu 0.6.0 sometimes panics in its sqlite storage task a
    /// little after a restart ("more or less than one row", lite.rs), and
    /// from then on answers every request with an error; its log says so.
    pub fn crashed(&self) -> bool {
        let start = *self.log_start.lock().unwrap();
        let log = std::fs::read(self.dir.join("tansu.log")).unwrap_or_default();
        let tail = String::from_utf8_lossy(log.get(start as usize..).unwrap_or_default());
        tail.contains("panicked at")
    }

    /// Restarts a broker that [crashed](Tansu::crashed) on its own, as an
    /// operator's supervisor would; true if it had to. Its data is intact:
    /// acknowledged records are in sqlite.
    pub async fn heal(&self) -> anyhow::Result<bool> {
        if !self.crashed() {
            return Ok(false);
        }
        self.heals.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.restart().await?;
        Ok(true)
    }

    /// Starts the broker again on the same port and data. One that does
    /// not come up (tansu 0.6.0 can break again while starting on the data
    /// its crash left; seen once in a suite run) is killed and started
    /// again: three tries, as a supervisor would.
    pub async fn restart(&self) -> anyhow::Result<()> {
        let mut failed = Vec::new();
        for _ in 0..3 {
            self.kill9();
            match self.launch().await {
                Ok(()) => return Ok(()),
                Err(e) => failed.push(e.to_string()),
            }
        }
        bail!("tansu did not come back in 3 tries: {}", failed.join("; "))
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        self.kill9();
    }
}
