//! `bagstore dev`: a whole bagstore in one process for development.
//!
//! Starts N private `mariadbd` shards under `--data-dir` (unless the config
//! names external `[mysql]` shards), an embedded Kafka (librdkafka's mock
//! cluster, reachable over TCP by other processes; unless the config names
//! `[kafka]` brokers), migrates, and runs writer + one indexer per index +
//! reader behind one HTTP listener.
//!
//! The embedded Kafka keeps nothing across restarts. A graceful stop
//! therefore drains first: no new writes, outbox empty, every index caught
//! up. Then consumers commit, relays stop, and mariadbd shuts down.

use anyhow::Context;
use devstack::mariadb::MariaDb;
use schemas::settings::Dsn;
use std::path::PathBuf;
use std::time::Duration;
use storage::Shards;

use crate::app::{self, Roles};
use crate::migrate;

#[derive(Debug, clap::Args)]
pub struct DevArgs {
    /// Indexes (and optionally external [mysql] / [kafka] replacing the private ones).
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub http: String,
    /// Private MariaDB shards to run.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub shards: u16,
    /// Where the private shards keep their data (kept across restarts).
    #[arg(long, default_value = ".bagstore")]
    pub data_dir: PathBuf,
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
    if settings.mysql.shards.is_empty() {
        let starts = (0..args.shards).map(|i| {
            let dir = args.data_dir.join(format!("shard-{i}"));
            async move {
                MariaDb::start(&dir).await.with_context(|| format!("starting shard {i} in {}", dir.display()))
            }
        });
        for r in futures::future::join_all(starts).await {
            servers.push(r?);
        }
        settings.mysql.shards = servers.iter().map(|m| Dsn(m.dsn(DEV_DATABASE))).collect();
    }

    // The mock cluster is not Send; it lives on this task until the end.
    let mut cluster = None;
    if settings.kafka.brokers.is_empty() {
        cluster = Some(devstack::kafka::start(&mut settings.kafka).context("starting the embedded Kafka")?);
    }

    let result = serve(&settings, &args, cluster.is_none()).await;
    drop(cluster);
    for m in servers {
        if let Err(e) = m.stop().await {
            tracing::warn!(error = %e, "mariadbd did not stop cleanly");
        }
    }
    result
}

async fn serve(settings: &schemas::Settings, args: &DevArgs, create_topics: bool) -> anyhow::Result<()> {
    let shards = Shards::connect_lazy(&settings.mysql)?;
    migrate::migrate(settings, &shards, create_topics).await?;
    shards.close().await;
    let roles = Roles { writer: true, reader: true, indexes: settings.indexes.clone(), cleaner: true };
    let running = app::start(settings, roles).await?;
    let (listener, url) = service::serve::bind(&args.http).await?;
    let dsns: Vec<String> = settings.mysql.shards.iter().map(Dsn::redacted).collect();
    println!("bagstore dev ready: http={url} shards={} kafka={}", dsns.join(","), settings.kafka.brokers);
    // Between HTTP and the pipeline: drain, since the embedded Kafka keeps nothing.
    let drain = async {
        let deadline = Duration::from_secs(args.drain_timeout_secs);
        if devstack::drain::drain(settings, &running.shards, deadline).await {
            tracing::info!("pipeline drained: outbox empty, every index caught up");
        }
    };
    service::serve::until_signal(settings, listener, running.router.clone(), &running.pipeline, drain).await;
    running.shards.close().await;
    Ok(())
}
