//! The move phase: a third physical shard is added to the loaded cluster
//! and `bagstore shards rebalance` moves a third of the logical shards (so
//! about a third of the entities and index rows) onto it, online, while the
//! steady writer writes; against the same writer alone just before.

use super::*;

/// A finished move as the command reports it.
#[derive(Debug, Clone, Copy)]
struct Done {
    rows: f64,
    copy_secs: f64,
    first_copy_secs: f64,
    pause_ms: f64,
}

/// `move N done: L logical shards, R rows copied in Ss (X rows/s; the first
/// copy F s, catch-up and verification V s), writes paused P ms at the cutover`
fn parse_done(line: &str) -> Option<Done> {
    let between = |a: &str, b: &str| -> Option<f64> {
        let start = line.find(a)? + a.len();
        let end = start + line[start..].find(b)?;
        line[start..end].trim().parse().ok()
    };
    Some(Done {
        rows: between("logical shards, ", " rows copied")?,
        copy_secs: between("rows copied in ", "s (")?,
        first_copy_secs: between("the first copy ", " s,")?,
        pause_ms: between("writes paused ", " ms")?,
    })
}

/// Runs the phase; returns the new shard's server, to stop once the
/// bagstore processes (which reach it since the move) have stopped.
pub(super) async fn move_phase<F, Fut>(
    opts: &Options,
    world: &World,
    report: &mut Report,
    bag_steady: F,
) -> anyhow::Result<MariaDb>
where
    F: Fn() -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let n = opts.entities;
    let rate = opts.steady_rate as f64;
    report.section(&format!(
        "Moving a third of {n} entities onto a new shard (`bagstore shards rebalance`), steady writer at {}/s",
        opts.steady_rate
    ));
    let third =
        MariaDb::start_with(&world.dir.path().join("shard-2"), crate::server_options(opts.quick, 2)).await?;
    world.procs.watch("mariadbd shard 2", third.pid());
    let dsn = third.dsn("bench_bag");
    let run = |args: Vec<String>| async move {
        let child = bagstore_tests::command(bagstore_tests::bagstore_bin())
            .args(&args)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        if let Some(pid) = child.id() {
            world.procs.watch(&format!("bagstore {}", args[..2].join(" ")), pid);
        }
        let out = child.wait_with_output().await?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        ensure!(
            out.status.success(),
            "bagstore {args:?} failed: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok::<_, anyhow::Error>(text)
    };
    let cfg2 = world.config(true).display().to_string();
    run(vec!["shards".into(), "add".into(), "s2".into(), dsn.clone(), "--config".into(), cfg2]).await?;
    let mut dsns = world.bag_dsns.clone();
    dsns.push(dsn.clone());
    let cfg3 = world.config_file("bagstore-3.toml", &dsns, true).display().to_string();

    let (base, _, _) = steady_alone(world, rate, opts.phase, bag_steady.clone()).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let steady = tokio::spawn(open_loop(rate, stop.clone(), bag_steady));
    let t = Instant::now();
    let before = world.usage().await;
    let out = run(vec!["shards".into(), "rebalance".into(), "--config".into(), cfg3]).await;
    let secs = t.elapsed().as_secs_f64();
    let mut spent = Usage::default();
    spent.add(&world.usage().await, &before);
    stop.store(true, Ordering::Relaxed);
    let during = steady.await?;
    let out = out?;
    let done: Vec<Done> = out.lines().filter_map(parse_done).collect();
    ensure!(!done.is_empty(), "the rebalance reported no finished move: {out}");

    // A third of the entities is on the new shard, and none is lost.
    let count = |dsn: String| async move {
        let pool = MySqlPool::connect(&dsn).await?;
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM entities").fetch_one(&pool).await?;
        pool.close().await;
        Ok::<_, anyhow::Error>(n)
    };
    let on_new = count(dsn).await?;
    let mut total = on_new;
    for d in &world.bag_dsns {
        total += count(d.clone()).await?;
    }
    ensure!(total >= n as i64, "{total} entities after the move, {n} loaded before");
    let share = on_new as f64 / total as f64;
    ensure!((0.28..0.39).contains(&share), "the new shard holds {:.1}% of the entities", share * 100.0);

    let rows: f64 = done.iter().map(|d| d.rows).sum();
    let copy_secs: f64 = done.iter().map(|d| d.copy_secs).sum();
    let first_secs: f64 = done.iter().map(|d| d.first_copy_secs).sum();
    let mut pauses: Vec<f64> = done.iter().map(|d| d.pause_ms / 1e3).collect();
    let pause = latency(&mut pauses);
    report.line(
        "move_rows",
        "move: rows copied (entities and index rows)",
        format!("{:.0} rows/s", rows / copy_secs.max(1e-9)),
        format!(
            "{rows:.0} rows in {} moves, {copy_secs:.1} s copying, {secs:.1} s in all; new shard holds {on_new} of {total} entities ({:.1}%)",
            done.len(),
            share * 100.0
        ),
    );
    report.line(
        "move_first_copy",
        "move: the first copy alone (before catch-up and verification)",
        format!("{:.0} rows/s", rows / first_secs.max(1e-9)),
        format!("{first_secs:.1} s; catch-up and verification {:.1} s", copy_secs - first_secs),
    );
    report.line("move_cpu", "CPU, during the moves", String::new(), spent.busy(secs));
    report.line(
        "move_pause",
        "move: writes paused at each cutover",
        format!("p99 {:.0} ms", pause.p99),
        format!("p50 {:.0} ms, max {:.0} ms over {} cutovers", pause.p50, pause.max, pause.n),
    );
    report.run("move_steady_before", "steady writer alone, just before", &base, "writes/s");
    report.run("move_steady_during", "steady writer during the move", &during, "writes/s");
    report.line(
        "move_steady_ratio",
        "steady writer p99: during the move / alone",
        ratio(during.latency.p99, base.latency.p99),
        format!("p50 {}", ratio(during.latency.p50, base.latency.p50)),
    );
    report.value(
        "move",
        json!({"rows": rows, "copy_secs": copy_secs, "first_copy_secs": first_secs, "total_secs": secs, "moves": done.len(),
               "pause_ms": {"p50": pause.p50, "p99": pause.p99, "max": pause.max},
               "entities_on_new_shard": on_new, "entities": total}),
    );
    Ok(third)
}
