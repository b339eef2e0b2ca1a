//! `bagstore dev`: a whole bagstore in one process for development.
//!
//! Starts N private `mariadbd` shards under `--data-dir` (unless the config
//! names external `[mysql]` shards), an embedded Kafka (librdkafka's mock
//! cluster, reachable over TCP by other processes; unless the config names
//! `[kafka]` brokers), migrates, and runs writer + one indexer per index +
//! reader behind one HTTP listener.
//!
//! The private shards grow and shrink with `--shards`: on a data dir made
//! with fewer, the new servers are added as shards (`s<i>`) and the cluster
//! rebalances onto them online while serving (progress in the log); with
//! more, the extra shards are drained, then removed (their servers stop at
//! the next start). Without `--shards`, the recorded layout is kept.
//!
//! The embedded Kafka keeps nothing across restarts. A graceful stop
//! therefore drains first: no new writes, outbox empty, every index caught
//! up. Then consumers commit, relays stop, and mariadbd shuts down.

use anyhow::Context;
use devstack::mariadb::MariaDb;
use schemas::settings::Dsn;
use std::path::PathBuf;
use std::time::Duration;

use crate::app::{self, Roles};
use crate::{dev_replicas, migrate};

#[derive(Debug, clap::Args)]
pub struct DevArgs {
    /// Indexes (and optionally external [mysql] / [kafka] replacing the private ones).
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub http: String,
    /// Private MariaDB shards to run (default: as many as the data dir has, 2 for a new one);
    /// a different number than recorded grows or shrinks the cluster online.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub shards: Option<u16>,
    /// Where the private shards keep their data (kept across restarts).
    #[arg(long, default_value = ".bagstore")]
    pub data_dir: PathBuf,
    /// Private replicas per private shard, the metadata shard included
    /// (semi-sync, GTID; failed over and rejoined on their own). Chosen when
    /// the data dir is made (default 0).
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=dev_replicas::MAX_REPLICAS as i64))]
    pub replicas: Option<u8>,
    /// Longest a graceful stop waits for the pipeline to drain.
    #[arg(long, default_value_t = 30)]
    pub drain_timeout_secs: u64,
}

/// The database every private shard uses.
const DEV_DATABASE: &str = "bagstore";

pub async fn run(args: DevArgs) -> anyhow::Result<()> {
    let mut settings = service::config::load(args.config.as_deref()).context("loading the configuration")?;
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("cannot create the data dir {}", args.data_dir.display()))?;

    let mut servers: Vec<MariaDb> = Vec::new();
    let mut layout = Layout::default();
    let mut group = None;
    let replicas = match settings.mysql.shards.is_empty() {
        true => dev_replicas::replicas_of(&args.data_dir, args.replicas)?,
        false => 0,
    };
    if replicas > 0 {
        let existing = (0..).take_while(|i| args.data_dir.join(format!("shard-{i}")).exists()).count();
        let total = existing.max(args.shards.map_or(2, usize::from));
        group = Some(dev_replicas::start(&args.data_dir, total, replicas, &mut settings).await?);
    } else if settings.mysql.shards.is_empty() {
        let existing = (0..).take_while(|i| args.data_dir.join(format!("shard-{i}")).exists()).count();
        let wanted = args.shards.map(usize::from);
        let total = existing.max(wanted.unwrap_or(2));
        let starts = (0..total).map(|i| {
            let dir = args.data_dir.join(format!("shard-{i}"));
            async move {
                MariaDb::start(&dir).await.with_context(|| format!("starting shard {i} in {}", dir.display()))
            }
        });
        for r in futures::future::join_all(starts).await {
            servers.push(r?);
        }
        let dsns: Vec<Dsn> = servers.iter().map(|m| Dsn(m.dsn(DEV_DATABASE))).collect();
        let probe = schemas::settings::MysqlSettings { shards: dsns.clone(), ..settings.mysql.clone() };
        let ids =
            storage::Shards::identities(&probe).await.context("asking the private shards who they are")?;
        layout = Layout::plan(&ids, wanted);
        settings.mysql.shards = layout.serving.iter().map(|i| dsns[*i].clone()).collect();
        layout.add = layout.add.iter().map(|(i, _)| (*i, dsns[*i].clone())).collect();
        // Servers that are no shard and not wanted (removed earlier) stop.
        let keep: Vec<usize> =
            layout.serving.iter().copied().chain(layout.add.iter().map(|(i, _)| *i)).collect();
        let mut kept = Vec::new();
        for (i, m) in servers.into_iter().enumerate() {
            if keep.contains(&i) {
                kept.push(m);
            } else if let Err(e) = m.stop().await {
                tracing::warn!(error = %e, "mariadbd did not stop cleanly");
            }
        }
        servers = kept;
    }

    // The mock cluster is not Send; it lives on this task until the end.
    let mut cluster = None;
    if settings.kafka.brokers.is_empty() {
        // The public change stream's and Kafka ingest's topics too.
        let extra = settings.extra_topics();
        let also: Vec<&str> = extra.iter().map(String::as_str).collect();
        cluster =
            Some(devstack::kafka::start(&mut settings.kafka, &also).context("starting the embedded Kafka")?);
        // The embedded broker holds every fetch for its whole wait: a short
        // one keeps index lag low (see `schemas::settings::EMBEDDED_FETCH_WAIT_MS`).
        settings.indexer.fetch_wait_ms.get_or_insert(schemas::settings::EMBEDDED_FETCH_WAIT_MS);
    }

    let result = serve(settings, &args, layout, group.clone(), cluster.is_none()).await;
    drop(cluster);
    if let Some((group, _)) = group {
        group.stop().await;
    }
    for m in servers {
        if let Err(e) = m.stop().await {
            tracing::warn!(error = %e, "mariadbd did not stop cleanly");
        }
    }
    result
}

