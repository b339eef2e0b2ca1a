//! `bagstore`: see `bagstore --help`, the README and docs/operations.md,
//! "Commands".

use anyhow::Context;
use bagstore::client_commands::{self as client, ClientArgs};
use bagstore::{admin, app, changes, dev, logging, migrate, replicas, shards, switchover};
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
        /// The backfill's pace follows the shards' health, under --rate if
        /// given (cleaner.backfill_follow_health).
        #[arg(long)]
        follow_health: bool,
    },
    /// Index administration.
    Index {
        #[command(subcommand)]
        command: IndexCommand,
    },
    /// Physical shards and online moves of logical shards between them.
    Shards {
        #[command(subcommand)]
        command: ShardsCommand,
    },
    /// The public change stream.
    Changes {
        #[command(subcommand)]
        command: ChangesCommand,
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
    /// Change part of an entity: `$`-operators such as
    /// '{"$inc": {"views": 1}, "$set": {"a.b": true}}', or with --merge an
    /// RFC 7396 merge patch such as '{"title": "new", "draft": null}'.
    Patch {
        #[command(flatten)]
        client: ClientArgs,
        id: String,
        body: String,
        /// The body is a merge patch (sent as application/merge-patch+json).
        #[arg(long)]
        merge: bool,
        /// Create the entity (from an empty bag) when it does not exist.
        #[arg(long)]
        upsert: bool,
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

#[derive(Debug, Subcommand)]
enum ChangesCommand {
    /// Bring a new consumer group up to date: place its offsets at the
    /// stream's end, then emit every live entity as op "r" (resumable).
    Snapshot {
        /// The consumer group (it must have no live consumers).
        #[arg(long)]
        group: String,
        /// Speed limit, entities per second (0: unlimited).
        #[arg(long, default_value_t = 0)]
        rate: u64,
        /// Take the snapshot again from the start (places the offsets again).
        #[arg(long)]
        restart: bool,
        #[arg(long)]
        config: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum ShardsCommand {
    /// Physical shards (logical ranges, rows), moves in flight and the map's epoch
    /// (from the shards with --config, otherwise through the HTTP API).
    List {
        #[arg(long)]
        config: Option<PathBuf>,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Prepare an empty database as a new physical shard and register it (it owns nothing yet).
    Add {
        name: String,
        dsn: String,
        #[arg(long)]
        config: PathBuf,
    },
    /// Move logical shards (`A-B`, or a list like `0-9,20`) to the physical shard NAME, online.
    Move {
        #[arg(long)]
        logical: String,
        #[arg(long)]
        to: String,
        #[arg(long)]
        config: PathBuf,
    },
    /// Move logical shards until every physical shard (or each of --shards) holds an even share.
    Rebalance {
        /// Print the moves without running them.
        #[arg(long)]
        dry_run: bool,
        /// Physical shards to spread over (default: all registered).
        #[arg(long, value_delimiter = ',')]
        shards: Option<Vec<String>>,
        #[arg(long)]
        config: PathBuf,
    },
    /// Move everything a physical shard owns to the others, then unregister it.
    Remove {
        name: String,
        #[arg(long)]
        config: PathBuf,
    },
    /// Finish the move in flight (after a kill).
    Resume {
        #[arg(long)]
        config: PathBuf,
    },
    /// Roll back a move that has not yet flipped the map.
    Abort {
        id: u64,
        #[arg(long)]
        config: PathBuf,
    },
    /// A physical shard's replicas (MariaDB: GTID, semi-sync).
    #[command(subcommand)]
    Replicas(ReplicasCommand),
    /// SHARD's primary is gone: promote the most advanced replica (every replica must answer).
    Failover {
        shard: String,
        /// The replica to promote; refused unless it is as advanced as every other.
        #[arg(long)]
        to: Option<String>,
        /// Take writes even when no replica is left to acknowledge them.
        #[arg(long)]
        accept_async: bool,
        #[arg(long)]
        config: PathBuf,
    },
    /// Make a replica of SHARD its primary, both up (planned): the primary is fenced, the
    /// replica catches up, the others follow it; no acknowledged write is lost.
    Switchover {
        shard: String,
        /// The replica to promote (its address as `shards list` shows it); default: the most advanced.
        #[arg(long)]
        to: Option<String>,
        #[arg(long)]
        config: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum ReplicasCommand {
    /// Check, seed and start a replica of SHARD at DSN (the shard's database on another
    /// server); once it has caught up, the shard's writes wait for a replica's acknowledgement.
    Add {
        shard: String,
        dsn: String,
        #[arg(long)]
        config: PathBuf,
    },
    /// Stop a replica of SHARD (by its address, as `shards list` shows it) and unregister it.
    Remove {
        shard: String,
        address: String,
        #[arg(long)]
        config: PathBuf,
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
    // A usage error exits 2 here (clap).
    let cli = Cli::parse();
    logging::init();
    match run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let code = exit_code(&e);
            if std::env::args().any(|a| a == "--json") {
                let problem =
                    e.chain().find_map(|c| c.downcast_ref::<::client::ApiError>()).map(|a| &a.problem);
                let doc =
                    serde_json::json!({"error": format!("{e:#}"), "exit_code": code, "problem": problem});
                eprintln!("{doc}");
            } else {
                eprintln!("bagstore: error: {e:#}");
            }
            std::process::ExitCode::from(code)
        }
    }
}

/// The exit code of a failed command (docs/operations.md, "Commands": "Exit
/// codes, errors and output"): 2 a usage
/// error (bad arguments, input that is not JSON, a request the server
/// refused as malformed), 3 not found, 4 a conflict (a version precondition
/// failed, the entity exists), 5 unavailable (no answer, or 502/503/504),
/// 1 anything else.
fn exit_code(e: &anyhow::Error) -> u8 {
    for cause in e.chain() {
        if let Some(api) = cause.downcast_ref::<::client::ApiError>() {
            return match api.status {
                400 | 413 | 415 | 422 => 2,
                404 => 3,
                409 | 412 => 4,
                502..=504 => 5,
                _ => 1,
            };
        }
        if cause.downcast_ref::<::client::TransportError>().is_some() {
            return 5;
        }
        if cause.downcast_ref::<serde_json::Error>().is_some() {
            return 2;
        }
    }
    1
}

async fn shards_command(command: ShardsCommand) -> anyhow::Result<()> {
    let external = |path: &PathBuf| -> anyhow::Result<Settings> {
        let s = load(Some(path))?;
        anyhow::ensure!(!s.mysql.shards.is_empty(), "mysql.shards is empty: list the DSN of every shard");
        Ok(s)
    };
    match command {
        ShardsCommand::List { config: Some(config), client } => {
            shards::list(external(&config)?, client.json).await
        }
        ShardsCommand::List { config: None, client } => client::shards_list(&client).await,
        ShardsCommand::Add { name, dsn, config } => {
            shards::add(external(&config)?, &name, schemas::settings::Dsn(dsn)).await
        }
        ShardsCommand::Move { logical, to, config } => {
            shards::move_logicals(external(&config)?, &logical, &to).await
        }
        ShardsCommand::Rebalance { dry_run, shards: names, config } => {
            shards::rebalance(external(&config)?, names, dry_run).await
        }
        ShardsCommand::Remove { name, config } => shards::remove(external(&config)?, &name).await,
        ShardsCommand::Resume { config } => shards::resume(external(&config)?).await,
        ShardsCommand::Abort { id, config } => shards::abort(external(&config)?, id).await,
        ShardsCommand::Replicas(ReplicasCommand::Add { shard, dsn, config }) => {
            replicas::add(external(&config)?, &shard, schemas::settings::Dsn(dsn)).await
        }
        ShardsCommand::Failover { shard, to, accept_async, config } => {
            switchover::failover(external(&config)?, &shard, to.as_deref(), accept_async).await
        }
        ShardsCommand::Switchover { shard, to, config } => {
            switchover::switchover(external(&config)?, &shard, to.as_deref()).await
        }
        ShardsCommand::Replicas(ReplicasCommand::Remove { shard, address, config }) => {
            replicas::remove(external(&config)?, &shard, &address).await
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Dev(args) => dev::run(args).await,
        Command::Migrate { config } => {
            let settings = load(Some(&config))?;
            settings.require_external()?;
            let (report, shards) = migrate::migrate(&settings, true).await?;
            for (table, state) in report.indexes {
                println!("index {table}: {}", state.as_str());
            }
            println!("migrate done: {} shards", shards.count());
            shards.close().await;
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
        Command::Cleaner { service, index, rate, concurrency, follow_health } => {
            let mut s = load(service.config.as_ref())?;
            s.cleaner.backfill_follow_health |= follow_health;
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
        Command::Shards { command } => shards_command(command).await,
        Command::Changes { command: ChangesCommand::Snapshot { group, rate, restart, config } } => {
            let s = load(Some(&config))?;
            s.require_external()?;
            changes::snapshot(s, &group, rate, restart).await
        }
        Command::Put { client, body, id, if_match } => {
            client::put(&client, id.as_deref(), client::json_arg(&body)?, if_match).await
        }
        Command::Patch { client, id, body, merge, upsert, if_match } => {
            client::patch(&client, &id, client::json_arg(&body)?, merge, upsert, if_match).await
        }
        Command::Get { client, id } => client::get(&client, &id).await,
        Command::Delete { client, id } => client::delete(&client, &id).await,
        Command::Query { client, query } => client::query(&client, client::json_arg(&query)?).await,
        Command::Lag { client } => client::lag(&client).await,
        Command::Indexer { service, indexes } => {
            let s = load(service.config.as_ref())?;
            let specs = if indexes.is_empty() {
                // A unique index's rows are written by the writers.
                s.indexes.iter().filter(|i| !i.unique).cloned().collect()
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
