//! `bench --quick` keeps the benchmark working in CI: the whole run on a
//! small data set, with its own checks (bagstore and the native JSON table
//! answer the same queries identically; the backfilled index is complete).
//! `bench_replicas` runs for a few seconds beside it, for its rows. They
//! assert nothing about timings; full runs are in BENCHMARKS.md.

use bagstore_tests::bagstore_bin;

/// Runs the benchmark binary `name` (built beside `bagstore`) with `args`;
/// its standard output once it has succeeded within 10 minutes.
async fn run_bench(name: &str, args: &[&str]) -> String {
    let bench = bagstore_bin().with_file_name(name);
    assert!(bench.exists(), "{} is missing: cargo build --workspace", bench.display());
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(600),
        bagstore_tests::command(&bench).args(args).kill_on_drop(true).output(),
    )
    .await
    .unwrap_or_else(|_| panic!("{name} {args:?} finishes within 10 minutes"))
    .unwrap_or_else(|e| panic!("{name} runs: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name} {args:?} failed:\n{stdout}\n{stderr}");
    stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_benchmark_runs_end_to_end_in_quick_mode() {
    let stdout = run_bench("bench", &["--quick"]).await;
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
        "| MariaDB, json single |",
        "| MariaDB, json batch |",
        "| mariadbd CPU per entity: bagstore / json (target ≤ 2.0 single, ≤ 2.5 batch) |",
        "| MariaDB, floor capture single |",
        "| MariaDB, floor outbox batch |",
        "| mariadbd CPU per entity: floor with capture (entity + index row) / raw |",
        "| mariadbd CPU per entity: floor with an outbox / raw |",
        "| mariadbd CPU per entity: bagstore / floor with an outbox |",
        "| mariadbd CPU per entity: floor with an outbox / json |",
        "| MariaDB, floor reads single |",
        "| mariadbd CPU per entity: floor with an outbox and the write's reads / json |",
        "| mariadbd CPU per entity: bagstore / floor with an outbox and the write's reads |",
        "| bagstore: latest 20 of one user |",
        "| json: latest 20 of one user |",
        "| CPU, json: point get by id |",
        "| CPU, bagstore: point get by id |",
        "| bagstore: online backfill (cleaner --index, --rate 0) |",
        "| json: ALTER TABLE … ADD INDEX (both shards at once) |",
        "| floor: the same INSERTs beside the steady writer (target: backfill ≥ 0.9×) |",
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
    // The JSON table (what a user picks instead) writes one row per
    // entity, its secondary index being no row of its own; the floors
    // write exactly the rows of their design: two per entity with
    // capture, four with an outbox (a floor that skipped its index rows or
    // its outbox deletes would read lower); and the binary log grows with
    // every write (a misspelt counter reads 0).
    for (line, low, high) in [
        ("| MariaDB, json single |", 0.95, 1.05),
        ("| MariaDB, json batch |", 0.95, 1.05),
        ("| MariaDB, floor capture single |", 1.95, 2.1),
        ("| MariaDB, floor capture batch |", 1.95, 2.1),
        ("| MariaDB, floor outbox single |", 3.9, 4.2),
        ("| MariaDB, floor outbox batch |", 3.9, 4.2),
        ("| MariaDB, floor reads single |", 3.9, 4.2),
        ("| MariaDB, floor reads batch |", 3.9, 4.2),
    ] {
        let found = stdout.lines().find(|l| l.starts_with(line)).unwrap_or("");
        let rows = figure_after(found, "row writes ");
        assert!(
            rows.is_some_and(|r| (low..=high).contains(&r)),
            "{line}: row writes not in {low}..{high}: {found:?}"
        );
        assert!(
            figure_after(found, "binlog bytes ").is_some_and(|b| b > 0.0),
            "{line} counted no binary log bytes: {found:?}"
        );
    }
    // The outbox's events are in the binary log (inserted, then deleted):
    // it grows by more per entity than capture's, which logs the rows alone.
    let bytes = |line: &str| {
        let found = stdout.lines().find(|l| l.starts_with(line)).unwrap_or("");
        figure_after(found, "binlog bytes ").unwrap_or(0.0)
    };
    for kind in ["single", "batch"] {
        let (outbox, capture) = (
            bytes(&format!("| MariaDB, floor outbox {kind} |")),
            bytes(&format!("| MariaDB, floor capture {kind} |")),
        );
        assert!(
            outbox > capture + 100.0,
            "floor outbox {kind}: binlog bytes {outbox} against capture's {capture}"
        );
    }
    // The reads floor opens each transaction with bagstore's two reads
    // (the ownership proof, the locking read), one of each per single
    // put; the outbox floor reads nothing.
    let selects = |line: &str| {
        let found = stdout.lines().find(|l| l.starts_with(line)).unwrap_or("");
        figure_after(found, "select ").unwrap_or(-1.0)
    };
    let (reads, outbox) =
        (selects("| MariaDB, floor reads single |"), selects("| MariaDB, floor outbox single |"));
    assert!(
        (1.9..=2.2).contains(&reads) && (0.0..0.2).contains(&outbox),
        "selects per entity: floor reads {reads}, floor outbox {outbox}"
    );
    // Statements are broken down by kind; bagstore's writes lock rows
    // (select) and insert.
    let bag = stdout.lines().find(|l| l.starts_with("| MariaDB, bagstore single |")).unwrap_or("");
    assert!(bag.contains("insert ") && bag.contains("select "), "no statement kinds: {bag:?}");
    // The steady writer commits, so the servers' fsync counter must move
    // (a misspelt status variable reads as 0).
    let before =
        stdout.lines().find(|l| l.starts_with("| CPU, bagstore steady writer, before |")).unwrap_or("");
    assert!(
        before.contains("InnoDB fsyncs/s") && !before.contains("InnoDB fsyncs/s 0,"),
        "no fsyncs counted during the steady writer: {before:?}"
    );
}

/// `bench_replicas`, briefly: issue 35's write cost against the JSON table
/// with semi-sync replicas off and on, the primaries' and the replicas' CPU
/// apart, and reads from either. Its own checks make it fail on a write or
/// read error; these check that each row is there and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replication_benchmark_reports_primaries_and_replicas_apart() {
    let stdout = run_bench("bench_replicas", &["--secs", "2", "--clients", "4", "--batch", "20"]).await;
    let row = |replicas: u32, phase: &str| {
        let start = format!("| {replicas} | {phase} |");
        stdout
            .lines()
            .find(|l| l.starts_with(&start))
            .unwrap_or_else(|| panic!("no row {start:?}:\n{stdout}"))
    };
    for replicas in [0, 1] {
        for phase in
            ["single puts", "batch puts of 20", "JSON table: single inserts", "JSON table: inserts of 20"]
        {
            let line = row(replicas, phase);
            let rate = figure_after(line, &format!("| {phase} | "));
            assert!(rate.is_some_and(|r| r > 0.0), "no entities per second: {line:?}");
            // Each server's CPU is counted: a primary that read 0 was not.
            assert!(figure_after(line, "primaries ").is_some_and(|cpu| cpu > 0.0), "primaries: {line:?}");
            let replicas_cpu = figure_after(line, "replicas ");
            match replicas {
                0 => assert!(replicas_cpu.is_none(), "a replica's CPU without replicas: {line:?}"),
                _ => assert!(replicas_cpu.is_some_and(|cpu| cpu > 0.0), "replicas' CPU: {line:?}"),
            }
        }
        let ratio = row(
            replicas,
            "primaries' CPU per entity, bagstore / JSON table (target ≤ 2.0 single, ≤ 2.5 batch)",
        );
        for kind in ["single ", "batch "] {
            assert!(figure_after(ratio, kind).is_some_and(|r| r > 0.0), "{kind}ratio: {ratio:?}");
        }
    }
    for phase in [
        "point gets from the primary",
        "latest 20 of a user from the primary",
        "point gets from the replicas",
        "latest 20 of a user from the replicas",
    ] {
        let line = row(1, phase);
        let rate = figure_after(line, &format!("| {phase} | "));
        assert!(rate.is_some_and(|r| r > 0.0), "no reads per second: {line:?}");
    }
}

/// The number that follows `label` in `line` ("row writes 2.00, …" → 2.0).
fn figure_after(line: &str, label: &str) -> Option<f64> {
    let rest = &line[line.find(label)? + label.len()..];
    let end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
    rest[..end].parse().ok()
}
