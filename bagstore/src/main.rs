//! `bagstore`: see `bagstore --help` and the README.

use anyhow::Context;
use bagstore::client_commands::{self as client, ClientArgs};
use bagstore::{admin, app, dev, logging, migrate};
use clap::{Parser, Subcommand};
use schemas::Settings;
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(name = "bagstore", version, about = "Schemaless entities on sharded MySQL with Kafka-fed indexes")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Everything in one process: private MariaDB shards, embedded Kafka, all services.
    Dev(dev::DevArgs),
    /// Create databases, tables, index metadata and topics (safe to repeat).
    Migrate {
        #[arg(long)]
        config: PathBuf,
    },
    /// The write API and the outbox relays.
    Writer(ServiceArgs),
    /// Index consumers (one consumer group per index).
    Indexer {
        #[command(flatten)]
        service: ServiceArgs,
        /// Index table to maintain; repeat for several (default: every index in the config).
        #[arg(long = "index")]
        indexes: Vec<String>,
    },
    /// The read and query API.
    Reader(ServiceArgs),
    /// Drift repair and backfills; with --index, backfill that index and exit when it is ACTIVE.
    Cleaner {
        #[command(flatten)]
        service: ServiceArgs,
        /// Backfill only this index, showing progress, and exit when it is ACTIVE.
        #[arg(long)]
        index: Option<String>,
        /// Backfill speed limit, rows per second (0: unlimited; default from the config).
        #[arg(long)]
        rate: Option<u64>,
        /// Shards a backfill scans at once (default from the config).
        #[arg(long)]
        concurrency: Option<usize>,
    },
    /// Index administration.
    Index {
        #[command(subcommand)]
        command: IndexCommand,
    },
    /// Create or replace an entity: JSON inline, `@file` or `-` (stdin).
    Put {
        #[command(flatten)]
        client: ClientArgs,
        body: String,
        /// Entity id (otherwise the body's "id", or a new one).
        #[arg(long)]
        id: Option<String>,
        /// Only if the entity is at this version.
        #[arg(long)]
        if_match: Option<u64>,
    },
    /// Print an entity.
    Get {
        #[command(flatten)]
        client: ClientArgs,
        id: String,
    },
    /// Delete an entity.
    Delete {
        #[command(flatten)]
        client: ClientArgs,
        id: String,
    },
    /// Run a query: JSON inline, `@file` or `-` (stdin).
    Query {
        #[command(flatten)]
        client: ClientArgs,
        query: String,
    },
    /// Per-index lag: events not yet applied and milliseconds behind.
    Lag {
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Debug, Subcommand)]
enum IndexCommand {
    /// List indexes with state and backfill progress.
    List {
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Stop maintaining an index and drop its tables on every shard
    /// (through the HTTP API, or straight on the shards with --config).
    Drop {
        table: String,
        #[arg(long)]
        config: Option<PathBuf>,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(Debug, clap::Args)]
struct ServiceArgs {
    #[arg(long)]
    config: Option<PathBuf>,
    /// Listen address (default: `[http] addr` from the config).
    #[arg(long)]
    http: Option<String>,
}

fn load(path: Option<&PathBuf>) -> anyhow::Result<Settings> {
    service::config::load(path.map(|p| p.as_path())).context("loading the configuration")
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    logging::init();
    match run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bagstore: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Dev(args) => dev::run(args).await,
        Command::Migrate { config } => {
            let settings = load(Some(&config))?;
            settings.require_external()?;
            let shards = storage::Shards::connect_lazy(&settings.mysql)?;
            let report = migrate::migrate(&settings, &shards, true).await?;
            for (table, state) in report.indexes {
                println!("index {table}: {}", state.as_str());
            }
            println!("migrate done: {} shards", shards.count());
            Ok(())
        }
        Command::Writer(a) => {
            let s = load(a.config.as_ref())?;
            app::serve(s, app::Roles { writer: true, ..Default::default() }, "writer", a.http).await
        }
        Command::Reader(a) => {
            let s = load(a.config.as_ref())?;
            app::serve(s, app::Roles { reader: true, ..Default::default() }, "reader", a.http).await
        }
        Command::Cleaner { service, index, rate, concurrency } => {
            let mut s = load(service.config.as_ref())?;
            if let Some(r) = rate {
                s.cleaner.backfill_rate = r;
            }
            if let Some(c) = concurrency {
                anyhow::ensure!(c > 0, "--concurrency must be at least 1");
                s.cleaner.backfill_concurrency = c;
            }
            match index {
                Some(table) => {
                    anyhow::ensure!(
                        !s.mysql.shards.is_empty(),
                        "mysql.shards is empty: list one DSN per shard"
                    );
                    admin::backfill(s, &table).await
                }
                None => {
                    app::serve(s, app::Roles { cleaner: true, ..Default::default() }, "cleaner", service.http)
                        .await
                }
            }
        }
        Command::Index { command: IndexCommand::Drop { table, config: Some(config), .. } } => {
            let s = load(Some(&config))?;
            admin::drop_index(s, &table).await
        }
        Command::Index { command: IndexCommand::Drop { table, config: None, client } } => {
            client::index_drop(&client, &table).await
        }
        Command::Index { command: IndexCommand::List { client } } => client::index_list(&client).await,
        Command::Put { client, body, id, if_match } => {
            client::put(&client, id.as_deref(), client::json_arg(&body)?, if_match).await
        }
        Command::Get { client, id } => client::get(&client, &id).await,
        Command::Delete { client, id } => client::delete(&client, &id).await,
        Command::Query { client, query } => client::query(&client, client::json_arg(&query)?).await,
        Command::Lag { client } => client::lag(&client).await,
        Command::Indexer { service, indexes } => {
            let s = load(service.config.as_ref())?;
            let specs = if indexes.is_empty() {
                s.indexes.clone()
            } else {
                indexes
                    .iter()
                    .map(|t| s.index(t).cloned().with_context(|| format!("index {t:?} is not in the config")))
                    .collect::<anyhow::Result<Vec<_>>>()?
            };
            if specs.is_empty() {
                anyhow::bail!("the config defines no index to maintain");
            }
            app::serve(s, app::Roles { indexes: specs, ..Default::default() }, "indexer", service.http).await
        }
    }
}
