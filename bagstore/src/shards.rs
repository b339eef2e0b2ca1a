//! `bagstore shards …`: the cluster's physical shards and the moves of
//! logical shards between them. Works on the shards directly (`--config`);
//! `list` also through the HTTP API.
//!
//! Moves run in this process when it can take the mover lock, with
//! progress on stdout. When a running cleaner holds it, the moves are
//! handed over: recorded one at a time on the metadata shard for the
//! cleaner to run, and followed here until done.

use anyhow::Context;
use mover::{MoveError, Mover, MoverMetrics, Progress};
use schemas::names::is_valid_identifier;
use schemas::settings::{Dsn, MysqlSettings};
use schemas::topology::{format_logicals, parse_logicals, MovePlan, PhysicalShard};
use schemas::Settings;
use serde_json::Value;
use std::time::Duration;
use storage::moves::{self, Phase};
use storage::{catalog, migrate, topology, Shards};
use tokio_util::sync::CancellationToken;

use crate::progress::Printer;
use crate::table::{cut, table};

/// `shards list`: the layout from the shards themselves.
pub async fn list(settings: Settings, json: bool) -> anyhow::Result<()> {
    let shards = Shards::connect(&settings.mysql).await?;
    let doc = serde_json::to_value(service::cluster::report(&shards).await?)?;
    println!("{}", if json { doc.to_string() } else { render(&doc) });
    shards.close().await;
    Ok(())
}

/// The human form of a shards report (`GET /v1/shards`).
pub fn render(doc: &Value) -> String {
    let text = |v: &Value| v.as_str().map_or_else(|| v.to_string(), str::to_string);
    let mut out = vec![format!("epoch {}, {} logical shards", doc["epoch"], doc["logical_shards"])];
    let rows = doc["shards"]
        .as_array()
        .map(|ss| {
            ss.iter()
                .map(|s| {
                    vec![
                        text(&s["name"]),
                        text(&s["id"]),
                        text(&s["logical"]),
                        cut(&text(&s["ranges"]), 40),
                        text(&s["entities_estimate"]),
                        text(&s["epoch"]),
                        text(&s["address"]),
                        servers(&s["servers"]),
                    ]
                })
                .collect()
        })
        .unwrap_or_default();
    out.push(table(
        &["NAME", "ID", "LOGICAL", "RANGES", "ENTITIES(EST)", "EPOCH", "ADDRESS", "SERVERS"],
        rows,
    ));
    match doc["moves"].as_array().filter(|m| !m.is_empty()) {
        None => out.push("moves in flight: none".into()),
        Some(ms) => {
            out.push("moves in flight:".into());
            let rows = ms
                .iter()
                .map(|m| {
                    vec![
                        text(&m["id"]),
                        text(&m["phase"]),
                        text(&m["logicals"]),
                        format!("{} -> {}", text(&m["source"]), text(&m["target"])),
                        text(&m["rows_copied"]),
                    ]
                })
                .collect();
            out.push(table(&["ID", "PHASE", "LOGICAL", "FROM -> TO", "ROWS COPIED"], rows));
        }
    }
    out.join("\n")
}

/// A shard's servers in a few words: `primary online, replica catching_up
/// 1200ms`.
fn servers(v: &Value) -> String {
    let one = |s: &Value| {
        let lag = s["lag_ms"].as_u64().map(|l| format!(" {l}ms")).unwrap_or_default();
        format!("{} {}{lag}", s["role"].as_str().unwrap_or("?"), s["state"].as_str().unwrap_or("?"))
    };
    v.as_array().map(|ss| ss.iter().map(one).collect::<Vec<_>>().join(", ")).unwrap_or_default()
}

/// `shards add NAME DSN`: prepares an empty database as a physical shard
/// and registers it. It owns nothing until a move or a rebalance.
pub async fn add(settings: Settings, name: &str, dsn: Dsn) -> anyhow::Result<()> {
    let shards = Shards::connect(&settings.mysql).await?;
    let p = add_shard(&shards, &settings, name, &dsn).await?;
    shards.close().await;
    println!(
        "shard {name} added (id {}); it owns no logical shard yet: run `bagstore shards rebalance`. \
         Running processes reach it at {} with the metadata shard's account; add its DSN to \
         mysql.shards in every configuration before the next restart.",
        p.id, p.address
    );
    Ok(())
}

