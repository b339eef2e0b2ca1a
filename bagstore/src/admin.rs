//! One-shot operator commands that work on the shards directly:
//! `bagstore cleaner --index T` (backfill with progress) and
//! `bagstore index drop T`.

use anyhow::Context;
use cleaner::backfill::Progress;
use cleaner::{Cleaner, CleanerMetrics};
use schemas::index::IndexState;
use schemas::Settings;
use storage::{catalog, Shards};
use tokio_util::sync::CancellationToken;

use crate::progress::Printer;

/// Backfills one index to ACTIVE, then returns.
pub async fn backfill(settings: Settings, table: &str) -> anyhow::Result<()> {
    let shards = Shards::connect(&settings.mysql).await?;
    let spec = catalog::list_index_meta(&shards)
        .await
        .context("reading index metadata (has bagstore migrate run?)")?
        .into_iter()
        .find(|m| m.spec.table == table && m.state != IndexState::Dropping)
        .map(|m| m.spec)
        .with_context(|| {
            format!("index {table:?} is not registered; add it to the config and run bagstore migrate")
        })?;
    let registry = prometheus::Registry::new();
    // A one-off backfill serves no HTTP: nobody asks its health.
    let health = service::health::Health::new(shards.clone(), None, false);
    let cleaner = Cleaner::new(settings, shards.clone(), CleanerMetrics::register(&registry)?, health);
    let printer = Printer::stderr();
    let label = format!("backfill {table}");
    let show = |p: Progress| {
        printer.show(
            &label,
            p.ratio(),
            &format!("{}/{} rows, {:.0} rows/s", p.rows_done, p.rows_total, p.rate()),
        )
    };
    let stop = CancellationToken::new();
    let on_signal = stop.clone();
    tokio::spawn(async move {
        service::serve::signal().await;
        on_signal.cancel();
    });
    let result = cleaner.backfill(&spec, &show, &stop).await;
    printer.finish();
    let p = result?;
    println!(
        "backfill {table} done: ACTIVE; scanned {} rows in this run ({} of {}) in {:.1}s, {:.0} rows/s",
        p.scanned_this_run,
        p.rows_done,
        p.rows_total,
        p.elapsed.as_secs_f64(),
        p.rate()
    );
    shards.close().await;
    Ok(())
}

/// Marks the index DROPPING (indexers stop maintaining it, the reader and
/// cleaner ignore it) and drops its table on every shard.
pub async fn drop_index(settings: Settings, table: &str) -> anyhow::Result<()> {
    let shards = Shards::connect(&settings.mysql).await?;
    match catalog::drop_index(&shards, table).await {
        Err(storage::StoreError::NoSuchIndex { .. }) => anyhow::bail!("index {table:?} is not registered"),
        r => r?,
    };
    println!("index {table} dropped on {} shards; remove it from the config", shards.count());
    shards.close().await;
    Ok(())
}