async fn serve(
    mut settings: schemas::Settings,
    args: &DevArgs,
    mut layout: Layout,
    group: Option<(dev_replicas::Group, Vec<usize>)>,
    create_topics: bool,
) -> anyhow::Result<()> {
    let (_, shards) = migrate::migrate(&settings, create_topics).await?;
    for (i, dsn) in &layout.add {
        let p = crate::shards::add_shard(&shards, &settings, &format!("s{i}"), dsn).await?;
        tracing::info!(shard = %p.name, id = p.id, "added a private shard");
        settings.mysql.shards.push(dsn.clone());
    }
    if let Some((group, new)) = &group {
        layout = grow_replicated(&shards, &mut settings, group, new).await?;
    }
    shards.close().await;
    let settings = &settings;
    let roles = Roles { writer: true, reader: true, indexes: settings.indexes.clone(), cleaner: true };
    let running = app::start(settings, roles).await?;
    let (listener, url) = service::serve::bind(&args.http).await?;
    running.health.set_phase(service::health::Phase::Serving);
    // Ready means ready: a write made right after the line is found through
    // its indexes as fast as in steady state, so the line waits until every
    // index consumer holds its partitions (joining a group takes seconds).
    let held = tokio::select! {
        _ = app::until_consumers_hold(&running.health) => true,
        _ = service::serve::signal() => false,
    };
    if !held {
        running.pipeline.stop(settings).await;
        running.shards.close().await;
        return Ok(());
    }
    let dsns: Vec<String> = settings.mysql.shards.iter().map(Dsn::redacted).collect();
    println!("bagstore dev ready: http={url} shards={} kafka={}", dsns.join(","), settings.kafka.brokers);
    if let Some((group, _)) = group {
        tracing::info!(replicas = group.replicas(), "keeping the private replicated shards");
        running.pipeline.tracker.spawn(group.keep(running.shards.clone(), running.pipeline.stop.clone()));
    }
    if !layout.add.is_empty() || !layout.remove.is_empty() {
        let (settings, shards, stop) =
            (settings.clone(), running.shards.clone(), running.pipeline.stop.clone());
        let wanted = layout.wanted_names();
        let remove = layout.remove.clone();
        running.pipeline.tracker.spawn(async move {
            if let Err(e) = rebalance(settings, shards, wanted, remove, stop).await {
                tracing::error!(error = %e, "the private shards' rebalance stopped; it resumes at the next start");
            }
        });
    }
    // Between HTTP and the pipeline: drain, since the embedded Kafka keeps nothing.
    let drain = async {
        let deadline = Duration::from_secs(args.drain_timeout_secs);
        if devstack::drain::drain(settings, &running.shards, deadline).await {
            tracing::info!("pipeline drained: outbox empty, every index caught up");
        }
    };
    service::serve::until_signal(
        settings,
        listener,
        running.router.clone(),
        &running.pipeline,
        &running.health,
        drain,
    )
    .await;
    running.shards.close().await;
    Ok(())
}