/// Prepares `dsn` (database, tables, identity) and registers it as the
/// physical shard `name` of the cluster `shards` belongs to. Idempotent for
/// the same name and address.
pub async fn add_shard(
    shards: &Shards,
    settings: &Settings,
    name: &str,
    dsn: &Dsn,
) -> anyhow::Result<PhysicalShard> {
    anyhow::ensure!(is_valid_identifier(name), "{name:?} is not a valid shard name (use [a-z][a-z0-9_]*)");
    let t = shards.topology();
    let address = storage::dsn::address_of(dsn);
    if let Some(p) = t.by_name(name) {
        anyhow::ensure!(
            p.address == address,
            "the cluster already has a shard named {name:?}, at {}; choose another name",
            p.address
        );
    }
    // Running processes reach a shard added online at its address with the
    // metadata shard's account: prove that works before registering.
    let reachable =
        Dsn(storage::dsn::with_credentials_of(&address, shards.dsn(storage::META_SHARD).expose()));
    // Labels the new shard in errors (and is never the metadata shard's 0).
    let label = t.shards.iter().map(|p| p.id as usize + 1).max().unwrap_or(1);
    migrate::create_database(label, dsn)
        .await
        .with_context(|| format!("creating the database at {address}"))?;
    let probe = Shards::configured(&MysqlSettings { shards: vec![reachable], ..settings.mysql.clone() })?;
    probe.wait_ready(Duration::from_secs(10)).await.with_context(|| {
        format!(
            "running processes reach a new shard with the metadata shard's user and password, and those \
             cannot log in at {address}; create that account there first"
        )
    })?;
    let pool = probe.pool(0);
    match topology::identity(label, pool).await? {
        Some(me) if me.name == name => {}
        Some(me) => anyhow::bail!("{address} is already physical shard {:?} of a cluster", me.name),
        None => {}
    }
    migrate::create_base_tables(label, pool).await?;
    for m in catalog::list_index_meta(shards).await? {
        migrate::create_index_table(label, pool, &m.spec).await?;
    }
    let p = match t.by_name(name) {
        Some(p) => p.clone(),
        None => topology::register(shards.meta(), name, &address).await?,
    };
    topology::claim_identity(p.id as usize, pool, name, p.id, p.epoch).await?;
    probe.close().await;
    shards.reload().await?;
    Ok(p)
}

/// How long a moving command keeps trying while a shard does not answer.
const RIDE_OUT: Duration = Duration::from_secs(60);

/// A failure that may pass once a failover is done (see
/// `StoreError::is_transient`).
fn transient(e: &anyhow::Error) -> bool {
    let store = |s: &storage::StoreError| s.is_transient();
    e.downcast_ref::<storage::StoreError>().is_some_and(store)
        || e.downcast_ref::<MoveError>().is_some_and(|m| matches!(m, MoveError::Store(s) if store(s)))
}

/// What a moving command prints and how it stops.
struct Run {
    mover: Mover,
    printer: Printer,
    stop: CancellationToken,
}

impl Run {
    async fn new(settings: Settings) -> anyhow::Result<Run> {
        let shards = Shards::connect(&settings.mysql).await?;
        let mover = Mover::new(settings, shards, MoverMetrics::unregistered());
        let stop = CancellationToken::new();
        let on_signal = stop.clone();
        tokio::spawn(async move {
            service::serve::signal().await;
            on_signal.cancel();
        });
        Ok(Run { mover, printer: Printer::stderr(), stop })
    }

    fn show(&self, p: &Progress) {
        let label = format!("move {} {}->{} {}", p.move_id, p.source, p.target, p.phase.as_str());
        let ratio = if p.rows_total == 0 { 1.0 } else { p.rows_copied as f64 / p.rows_total as f64 };
        let detail = format!(
            "{}/{} rows, {:.0} rows/s, {} caught up, journal {}",
            p.rows_copied, p.rows_total, p.rows_per_sec, p.rows_caught_up, p.journal_backlog
        );
        self.printer.show(&label, ratio, &detail);
    }

