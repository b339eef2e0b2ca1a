//! `bench --quick` keeps the benchmark working in CI: the whole run on a
//! small data set, with its own checks (bagstore and the native JSON table
//! answer the same queries identically; the backfilled index is complete).
//! It asserts nothing about timings; full runs are in BENCHMARKS.md.

use bagstore_tests::bagstore_bin;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_benchmark_runs_end_to_end_in_quick_mode() {
    let bench = bagstore_bin().with_file_name("bench");
    assert!(bench.exists(), "{} is missing: cargo build --workspace", bench.display());
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(600),
        tokio::process::Command::new(&bench).arg("--quick").kill_on_drop(true).output(),
    )
    .await
    .expect("bench --quick finishes within 10 minutes")
    .expect("bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench --quick failed:\n{stdout}\n{stderr}");
    for line in [
        "| raw: single-row INSERT (autocommit) |",
        "| bagstore: PUT /v1/entities/{id} |",
        "| bagstore: POST /v1/entities/batch of 100 |",
        "| bagstore: PUT, change stream off |",
        "| bagstore: batch, change stream off |",
        "| change stream on / off, throughput |",
        "| MariaDB, raw single |",
        "| MariaDB, bagstore batch |",
        "| mariadbd CPU per entity: bagstore / raw (target ≤ 1.5) |",
        "| bagstore: latest 20 of one user |",
        "| json: latest 20 of one user |",
        "| bagstore: online backfill (cleaner --index, --rate 0) |",
        "| json: ALTER TABLE … ADD INDEX (both shards at once) |",
        "| lag at 50% ",
        "| lag at 90% ",
        "| lag at 50%, indexer fetch.wait.max.ms 20 ",
        "| lag at 50%: fetch wait 5 ms / 20 ms | p50 ",
        "| bagstore writer |",
        "| bagstore writer p99, beside the burner of the backfill / before |",
        "| bagstore: online backfill following health (cleaner --index --follow-health) |",
        "| bagstore writer p99, during the backfill following health / beside its burner (target ≤ 1.5 following health) |",
        "| CPU, during the backfill following health |",
        "| CPU, during the backfill |",
    ] {
        assert!(stdout.contains(line), "the report lacks {line:?}:\n{stdout}");
    }
    // Every raw INSERT writes a row and, with the binary log on and
    // sync_binlog=1, syncs it: counters that read 0 are misspelt or off.
    let raw = stdout.lines().find(|l| l.starts_with("| MariaDB, raw single |")).unwrap_or("");
    assert!(
        !raw.contains("row writes 0.00")
            && !raw.contains("binlog fsyncs 0.000")
            && raw.contains("binlog fsyncs"),
        "the raw writes wrote no rows or synced no binary log: {raw:?}"
    );
    // The steady writer commits, so the servers' fsync counter must move
    // (a misspelt status variable reads as 0).
    let before =
        stdout.lines().find(|l| l.starts_with("| CPU, bagstore steady writer, before |")).unwrap_or("");
    assert!(
        before.contains("InnoDB fsyncs/s") && !before.contains("InnoDB fsyncs/s 0,"),
        "no fsyncs counted during the steady writer: {before:?}"
    );
}