/// A replicated cluster's new shards (`new`: all of a new cluster, or
/// those `--shards` grows it by) registered and given their replicas; the
/// layout to rebalance onto when it grew.
async fn grow_replicated(
    shards: &storage::Shards,
    settings: &mut schemas::Settings,
    group: &dev_replicas::Group,
    new: &[usize],
) -> anyhow::Result<Layout> {
    let t = shards.topology();
    let grown = !t.shards.is_empty() && new.iter().any(|i| t.by_name(&format!("s{i}")).is_none());
    for i in new.iter().filter(|i| t.by_name(&format!("s{i}")).is_none()) {
        let dsn = group.primary_dsn(*i).await;
        let p = crate::shards::add_shard(shards, settings, &format!("s{i}"), &dsn).await?;
        tracing::info!(shard = %p.name, id = p.id, "added a private shard");
    }
    shards.reload().await?;
    group.add_replicas(shards, settings, new).await?;
    if !grown {
        return Ok(Layout::default());
    }
    let names: Vec<(usize, String)> = t.shards.iter().map(|p| (p.id as usize, p.name.clone())).collect();
    let add = new.iter().map(|i| (*i, Dsn(String::new()))).collect();
    Ok(Layout { serving: Vec::new(), names, add, remove: Vec::new() })
}

/// How this run's private shards relate to the cluster in the data dir.
#[derive(Debug, Default)]
struct Layout {
    /// Server positions of the registered shards (the configuration).
    serving: Vec<usize>,
    /// Their names, by position.
    names: Vec<(usize, String)>,
    /// Servers to add as shards `s<i>`.
    add: Vec<(usize, Dsn)>,
    /// Names of registered shards to drain and remove.
    remove: Vec<String>,
}

impl Layout {
    /// `ids`: who each started server says it is; `wanted`: `--shards`.
    fn plan(ids: &[Option<storage::topology::Identity>], wanted: Option<usize>) -> Layout {
        let registered: Vec<usize> = (0..ids.len()).filter(|i| ids[*i].is_some()).collect();
        if registered.is_empty() {
            // A new cluster on the first `wanted` (default 2).
            let n = wanted.unwrap_or(2);
            return Layout { serving: (0..n).collect(), ..Default::default() };
        }
        let names: Vec<(usize, String)> =
            registered.iter().map(|i| (*i, ids[*i].as_ref().expect("registered").name.clone())).collect();
        let Some(n) = wanted else {
            return Layout { serving: registered, names, ..Default::default() };
        };
        let add = (0..n).filter(|i| !registered.contains(i)).map(|i| (i, Dsn(String::new()))).collect();
        let remove = names.iter().filter(|(i, _)| *i >= n).map(|(_, name)| name.clone()).collect();
        Layout { serving: registered, names, add, remove }
    }

    /// The shards that should hold the data once grown or shrunk.
    fn wanted_names(&self) -> Vec<String> {
        let kept = self.names.iter().filter(|(_, n)| !self.remove.contains(n)).map(|(_, n)| n.clone());
        kept.chain(self.add.iter().map(|(i, _)| format!("s{i}"))).collect()
    }
}

/// Rebalances onto `wanted`, then removes `remove`; progress in the log.
async fn rebalance(
    settings: schemas::Settings,
    shards: storage::Shards,
    wanted: Vec<String>,
    remove: Vec<String>,
    stop: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    let mover = mover::Mover::new(settings, shards.clone(), mover::MoverMetrics::unregistered());
    let last = std::sync::Mutex::new(std::time::Instant::now());
    let report = |p: &mover::Progress| {
        let mut last = last.lock().expect("not poisoned");
        if last.elapsed() >= Duration::from_secs(2) {
            *last = std::time::Instant::now();
            tracing::info!(
                id = p.move_id, phase = p.phase.as_str(), from = %p.source, to = %p.target,
                copied = p.rows_copied, total = p.rows_total, rows_per_sec = p.rows_per_sec as u64,
                "rebalancing the private shards"
            );
        }
    };
    loop {
        let plans = mover.plan_rebalance(&wanted)?;
        if plans.is_empty() {
            break;
        }
        tracing::info!(moves = plans.len(), onto = ?wanted, "rebalancing the private shards");
        match mover.execute(&plans, &report, &stop).await {
            Ok(_) => {}
            // The cleaner role is finishing a move left in flight.
            Err(mover::MoveError::Busy) => {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stop.cancelled() => return Ok(()),
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    for name in remove {
        let t = shards.topology();
        let Some(p) = t.by_name(&name) else { continue };
        storage::topology::unregister(shards.meta(), p.id).await?;
        storage::topology::forget_identity(p.id as usize, shards.pool(p.id as usize)).await?;
        shards.reload().await?;
        tracing::info!(shard = %name, "removed a drained private shard; its server stops at the next start");
    }
    let t = shards.topology();
    let counts: Vec<String> =
        t.counts().iter().filter_map(|(id, n)| t.shard(*id).map(|p| format!("{}={n}", p.name))).collect();
    tracing::info!(logical_shards = %counts.join(","), "private shards balanced");
    Ok(())
}