    /// Runs `plans` (see [`Run::execute_once`]), riding out a shard that
    /// stops answering (a failover takes a few seconds): run again, on the
    /// map as it is then, until a failure streak lasts [`RIDE_OUT`]. Running
    /// them again is safe: a move in flight is resumed first, and a plan
    /// moves only what its source still owns.
    async fn execute(&self, plans: &[MovePlan]) -> anyhow::Result<()> {
        let mut streak: Option<std::time::Instant> = None;
        loop {
            let attempt = std::time::Instant::now();
            match self.execute_once(plans).await {
                Err(e) if transient(&e) => {
                    // An attempt that ran a while made progress: a new streak.
                    if attempt.elapsed() > Duration::from_secs(5) {
                        streak = None;
                    }
                    let since = *streak.get_or_insert(attempt);
                    if since.elapsed() > RIDE_OUT {
                        return Err(e);
                    }
                    self.printer.finish();
                    eprintln!("a shard did not answer ({e:#}); trying again (a failover may be under way)");
                    if let Err(e) = self.mover.shards().reload().await {
                        tracing::debug!(error = %e, "the map could not be loaded yet");
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        _ = self.stop.cancelled() => return Err(e),
                    }
                }
                other => return other,
            }
        }
    }

    /// Runs `plans` here, or hands them to the process holding the lock.
    async fn execute_once(&self, plans: &[MovePlan]) -> anyhow::Result<()> {
        let show = |p: &Progress| self.show(p);
        match self.mover.execute(plans, &show, &self.stop).await {
            Ok(outcomes) => {
                self.printer.finish();
                for o in outcomes {
                    println!(
                        "move {} done: {} logical shards, {} rows copied in {:.1}s ({:.0} rows/s; the first copy {:.1} s, \
                         catch-up and verification {:.1} s), writes paused {:.0} ms at the cutover; \
                         {} of {} table slices verified against the copy's digests, the rest against the source",
                        o.move_id,
                        o.logicals,
                        o.rows_copied,
                        o.copy_secs,
                        o.rows_per_sec,
                        o.first_copy_secs,
                        o.copy_secs - o.first_copy_secs,
                        o.pause_secs * 1000.0,
                        o.verified_against_copy,
                        o.verified_slices,
                    );
                }
                Ok(())
            }
            Err(MoveError::Busy) => {
                println!("a running cleaner holds the mover lock: handing the moves to it");
                self.hand_over(plans).await
            }
            Err(e) => {
                self.printer.finish();
                Err(e.into())
            }
        }
    }

    /// Records the moves one at a time for the lock holder and follows them.
    async fn hand_over(&self, plans: &[MovePlan]) -> anyhow::Result<()> {
        let shards = self.mover.shards();
        for plan in plans {
            self.wait_idle().await?;
            shards.reload().await?;
            let t = shards.topology();
            let logicals: Vec<u16> =
                plan.logicals.iter().copied().filter(|k| t.owner(*k) == plan.from).collect();
            if logicals.is_empty() {
                continue;
            }
            let rec = moves::create_move(shards.meta(), &logicals, plan.from, plan.to).await?;
            println!(
                "move {} recorded: {} from {} to {}",
                rec.id,
                format_logicals(&logicals),
                plan.from,
                plan.to
            );
        }
        self.wait_idle().await
    }

    /// Follows the moves in flight until there are none.
    async fn wait_idle(&self) -> anyhow::Result<()> {
        let shards = self.mover.shards();
        loop {
            let in_flight = moves::moves_in_flight(shards.meta()).await?;
            let Some(m) = in_flight.first() else {
                self.printer.finish();
                return Ok(());
            };
            let t = shards.topology();
            let name = |id: u32| t.shard(id).map_or_else(|| id.to_string(), |p| p.name.clone());
            let label = format!("move {} {}->{} {}", m.id, name(m.source), name(m.target), m.phase.as_str());
            let copied = m.copied.len() as f64 / m.logicals.len().max(1) as f64;
            self.printer.show(&label, copied, &format!("{} rows copied", m.rows_copied));
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = self.stop.cancelled() => anyhow::bail!("stopped following; the moves go on in the cleaner"),
            }
            if let Some(done) = moves::get_move(shards.meta(), m.id).await? {
                if done.phase == Phase::RolledBack {
                    anyhow::bail!("move {} was rolled back", m.id);
                }
            }
        }
    }
}

