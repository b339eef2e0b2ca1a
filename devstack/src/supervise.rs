//! Running a private server process (mariadbd, postgres) that cannot outlive us.
//!
//! Why the server runs under a small `sh` wrapper instead of being our direct child: a test
//! binary or `bagstore dev` can die without running any destructor (SIGKILL, abort, OOM
//! killer), and a bare child server would then live on as an orphan holding a port, memory
//! and a temp dir. Tying a child's life to ours otherwise needs `prctl(PR_SET_PDEATHSIG)` from
//! `pre_exec` (unsafe) or a Rust task polling for our death (which dies with us). A pipe needs
//! neither: the kernel closes our write end however we die, so the wrapper, blocked in `read`
//! on the other end, sees EOF and stops the server with its clean-shutdown signal and,
//! for ephemeral instances, deletes the directory. The wrapper also
//! prints the server's pid and, later, a line when it exits, which lets startup notice a crash
//! or a port clash at once.

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// `$1` = directory, `$2` = 1 if ephemeral, `$3` = the signal that stops the server cleanly,
/// the rest = the server's command line. The death
/// pipe moves to fd 3 because asynchronous commands get /dev/null as stdin, and the server
/// must not hold it. The watcher is killed as soon as the server exits on its own, so it can
/// never signal a recycled pid; an ephemeral wrapper then itself waits for EOF before
/// deleting, so a failed start can still read error.log.
const WRAPPER: &str = r#"dir=$1; ephemeral=$2; signal=$3; shift 3
exec 3<&0 </dev/null
"$@" >>"$dir/error.log" 2>&1 3<&- &
pid=$!
echo "$pid"
( read -r _ <&3; kill -"$signal" "$pid" ) >/dev/null 2>&1 &
watcher=$!
wait "$pid"
status=$?
kill "$watcher" 2>/dev/null
trap '' PIPE
echo "exited $status"
if [ "$ephemeral" = 1 ]; then read -r _ <&3; rm -rf -- "$dir"; fi
exit "$status"
"#;

/// How long a signalled server may take to flush and exit before it gets SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// What to run under the wrapper.
#[derive(Debug)]
pub(crate) struct ServerCommand<'a> {
    /// For messages: "mariadbd", "postgres".
    pub name: &'static str,
    /// Holds `error.log`; deleted after the server exits when `ephemeral`.
    pub dir: &'a Path,
    pub ephemeral: bool,
    /// The signal for a clean, prompt stop: `TERM` for mariadbd; `INT` for postgres, whose
    /// `TERM` waits for every client to disconnect.
    pub stop_signal: &'static str,
    pub program: &'a Path,
    pub args: Vec<OsString>,
}

/// A server process under the death-pipe wrapper. Its output goes to `<dir>/error.log`.
#[derive(Debug)]
pub(crate) struct Supervised {
    /// What runs, for messages ("mariadbd", "postgres").
    name: &'static str,
    stop_signal: &'static str,
    pid: u32,
    /// The `sh` wrapper; it exits only after the server has.
    child: Child,
    /// Write end of the death pipe: closing it (or our death) makes the wrapper stop the server.
    death_pipe: Option<ChildStdin>,
}

/// Resolves once the wrapper reports that the server exited; see [`Supervised::spawn`].
#[derive(Debug)]
pub(crate) struct ExitWatch(Lines<BufReader<ChildStdout>>);

impl ExitWatch {
    pub(crate) async fn exited(&mut self) {
        let _ = self.0.next_line().await;
    }
}

impl Supervised {
    /// Starts the server under the wrapper, its output appended to `<dir>/error.log`.
    pub(crate) async fn spawn(cmd: ServerCommand<'_>) -> Result<(Supervised, ExitWatch)> {
        let (name, stop_signal) = (cmd.name, cmd.stop_signal);
        let mut child = crate::fds::only_stdio_tokio(&mut Command::new("sh"))
            .args(["-c", WRAPPER, "server-wrapper"])
            .arg(cmd.dir)
            .arg(if cmd.ephemeral { "1" } else { "0" })
            .arg(stop_signal)
            .arg(cmd.program)
            .args(cmd.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            // Out of our process group, so Ctrl-C reaches only us and we decide how to stop.
            .process_group(0)
            .spawn()
            .with_context(|| format!("spawning sh to run {name}"))?;
        let death_pipe = child.stdin.take();
        let mut out = BufReader::new(child.stdout.take().context("wrapper stdout")?).lines();
        let pid_line = out.next_line().await.with_context(|| format!("reading {name}'s pid"))?;
        let pid = pid_line.and_then(|l| l.parse().ok()).context("the wrapper printed no pid")?;
        Ok((Supervised { name, stop_signal, pid, child, death_pipe }, ExitWatch(out)))
    }

    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// Closes the death pipe and waits for the wrapper, i.e. for the server (and an ephemeral
    /// directory) to be gone; SIGKILL after [`STOP_TIMEOUT`].
    pub(crate) async fn shutdown(&mut self) -> Result<ExitStatus> {
        drop(self.death_pipe.take());
        let (name, signal) = (self.name, self.stop_signal);
        if let Ok(status) = tokio::time::timeout(STOP_TIMEOUT, self.child.wait()).await {
            return status.with_context(|| format!("waiting for the {name} wrapper"));
        }
        tracing::warn!(pid = self.pid, "{name} ignored SIG{signal} for {STOP_TIMEOUT:?}; sending SIGKILL");
        let _ = Command::new("kill").arg("-KILL").arg(self.pid.to_string()).status().await;
        tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .with_context(|| format!("the {name} wrapper did not exit after SIGKILL"))?
            .with_context(|| format!("waiting for the {name} wrapper"))?;
        Ok(ExitStatus::default()) // we killed it on purpose; that is not a crash
    }
}

impl Drop for Supervised {
    /// Closing the pipe is the whole shutdown protocol: the wrapper stops the server in the
    /// background (tokio reaps it), so dropping never blocks.
    fn drop(&mut self) {
        drop(self.death_pipe.take());
    }
}

/// The first executable among `names` on PATH, in the sbin directories PATH often lacks, or
/// in `extra` directories.
pub(crate) fn find_program(names: &[&str], extra: &[PathBuf]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs: Vec<PathBuf> = std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/local/sbin", "/sbin", "/usr/bin"].map(PathBuf::from))
        .chain(extra.iter().cloned())
        .collect();
    names
        .iter()
        .flat_map(|name| dirs.iter().map(move |d| d.join(name)))
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

pub(crate) fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

/// Whether we run as root (our euid owns /proc/self).
pub(crate) fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

pub(crate) async fn create_dir(dir: &Path) -> Result<()> {
    tokio::fs::create_dir_all(dir).await.with_context(|| format!("creating {}", dir.display()))
}

/// `name` immediately followed by `path`: `--datadir=/x/data`.
pub(crate) fn flag(name: &str, path: &Path) -> OsString {
    let mut flag = OsString::from(name);
    flag.push(path);
    flag
}

/// The last 30 lines written to `log` since byte `from`.
pub(crate) fn log_tail(log: &Path, from: u64) -> String {
    let bytes = std::fs::read(log).unwrap_or_default();
    last_lines(&String::from_utf8_lossy(bytes.get(from as usize..).unwrap_or_default()))
}

pub(crate) fn output_text(out: &std::process::Output) -> String {
    let [stdout, stderr] = [&out.stdout, &out.stderr].map(|b| String::from_utf8_lossy(b));
    last_lines(&format!("{stdout}{stderr}"))
}

fn last_lines(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}
