//! One-shot operator commands that work on the shards directly:
//! `bagstore cleaner --index T` (backfill with progress) and
//! `bagstore index drop T`.

use anyhow::Context;
use cleaner::backfill::Progress;
use cleaner::{Cleaner, CleanerMetrics};
use schemas::index::IndexState;
use schemas::Settings;
use std::io::{IsTerminal, Write};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use storage::{catalog, Shards};
use tokio_util::sync::CancellationToken;

/// Progress on stdout: a bar redrawn in place on a terminal, a plain line
/// every two seconds otherwise.
struct Printer {
    table: String,
    tty: bool,
    last: Mutex<Option<Instant>>,
}

impl Printer {
    fn show(&self, p: Progress) {
        let mut last = self.last.lock().expect("not poisoned");
        let mut out = std::io::stdout().lock();
        if self.tty {
            let width = 30;
            let filled = (p.ratio() * width as f64).round() as usize;
            let _ = write!(
                out,
                "\r{} [{}{}] {:5.1}% {}/{} rows {:.0} rows/s ",
                self.table,
                "#".repeat(filled),
                ".".repeat(width - filled),
                p.ratio() * 100.0,
                p.rows_done,
                p.rows_total,
                p.rate()
            );
            let _ = out.flush();
        } else if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(2)) {
            *last = Some(Instant::now());
            let _ = writeln!(
                out,
                "backfill {}: {}/{} rows ({:.1}%), {:.0} rows/s",
                self.table,
                p.rows_done,
                p.rows_total,
                p.ratio() * 100.0,
                p.rate()
            );
        }
    }
}

/// Backfills one index to ACTIVE, then returns.
pub async fn backfill(settings: Settings, table: &str) -> anyhow::Result<()> {
    let shards = Shards::connect_lazy(&settings.mysql)?;
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
    let cleaner = Cleaner::new(settings, shards.clone(), CleanerMetrics::register(&registry)?);
    let printer =
        Printer { table: table.to_string(), tty: std::io::stdout().is_terminal(), last: Mutex::new(None) };
    let stop = CancellationToken::new();
    let on_signal = stop.clone();
    tokio::spawn(async move {
        service::serve::signal().await;
        on_signal.cancel();
    });
    let result = cleaner.backfill(&spec, &|p| printer.show(p), &stop).await;
    if printer.tty {
        println!();
    }
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
    let shards = Shards::connect_lazy(&settings.mysql)?;
    match catalog::drop_index(&shards, table).await {
        Err(storage::StoreError::NoSuchIndex { .. }) => anyhow::bail!("index {table:?} is not registered"),
        r => r?,
    };
    println!("index {table} dropped on {} shards; remove it from the config", shards.count());
    shards.close().await;
    Ok(())
}
