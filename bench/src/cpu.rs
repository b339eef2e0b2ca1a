//! Processes' CPU time and the cores they run on, for the benchmarks.

use anyhow::{ensure, Context};

/// CPU time (user + system) a process has used, in clock ticks (1/100 s).
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start at state.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// Pins `pid` (every thread of it) to `cores` with `taskset`.
pub fn pin(pid: u32, cores: &str) -> anyhow::Result<()> {
    let status = bagstore_tests::std_command("taskset")
        .args(["-a", "-p", "-c", cores, &pid.to_string()])
        .stdout(std::process::Stdio::null())
        .status()
        .context("running taskset (util-linux)")?;
    ensure!(status.success(), "taskset -a -p -c {cores} {pid} failed: {status}");
    Ok(())
}

/// How many cores the machine has online.
pub fn online_cores() -> usize {
    std::fs::read_to_string("/proc/cpuinfo")
        .map(|c| c.lines().filter(|l| l.starts_with("processor")).count())
        .unwrap_or(1)
        .max(1)
}

/// The cores the write phases leave to everything but the MariaDB servers
/// (which get core 0).
pub fn off_server_cores() -> String {
    match online_cores() {
        1 => "0".into(),
        2 => "1".into(),
        n => format!("1-{}", n - 1),
    }
}
