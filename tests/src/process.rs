//! The real `bagstore` binary as a child process: started, awaited until
//! its ready line, killed or stopped.

use anyhow::{bail, Context};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::Api;

/// The `bagstore` binary built from this workspace.
pub fn bagstore_bin() -> PathBuf {
    if let Ok(p) = std::env::var("BAGSTORE_BIN") {
        return PathBuf::from(p);
    }
    // target/<profile>/deps/<test binary> → target/<profile>/bagstore
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let bin = dir.join("bagstore");
    assert!(bin.exists(), "{} is missing: run `cargo build -p bagstore` before the tests", bin.display());
    bin
}

/// A command for a test's child process. Every child of a test is made
/// here or by [`std_command`]: it inherits stdio and no other descriptor,
/// because the mock brokers' sockets are not close-on-exec, and a child's
/// copy would keep a connection open after its broker closed it
/// ([`devstack::fds`]).
pub fn command(program: impl AsRef<OsStr>) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(program);
    devstack::fds::only_stdio_tokio(&mut cmd);
    cmd
}

/// [`command`] for a blocking child.
pub fn std_command(program: impl AsRef<OsStr>) -> std::process::Command {
    let mut cmd = std::process::Command::new(program);
    devstack::fds::only_stdio(&mut cmd);
    cmd
}

/// A running `bagstore` process.
#[derive(Debug)]
pub struct Proc {
    pub child: tokio::process::Child,
    /// The `http=` URL from the ready line.
    pub url: String,
    pub ready_line: String,
    pub log: PathBuf,
}

impl Proc {
    pub async fn start(args: &[String], dir: &Path, env: &[(&str, &str)]) -> anyhow::Result<Proc> {
        static N: AtomicU32 = AtomicU32::new(0);
        let log = dir.join(format!("{}-{}.log", args[0], N.fetch_add(1, Ordering::Relaxed)));
        let logfile = std::fs::File::create(&log)?;
        let mut cmd = command(bagstore_bin());
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(logfile)
            .env(
                "RUST_LOG",
                std::env::var("BAGSTORE_TEST_RUST_LOG").unwrap_or_else(|_| {
                    "info,bagstore=debug,service=debug,indexer=debug,cleaner=debug,writer=debug,reader=debug".into()
                }),
            )
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().context("spawn bagstore")?;
        let stdout = child.stdout.take().expect("piped");
        let mut lines = BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(Duration::from_secs(90), async {
            while let Some(line) = lines.next_line().await? {
                if line.contains(" ready: ") {
                    return Ok::<_, std::io::Error>(Some(line));
                }
            }
            Ok(None)
        })
        .await;
        let line = match ready {
            Ok(Ok(Some(l))) => l,
            other => {
                let tail = std::fs::read_to_string(&log).unwrap_or_default();
                let tail: String = tail
                    .lines()
                    .rev()
                    .take(30)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n");
                bail!("bagstore {args:?} did not become ready ({other:?}); log tail:\n{tail}");
            }
        };
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let url = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("http="))
            .context("ready line without http=")?
            .to_string();
        Ok(Proc { child, url, ready_line: line, log })
    }

    pub fn api(&self) -> Api {
        Api::new(&self.url)
    }

    pub fn pid(&self) -> i32 {
        self.child.id().expect("running") as i32
    }

    /// Sends a signal by name (`STOP` freezes the process, `CONT` thaws it).
    pub fn signal(&self, name: &str) {
        let status = std_command("kill")
            .arg(format!("-{name}"))
            .arg(self.pid().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{name} {}", self.pid());
    }

    /// SIGKILL: a crash, no cleanup.
    pub async fn kill9(mut self) {
        self.child.kill().await.ok();
    }

    /// SIGTERM and wait (bounded) for a clean exit; returns the exit code.
    pub async fn terminate(mut self) -> Option<i32> {
        let pid = self.pid();
        std_command("kill").arg("-TERM").arg(pid.to_string()).status().ok();
        match tokio::time::timeout(Duration::from_secs(60), self.child.wait()).await {
            Ok(Ok(status)) => status.code(),
            _ => {
                self.child.kill().await.ok();
                panic!("bagstore did not stop within 60 s of SIGTERM; log: {}", self.log.display())
            }
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}