/// `shards move --logical A-B --to NAME`.
pub async fn move_logicals(settings: Settings, logicals: &str, to: &str) -> anyhow::Result<()> {
    let run = Run::new(settings).await?;
    let l = run.mover.shards().logical_shards();
    let logicals = parse_logicals(logicals, l).map_err(anyhow::Error::msg)?;
    anyhow::ensure!(!logicals.is_empty(), "--logical names no logical shard");
    let plans = run.mover.plan_move(&logicals, to)?;
    if plans.is_empty() {
        println!("{to} owns all of them already");
    }
    run.execute(&plans).await
}

/// `shards rebalance [--dry-run]`: moves until each of `names` (default:
/// every registered shard) holds an even share.
pub async fn rebalance(settings: Settings, names: Option<Vec<String>>, dry_run: bool) -> anyhow::Result<()> {
    let run = Run::new(settings).await?;
    let names = names
        .unwrap_or_else(|| run.mover.shards().topology().shards.iter().map(|p| p.name.clone()).collect());
    // A rebalance resumed after a kill plans again from the map as it is.
    for _ in 0..3 {
        let plans = run.mover.plan_rebalance(&names)?;
        if dry_run {
            print_plan(&run, &plans);
            return Ok(());
        }
        if plans.is_empty() {
            println!("balanced: {}", counts(&run));
            return Ok(());
        }
        print_plan(&run, &plans);
        run.execute(&plans).await?;
        run.mover.shards().reload().await?;
    }
    println!("balanced: {}", counts(&run));
    Ok(())
}

fn print_plan(run: &Run, plans: &[MovePlan]) {
    let t = run.mover.shards().topology();
    let name = |id| t.shard(id).map_or_else(|| id.to_string(), |p| p.name.clone());
    if plans.is_empty() {
        println!("nothing to move: {}", counts(run));
    }
    for p in plans {
        println!(
            "move {} logical shards ({}) from {} to {}",
            p.logicals.len(),
            format_logicals(&p.logicals),
            name(p.from),
            name(p.to)
        );
    }
}

fn counts(run: &Run) -> String {
    let t = run.mover.shards().topology();
    t.counts()
        .into_iter()
        .map(|(id, n)| format!("{} owns {n}", t.shard(id).map_or_else(|| id.to_string(), |p| p.name.clone())))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `shards remove NAME`: moves everything it owns to the other shards,
/// then unregisters it.
pub async fn remove(settings: Settings, name: &str) -> anyhow::Result<()> {
    let run = Run::new(settings).await?;
    let shards = run.mover.shards().clone();
    let t = shards.topology();
    let p = t.by_name(name).with_context(|| format!("no physical shard is named {name:?}"))?.clone();
    anyhow::ensure!(
        p.id as usize != storage::META_SHARD,
        "{name} is the metadata shard (it holds the map and the index catalog) and cannot be removed"
    );
    let others: Vec<String> = t.shards.iter().filter(|s| s.id != p.id).map(|s| s.name.clone()).collect();
    let plans = run.mover.plan_rebalance(&others)?;
    print_plan(&run, &plans);
    run.execute(&plans).await?;
    shards.reload().await?;
    let left = shards.topology().owned_by(p.id).len();
    anyhow::ensure!(left == 0, "{name} still owns {left} logical shards; run the command again");
    topology::unregister(shards.meta(), p.id).await?;
    topology::forget_identity(p.id as usize, shards.pool(p.id as usize)).await?;
    println!("shard {name} removed; take its DSN out of mysql.shards in every configuration");
    Ok(())
}

/// `shards resume`: finishes the move in flight.
pub async fn resume(settings: Settings) -> anyhow::Result<()> {
    Run::new(settings).await?.execute(&[]).await
}

/// `shards abort ID`: rolls back a move that has not flipped the map.
pub async fn abort(settings: Settings, id: u64) -> anyhow::Result<()> {
    let run = Run::new(settings).await?;
    let show = |p: &Progress| run.show(p);
    run.mover.abort(id, &show, &run.stop).await?;
    run.printer.finish();
    println!("move {id} rolled back");
    Ok(())
}
