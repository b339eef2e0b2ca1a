//! Index-lag observability and the monitoring files in `deploy/`: the
//! Prometheus config and alert rules pass `promtool` (and the alerts fire on
//! the scenarios they describe), the Grafana dashboard and its provisioning
//! agree with each other and with docker-compose.yml, every metric they use
//! is exported by a live stack, the cleaner reports lag while no indexer
//! runs, and a real Prometheus scrapes a dev stack and evaluates the rules.

use bagstore_tests::{eventually, metric_sum, until_query_is, TestEnv, STANDARD_INDEXES};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

/// The workspace root (this crate lives in `tests/`).
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

fn read(rel: &str) -> String {
    let path = repo().join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// A tool from the Debian `prometheus` package (`scripts/test` installs it).
fn prometheus_tool(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|p| p.is_file()).unwrap_or_else(|| {
        panic!("`{name}` not found: install the Debian package `prometheus` (scripts/test does)")
    })
}

/// Runs promtool; returns whether it succeeded and everything it printed.
fn promtool(args: &[&str], dir: &Path) -> (bool, String) {
    let out = bagstore_tests::std_command(prometheus_tool("promtool"))
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run promtool");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// The values of `key: value` lines (also `- key: value`), unquoted.
fn yaml_values(yaml: &str, key: &str) -> Vec<String> {
    yaml.lines()
        .filter_map(|l| {
            let t = l.trim_start().trim_start_matches("- ");
            let v = t.strip_prefix(key)?.strip_prefix(':')?;
            Some(v.trim().trim_matches('"').to_string())
        })
        .collect()
}

/// The PromQL of every `expr:` in a rule file: inline, or a block of the
/// lines indented deeper than the key.
fn rule_exprs(yaml: &str) -> Vec<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        i += 1;
        let Some(rest) = line.trim_start().strip_prefix("expr:") else { continue };
        let rest = rest.trim();
        if !rest.starts_with('|') && !rest.starts_with('>') {
            out.push(rest.to_string());
            continue;
        }
        let mut body = Vec::new();
        while i < lines.len() && (lines[i].trim().is_empty() || indent(lines[i]) > indent(line)) {
            body.push(lines[i].trim());
            i += 1;
        }
        out.push(body.join("\n").trim().to_string());
    }
    out
}

/// The rule file without its `annotations:` blocks, so that rule unit tests
/// compare labels only (the annotation texts are checked separately).
fn without_annotations(yaml: &str) -> String {
    let mut out = Vec::new();
    let mut skip_deeper_than: Option<usize> = None;
    for line in yaml.lines() {
        if let Some(level) = skip_deeper_than {
            if line.trim().is_empty() || indent(line) > level {
                continue;
            }
            skip_deeper_than = None;
        }
        if line.trim() == "annotations:" {
            skip_deeper_than = Some(indent(line));
            continue;
        }
        out.push(line);
    }
    out.join("\n") + "\n"
}

/// Every `bagstore_…` metric family named in `exprs`; histogram series
/// (`_bucket`, `_sum`, `_count`) count as their family.
fn metric_families<'a>(exprs: impl IntoIterator<Item = &'a str>) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for expr in exprs {
        let bytes = expr.as_bytes();
        let mut from = 0;
        while let Some(pos) = expr[from..].find("bagstore_") {
            let start = from + pos;
            let end = expr[start..]
                .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
                .map_or(expr.len(), |n| start + n);
            from = end;
            let glued = start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
            if glued {
                continue;
            }
            let name = &expr[start..end];
            let family =
                ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(name);
            names.insert(family.to_string());
        }
    }
    names
}

/// The dashboard model.
fn dashboard() -> Value {
    serde_json::from_str(&read("deploy/grafana/dashboards/bagstore.json")).expect("dashboard is JSON")
}

/// Every PromQL query of the dashboard: panel targets and variable queries.
fn dashboard_exprs(d: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push(t["expr"].as_str().unwrap_or_default().to_string());
        }
    }
    for v in d["templating"]["list"].as_array().expect("templating.list") {
        if let Some(q) = v["query"]["query"].as_str().or(v["query"].as_str()) {
            out.push(q.to_string());
        }
    }
    out
}

/// A dashboard query as Grafana sends it with every index selected.
fn as_grafana_sends_it(expr: &str) -> String {
    let q = expr.replace("$__rate_interval", "1m").replace("$index", ".*");
    assert!(!q.contains('$'), "unhandled dashboard variable in {expr}");
    q
}

/// Metric families in a `/metrics` scrape (from its `# TYPE` lines).
fn scraped_families(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

fn uid(i: usize) -> String {
    format!("{:032x}", 0x0b50_0000u64 + i as u64)
}

fn entity(i: usize) -> String {
    format!("{:032x}", 0x0e50_0000u64 + i as u64)
}

#[test]
fn promtool_accepts_the_prometheus_config_and_the_alert_rules() {
    let root = repo();
    let (ok, out) = promtool(&["check", "config", "deploy/prometheus/prometheus.yml"], &root);
    assert!(ok, "promtool check config failed:\n{out}");
    assert!(out.contains("1 rule files found"), "prometheus.yml must load alerts.yml:\n{out}");
    let (ok, out) = promtool(&["check", "rules", "deploy/prometheus/alerts.yml"], &root);
    assert!(ok, "promtool check rules failed:\n{out}");

    // Every alert carries a severity and both annotations.
    let rules = read("deploy/prometheus/alerts.yml");
    let alerts: Vec<&str> = rules.split("- alert:").skip(1).collect();
    assert!(alerts.len() >= 5, "expected the issue's alerts, found {}", alerts.len());
    // Every alert says what it means and has a runbook: its section in
    // deploy/runbooks.md (a heading with the alert's name, whose anchor is
    // the lowercased name), and every runbook section is an alert's.
    let runbooks = read("deploy/runbooks.md");
    let sections: Vec<&str> = runbooks.lines().filter_map(|l| l.strip_prefix("## ")).collect();
    let mut names = Vec::new();
    for a in &alerts {
        let name = a.lines().next().unwrap_or_default().trim();
        names.push(name);
        for key in ["severity:", "summary:", "description:"] {
            assert!(a.contains(key), "alert {name} has no {key}");
        }
        let want = format!("runbook_url: \"deploy/runbooks.md#{}\"", name.to_lowercase());
        assert!(a.contains(&want), "alert {name} has no {want}");
        assert!(sections.contains(&name), "deploy/runbooks.md has no section {name}");
    }
    for s in &sections {
        assert!(names.contains(s), "runbook section {s} is no alert's");
    }
    for section in runbooks.split("\n## ").skip(1) {
        for part in ["**Means.**", "**Confirm.**", "**Do.**"] {
            assert!(section.contains(part), "runbook {} lacks {part}", section.lines().next().unwrap());
        }
    }
    // Every compose service that serves /metrics is scraped.
    let prom = read("deploy/prometheus/prometheus.yml");
    let compose = read("docker-compose.yml");
    for service in ["writer", "indexer", "reader", "cleaner"] {
        assert!(
            compose.contains(&format!("\n  {service}:\n")),
            "docker-compose.yml has no {service} service"
        );
        assert!(prom.contains(&format!("names: [{service}]")), "prometheus.yml does not scrape {service}");
    }
}

#[test]
fn the_alert_rules_fire_on_the_scenarios_they_describe() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("alerts.yml"), without_annotations(&read("deploy/prometheus/alerts.yml")))
        .unwrap();
    std::fs::write(dir.path().join("alerts_test.yml"), RULE_TESTS).unwrap();
    let (ok, out) = promtool(&["test", "rules", "alerts_test.yml"], dir.path());
    assert!(ok, "promtool test rules failed:\n{out}");
}

/// Alert unit tests (promtool's format): series are per minute, and `time()`
/// starts at 0.
const RULE_TESTS: &str = r#"
rule_files: [alerts.yml]
evaluation_interval: 1m
tests:
  # a: behind with events waiting and no applies; b: "behind" while nothing
  # is on the topic; c: dropped, with stale gauges.
  - interval: 1m
    input_series:
      - {series: 'bagstore_index_lag_seconds{instance="c",index="a"}', values: '40x20'}
      - {series: 'bagstore_index_lag_events{instance="c",index="a"}', values: '5x20'}
      - {series: 'bagstore_index_state{instance="c",index="a"}', values: '2x20'}
      - {series: 'bagstore_index_lag_seconds{instance="c",index="b"}', values: '400x20'}
      - {series: 'bagstore_index_lag_events{instance="c",index="b"}', values: '0x20'}
      - {series: 'bagstore_index_state{instance="c",index="b"}', values: '2x20'}
      - {series: 'bagstore_index_lag_seconds{instance="c",index="c"}', values: '400x20'}
      - {series: 'bagstore_index_lag_events{instance="c",index="c"}', values: '9x20'}
      - {series: 'bagstore_index_state{instance="c",index="c"}', values: '3x20'}
      - {series: 'bagstore_indexer_events_applied_total{instance="i",index="b"}', values: '0+10x20'}
    alert_rule_test:
      - {eval_time: 4m, alertname: BagstoreIndexLagHigh, exp_alerts: []}
      - eval_time: 6m
        alertname: BagstoreIndexLagHigh
        exp_alerts: [{exp_labels: {index: a, severity: warning}}]
      - {eval_time: 15m, alertname: BagstoreIndexLagCritical, exp_alerts: []}
      - {eval_time: 9m, alertname: BagstoreIndexNotConsuming, exp_alerts: []}
      - eval_time: 11m
        alertname: BagstoreIndexNotConsuming
        exp_alerts: [{exp_labels: {index: a, severity: critical}}]
  - interval: 1m
    input_series:
      - {series: 'bagstore_index_consumers{instance="c",index="a"}', values: '0x10'}
      - {series: 'bagstore_index_consumers{instance="c",index="b"}', values: '2x10'}
      - {series: 'bagstore_index_consumers{instance="c",index="c"}', values: '0x10'}
      - {series: 'bagstore_index_state{instance="c",index="c"}', values: '3x10'}
    alert_rule_test:
      - {eval_time: 4m, alertname: BagstoreIndexNoConsumers, exp_alerts: []}
      - eval_time: 6m
        alertname: BagstoreIndexNoConsumers
        exp_alerts: [{exp_labels: {index: a, severity: critical}}]
  # A process's first dead letter creates its series at 1: a appears at 5m,
  # b exists from the start and rises once at 20m.
  - interval: 1m
    input_series:
      - {series: 'bagstore_indexer_events_dead_lettered_total{instance="i1",index="a"}', values: '_x5 1x30'}
      - {series: 'bagstore_indexer_events_dead_lettered_total{instance="i2",index="b"}', values: '1x20 2x10'}
    alert_rule_test:
      - eval_time: 4m
        alertname: BagstoreDeadLetters
        exp_alerts: [{exp_labels: {index: b, severity: warning}}]
      - eval_time: 12m
        alertname: BagstoreDeadLetters
        exp_alerts: [{exp_labels: {index: a, severity: warning}}]
      - {eval_time: 18m, alertname: BagstoreDeadLetters, exp_alerts: []}
      - eval_time: 22m
        alertname: BagstoreDeadLetters
        exp_alerts: [{exp_labels: {index: b, severity: warning}}]
  # Shard 0: w1 leads and its oldest row was committed at t=1s. Shard 1: w1
  # lost the lead and keeps a stale value; w2 leads with an empty outbox.
  - interval: 1m
    input_series:
      - {series: 'bagstore_writer_relay_leader{instance="w1",shard="0"}', values: '1x10'}
      - {series: 'bagstore_writer_outbox_oldest_commit_timestamp_seconds{instance="w1",shard="0"}', values: '1x10'}
      - {series: 'bagstore_writer_relay_leader{instance="w1",shard="1"}', values: '0x10'}
      - {series: 'bagstore_writer_outbox_oldest_commit_timestamp_seconds{instance="w1",shard="1"}', values: '1x10'}
      - {series: 'bagstore_writer_relay_leader{instance="w2",shard="1"}', values: '1x10'}
      - {series: 'bagstore_writer_outbox_oldest_commit_timestamp_seconds{instance="w2",shard="1"}', values: '0x10'}
      - {series: 'bagstore_writer_relay_leader{instance="w2",shard="0"}', values: '0x10'}
    alert_rule_test:
      - {eval_time: 1m, alertname: BagstoreOutboxStale, exp_alerts: []}
      - eval_time: 5m
        alertname: BagstoreOutboxStale
        exp_alerts: [{exp_labels: {shard: "0", severity: critical}}]
      - {eval_time: 5m, alertname: BagstoreOutboxNoRelayLeader, exp_alerts: []}
  # A move in flight whose progress time stops at 60 s; then one that moves.
  - interval: 1m
    input_series:
      - {series: 'bagstore_move_in_flight{instance="c"}', values: '1x30'}
      - {series: 'bagstore_move_progress_timestamp_seconds{instance="c"}', values: '0 60x30'}
    alert_rule_test:
      - {eval_time: 14m, alertname: BagstoreMoveStalled, exp_alerts: []}
      - eval_time: 17m
        alertname: BagstoreMoveStalled
        exp_alerts: [{exp_labels: {severity: warning}}]
  - interval: 1m
    input_series:
      - {series: 'bagstore_move_in_flight{instance="c"}', values: '1x30'}
      - {series: 'bagstore_move_progress_timestamp_seconds{instance="c"}', values: '0+60x30'}
      - {series: 'bagstore_map_reloads_total{job="bagstore-writer",instance="w"}', values: '0+600x30'}
      - {series: 'bagstore_map_reloads_total{job="bagstore-reader",instance="r"}', values: '0+6x30'}
    alert_rule_test:
      - {eval_time: 20m, alertname: BagstoreMoveStalled, exp_alerts: []}
      - {eval_time: 8m, alertname: BagstoreMapReloadStorm, exp_alerts: []}
      - eval_time: 20m
        alertname: BagstoreMapReloadStorm
        exp_alerts: [{exp_labels: {job: bagstore-writer, instance: w, severity: warning}}]
  # a: stuck at 40%; b: advancing; c: done.
  - interval: 1m
    input_series:
      - {series: 'bagstore_cleaner_backfill_progress_ratio{instance="c",index="a"}', values: '0.1 0.2 0.4x30'}
      - {series: 'bagstore_cleaner_backfill_progress_ratio{instance="c",index="b"}', values: '0+0.01x30'}
      - {series: 'bagstore_cleaner_backfill_progress_ratio{instance="c",index="c"}', values: '1x30'}
    alert_rule_test:
      - {eval_time: 10m, alertname: BagstoreBackfillStalled, exp_alerts: []}
      - eval_time: 14m
        alertname: BagstoreBackfillStalled
        exp_alerts: [{exp_labels: {index: a, severity: warning}}]
  # a's lag probe stops at 5m (300 s); b's keeps up; c's stops but c is
  # being dropped.
  - interval: 1m
    input_series:
      - {series: 'bagstore_index_lag_probe_timestamp_seconds{instance="c",index="a"}', values: '0+60x5 300x20'}
      - {series: 'bagstore_index_lag_probe_timestamp_seconds{instance="c",index="b"}', values: '0+60x25'}
      - {series: 'bagstore_index_lag_probe_timestamp_seconds{instance="c",index="c"}', values: '0x25'}
      - {series: 'bagstore_index_state{instance="c",index="c"}', values: '3x25'}
    alert_rule_test:
      - {eval_time: 9m, alertname: BagstoreLagProbeStale, exp_alerts: []}
      - eval_time: 12m
        alertname: BagstoreLagProbeStale
        exp_alerts: [{exp_labels: {index: a, severity: warning}}]
  # Two partitions per index. a: i1 and i2 claim 3 between them; b: i1
  # holds both; c: one of two held while the group has a member; d: one of
  # two with no member at all (BagstoreIndexNoConsumers' case).
  - interval: 1m
    input_series:
      - {series: 'bagstore_index_partition_lag_events{instance="c",index="a",partition="0"}', values: '0x10'}
      - {series: 'bagstore_index_partition_lag_events{instance="c",index="a",partition="1"}', values: '0x10'}
      - {series: 'bagstore_index_partition_lag_events{instance="c",index="b",partition="0"}', values: '0x10'}
      - {series: 'bagstore_index_partition_lag_events{instance="c",index="b",partition="1"}', values: '0x10'}
      - {series: 'bagstore_index_partition_lag_events{instance="c",index="c",partition="0"}', values: '0x10'}
      - {series: 'bagstore_index_partition_lag_events{instance="c",index="c",partition="1"}', values: '0x10'}
      - {series: 'bagstore_index_partition_lag_events{instance="c",index="d",partition="0"}', values: '0x10'}
      - {series: 'bagstore_index_partition_lag_events{instance="c",index="d",partition="1"}', values: '0x10'}
      - {series: 'bagstore_indexer_assigned_partitions{instance="i1",index="a"}', values: '2x10'}
      - {series: 'bagstore_indexer_assigned_partitions{instance="i2",index="a"}', values: '1x10'}
      - {series: 'bagstore_indexer_assigned_partitions{instance="i1",index="b"}', values: '2x10'}
      - {series: 'bagstore_indexer_assigned_partitions{instance="i1",index="c"}', values: '1x10'}
      - {series: 'bagstore_indexer_assigned_partitions{instance="i1",index="d"}', values: '1x10'}
      - {series: 'bagstore_index_consumers{instance="c",index="c"}', values: '1x10'}
      - {series: 'bagstore_index_consumers{instance="c",index="d"}', values: '0x10'}
    alert_rule_test:
      - {eval_time: 1m, alertname: BagstorePartitionsOverAssigned, exp_alerts: []}
      - eval_time: 3m
        alertname: BagstorePartitionsOverAssigned
        exp_alerts: [{exp_labels: {index: a, severity: critical}}]
      - {eval_time: 4m, alertname: BagstorePartitionsUnassigned, exp_alerts: []}
      - eval_time: 6m
        alertname: BagstorePartitionsUnassigned
        exp_alerts: [{exp_labels: {index: c, severity: warning}}]
  # a: missing rows found at 5m; b: its first dangling row (a new series) at
  # 30m; c: only `location` drift (normal after a move), never an alert.
  - interval: 1m
    input_series:
      - {series: 'bagstore_cleaner_drift_found_total{instance="c",index="a",kind="missing"}', values: '0x4 3x40'}
      - {series: 'bagstore_cleaner_drift_found_total{instance="c",index="b",kind="dangling"}', values: '_x29 1x15'}
      - {series: 'bagstore_cleaner_drift_found_total{instance="c",index="c",kind="location"}', values: '0+50x40'}
    alert_rule_test:
      - {eval_time: 4m, alertname: BagstoreDriftFound, exp_alerts: []}
      - eval_time: 6m
        alertname: BagstoreDriftFound
        exp_alerts: [{exp_labels: {index: a, kind: missing, severity: warning}}]
      - {eval_time: 25m, alertname: BagstoreDriftFound, exp_alerts: []}
      - eval_time: 32m
        alertname: BagstoreDriftFound
        exp_alerts: [{exp_labels: {index: b, kind: dangling, severity: warning}}]
  # Commands wait throughout; writers apply until 5m, then none does.
  - interval: 1m
    input_series:
      - {series: 'bagstore_ingest_lag_messages{instance="w1"}', values: '40x20'}
      - {series: 'bagstore_ingest_lag_messages{instance="w2"}', values: '40x20'}
      - {series: 'bagstore_ingest_commands_total{instance="w1",outcome="applied"}', values: '0+100x5 500x15'}
    alert_rule_test:
      - {eval_time: 8m, alertname: BagstoreIngestStalled, exp_alerts: []}
      - eval_time: 16m
        alertname: BagstoreIngestStalled
        exp_alerts: [{exp_labels: {severity: critical}}]
"#;

#[test]
fn the_dashboard_and_its_provisioning_agree_with_each_other_and_with_compose() {
    let d = dashboard();
    for key in ["title", "uid", "schemaVersion", "panels"] {
        assert!(!d[key].is_null(), "dashboard has no {key}");
    }
    let ds_file = read("deploy/grafana/provisioning/datasources/prometheus.yml");
    let ds_uid = yaml_values(&ds_file, "uid");
    assert_eq!(ds_uid.len(), 1, "one provisioned datasource: {ds_uid:?}");
    let ds_uid = &ds_uid[0];
    assert_eq!(yaml_values(&ds_file, "type"), ["prometheus"]);
    assert_eq!(yaml_values(&ds_file, "url"), ["http://prometheus:9090"], "the compose service");

    let panels = d["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    let mut queries = 0;
    for p in panels {
        let title = p["title"].as_str().expect("every panel has a title");
        assert!(ids.insert(p["id"].as_u64().expect("panel id")), "duplicate panel id in {title}");
        for k in ["x", "y", "w", "h"] {
            assert!(p["gridPos"][k].is_u64(), "panel {title} has no gridPos.{k}");
        }
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"].as_str(), Some("${datasource}"), "panel {title}");
        let targets = p["targets"].as_array().unwrap_or_else(|| panic!("panel {title} has no targets"));
        assert!(!targets.is_empty(), "panel {title} has no targets");
        for t in targets {
            assert!(!t["expr"].as_str().unwrap_or_default().trim().is_empty(), "empty query in {title}");
            assert_eq!(t["datasource"]["uid"].as_str(), Some("${datasource}"), "a target of {title}");
            queries += 1;
        }
    }
    assert!(queries >= 20, "only {queries} queries");
    let vars = d["templating"]["list"].as_array().expect("templating.list");
    // The datasource is a variable (so the dashboard imports into any
    // Grafana), defaulting to the provisioned one.
    let ds = vars.iter().find(|v| v["name"] == "datasource").expect("a `datasource` variable");
    assert_eq!((ds["type"].as_str(), ds["query"].as_str()), (Some("datasource"), Some("prometheus")));
    assert_eq!(ds["current"]["value"].as_str(), Some(ds_uid.as_str()));
    let index = vars.iter().find(|v| v["name"] == "index").expect("an `index` variable");
    assert_eq!(index["datasource"]["uid"].as_str(), Some("${datasource}"));
    let mut rest = d.clone();
    rest["templating"]["list"].as_array_mut().unwrap().retain(|v| v["name"] != "datasource");
    assert!(!rest.to_string().contains(ds_uid.as_str()), "a datasource uid hard-coded outside the variable");
    // Panels about one index follow the variable.
    let exprs = dashboard_exprs(&d);
    assert!(exprs.iter().filter(|e| e.contains("$index")).count() >= 10, "$index is hardly used");

    // The provider reads the directory compose mounts deploy/grafana/dashboards at.
    let provider = read("deploy/grafana/provisioning/dashboards/bagstore.yml");
    let paths = yaml_values(&provider, "path");
    assert_eq!(paths.len(), 1, "one provider path: {paths:?}");
    let compose = read("docker-compose.yml");
    let mount = |host: &str| -> String {
        let line = compose
            .lines()
            .find(|l| l.contains(&format!("{host}:")))
            .unwrap_or_else(|| panic!("docker-compose.yml does not mount {host}"));
        let target = line.split_once(&format!("{host}:")).unwrap().1;
        target.trim().trim_end_matches(":ro").to_string()
    };
    assert_eq!(mount("./deploy/grafana/dashboards"), paths[0]);
    assert_eq!(mount("./deploy/grafana/provisioning"), "/etc/grafana/provisioning");
    assert_eq!(mount("./deploy/prometheus"), "/etc/prometheus");
    assert!(repo().join("deploy/grafana/dashboards/bagstore.json").is_file());
    for service in ["prometheus", "grafana", "cleaner"] {
        assert!(
            compose.contains(&format!("\n  {service}:\n")),
            "docker-compose.yml has no {service} service"
        );
    }
}

const INDEX_TITLE: &str = r#"
[[indexes]]
table = "index_title"
properties = [{ name = "title", type = "string" }]
"#;

async fn rename_on_every_shard(env: &TestEnv, from: &str, to: &str) {
    for s in 0..env.dsns.len() {
        let pool = env.pool(s).await;
        sqlx::query(&format!("RENAME TABLE `{from}` TO `{to}`")).execute(&pool).await.unwrap();
        pool.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_and_the_alerts_use_is_exported_by_a_live_stack() {
    let dash = dashboard();
    let rules = read("deploy/prometheus/alerts.yml");
    let dash_exprs = dashboard_exprs(&dash);
    let rule_exprs = rule_exprs(&rules);
    assert!(rule_exprs.len() >= 5, "{rule_exprs:?}");
    let dash_names = metric_families(dash_exprs.iter().map(String::as_str));
    let mut wanted = dash_names.clone();
    wanted.extend(metric_families(rule_exprs.iter().map(String::as_str)));

    // Entities first, then a new index: `dev` migrates it and backfills it.
    let mut env = TestEnv::new("obsnames", STANDARD_INDEXES).await;
    env.migrate().await;
    let writer = env.spawn(&["writer"]).await;
    for i in 0..30 {
        let body =
            json!({"user_id": uid(i), "title": format!("entry {i}"), "tags": ["a"], "bar": i, "m": "right"});
        assert_eq!(writer.api().put(&entity(i), &body).await.0, 201);
    }
    writer.terminate().await;
    env.indexes_toml.push_str(INDEX_TITLE);
    let dev = env
        .spawn_env(
            &["dev", "--http", "127.0.0.1:0"],
            &[
                ("BAGSTORE_CLEANER__INTERVAL_MS", "200"),
                ("BAGSTORE_EXPIRY__PROPERTY", "expires_at"),
                ("BAGSTORE_CLEANER__EXPIRY_INTERVAL_MS", "200"),
                // The backfill's health probe series exist only then.
                ("BAGSTORE_CLEANER__BACKFILL_FOLLOW_HEALTH", "true"),
            ],
        )
        .await;
    let api = dev.api();
    // An entity that expired before it was written: the cleaner deletes it.
    assert_eq!(api.put(&entity(60), &json!({"user_id": uid(60), "expires_at": 1})).await.0, 201);
    for i in 30..40 {
        let body = json!({"user_id": uid(i), "first_name": "Ada", "last_name": format!("L{i}")});
        assert_eq!(api.put(&entity(i), &body).await.0, 201);
    }
    until_query_is(&api, &json!({"where": {"user_id": uid(35)}}), &[&entity(35)]).await;
    assert_eq!(api.get(&entity(3)).await.0, 200);
    assert_eq!(api.delete(&entity(4)).await.0, 200);

    // A dead letter: an undecodable message on the change topic.
    {
        use rdkafka::producer::{FutureProducer, FutureRecord};
        let producer: FutureProducer =
            rdkafka::ClientConfig::new().set("bootstrap.servers", env.brokers()).create().unwrap();
        producer
            .send(
                FutureRecord::to(&env.topic).key(&[7u8; 16][..]).payload(&b"garbage"[..]),
                Duration::from_secs(5),
            )
            .await
            .unwrap();
    }
    // Apply failures: index_tag's table is away while an event for it arrives.
    rename_on_every_shard(&env, "index_tag", "index_tag_away").await;
    assert_eq!(api.put(&entity(50), &json!({"tags": ["b"]})).await.0, 201);
    eventually("an apply failure on index_tag", Duration::from_secs(30), || async {
        let m = api.metrics().await;
        (metric_sum(&m, "bagstore_indexer_apply_failures_total", &[("index", "index_tag")]) > 0.0)
            .then_some(())
    })
    .await;
    rename_on_every_shard(&env, "index_tag_away", "index_tag").await;
    // Publish failures: the broker is down while a write waits in the outbox.
    env.kafka.broker_down(1).unwrap();
    assert_eq!(api.put(&entity(51), &json!({"user_id": uid(51)})).await.0, 201);
    eventually("a publish failure", Duration::from_secs(30), || async {
        let m = api.metrics().await;
        (metric_sum(&m, "bagstore_writer_publish_failures_total", &[]) > 0.0).then_some(())
    })
    .await;
    env.kafka.broker_up(1).unwrap();
    // Drift: an index row no entity produces.
    let hexb = |s: &str| schemas::EntityId::parse(s).unwrap().0.to_vec();
    let pool = env.pool(schemas::shard::initial_position_of(&hexb(&uid(999)), env.dsns.len())).await;
    sqlx::query("INSERT INTO index_user_id (user_id, entity_id, version, logical) VALUES (?, ?, 1, ?)")
        .bind(hexb(&uid(999)))
        .bind(hexb(&entity(999)))
        .bind(schemas::logical_of(&hexb(&uid(999)), 4096))
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
    until_query_is(&api, &json!({"where": {"user_id": uid(51)}}), &[&entity(51)]).await;
    until_query_is(&api, &json!({"where": {"tags": "b"}}), &[&entity(50)]).await;

    // The librdkafka mock cluster cannot list consumer groups, so
    // bagstore_index_consumers stays absent there (the cleaner logs why).
    let last_missing = std::sync::Mutex::new(BTreeSet::new());
    let scrape =
        eventually("every metric family used to appear in the scrape", Duration::from_secs(60), || {
            let api = api.clone();
            let (wanted, dev, last_missing) = (&wanted, &dev, &last_missing);
            async move {
                let text = api.metrics().await;
                let mut missing: BTreeSet<String> =
                    wanted.difference(&scraped_families(&text)).cloned().collect();
                if missing.contains("bagstore_index_consumers")
                    && dev.log_text().contains("cannot list consumer-group members")
                {
                    missing.remove("bagstore_index_consumers");
                }
                // Series of replicas: this stack has none (the failover
                // and read_routing suites check them on replicated shards).
                for per_replica in [
                    "bagstore_replica_lag_seconds",
                    "bagstore_replica_gtid_behind",
                    "bagstore_reader_replicas_usable",
                ] {
                    missing.remove(per_replica);
                }
                let mut last = last_missing.lock().unwrap();
                if missing != *last {
                    eprintln!("metric families not (yet) in the scrape: {missing:?}");
                    *last = missing.clone();
                }
                missing.is_empty().then_some(text)
            }
        })
        .await;
    // And the other way round: the dashboard shows every family bagstore exports.
    let unshown: Vec<String> = scraped_families(&scrape)
        .into_iter()
        .filter(|f| f.starts_with("bagstore_") && !dash_names.contains(f))
        .collect();
    assert!(unshown.is_empty(), "exported but on no dashboard panel: {unshown:?}");
    assert_eq!(metric_sum(&scrape, "bagstore_index_state", &[("index", "index_title")]), 2.0);
    assert_eq!(
        metric_sum(&scrape, "bagstore_cleaner_backfill_progress_ratio", &[("index", "index_title")]),
        1.0
    );
    assert_eq!(metric_sum(&scrape, "bagstore_writer_relay_leader", &[]), 2.0);
    dev.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lag_is_reported_while_no_indexer_runs_and_returns_to_zero_once_one_does() {
    let env = TestEnv::new("obslag", STANDARD_INDEXES).await;
    env.migrate().await;
    let writer = env.spawn(&["writer"]).await;
    let reader = env.spawn(&["reader"]).await;
    let cleaner = env.spawn(&["cleaner"]).await;
    const N: usize = 10;
    for i in 0..N {
        assert_eq!(writer.api().put(&entity(i), &json!({"user_id": uid(i)})).await.0, 201);
    }
    let capi = cleaner.api();
    let lag = |m: &str| {
        let idx = [("index", "index_user_id")];
        (
            metric_sum(m, "bagstore_index_lag_events", &idx),
            metric_sum(m, "bagstore_index_partition_lag_events", &idx),
            metric_sum(m, "bagstore_index_lag_seconds", &idx),
        )
    };
    // No consumer has committed anything: every event on the topic is lag.
    let first = eventually("the cleaner to report lag with no indexer", Duration::from_secs(30), || async {
        let (events, per_partition, seconds) = lag(&capi.metrics().await);
        (events == N as f64 && per_partition == events && seconds > 0.0).then_some(seconds)
    })
    .await;
    // The lag series carry kafka_exporter's labels (consumergroup, topic,
    // partition), so dashboards can join the two.
    let m = capi.metrics().await;
    let joined = [
        ("index", "index_user_id"),
        ("consumergroup", "bagstore-index-index_user_id"),
        ("topic", env.topic.as_str()),
    ];
    assert_eq!(metric_sum(&m, "bagstore_index_lag_events", &joined), N as f64);
    assert_eq!(metric_sum(&m, "bagstore_index_partition_lag_events", &joined), N as f64);
    assert!(m.contains("partition=\"0\""), "no partition label");
    // Nothing applies, so the time lag keeps growing.
    eventually("the time lag to grow", Duration::from_secs(15), || async {
        (lag(&capi.metrics().await).2 >= first + 2.0).then_some(())
    })
    .await;
    let query = json!({"where": {"user_id": uid(0)}, "allow_partial": true});
    let (status, body) = reader.api().query(&query).await;
    assert_eq!(status, 200, "{body}");

    let indexer = env.spawn(&["indexer"]).await;
    eventually("the lag to fall back to zero", Duration::from_secs(60), || async {
        let (events, per_partition, seconds) = lag(&capi.metrics().await);
        (events == 0.0 && per_partition == 0.0 && seconds == 0.0).then_some(())
    })
    .await;
    let m = capi.metrics().await;
    assert!(
        metric_sum(&m, "bagstore_index_applied_through_timestamp_seconds", &[("index", "index_user_id")])
            > 0.0
    );
    // The probe that read those offsets is recent (the lag gauges would
    // keep their last values if it failed; this one would age).
    let probed = metric_sum(&m, "bagstore_index_lag_probe_timestamp_seconds", &[("index", "index_user_id")]);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    assert!((now - 30.0..=now + 1.0).contains(&probed), "last lag probe at {probed}, now {now}");
    until_query_is(&reader.api(), &json!({"where": {"user_id": uid(3)}}), &[&entity(3)]).await;
    for p in [writer, reader, cleaner, indexer] {
        p.terminate().await;
    }
}

async fn prom_get(http: &reqwest::Client, base: &str, path: &str, query: Option<&str>) -> Value {
    let mut req = http.get(format!("{base}{path}"));
    if let Some(q) = query {
        req = req.query(&[("query", q)]);
    }
    match req.send().await {
        Ok(resp) => resp.json().await.unwrap_or(Value::Null),
        Err(_) => Value::Null,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_the_dev_stack_and_evaluates_the_rules() {
    let env = TestEnv::new("obsprom", STANDARD_INDEXES).await;
    let dev = env.dev().await;
    let api = dev.api();
    for i in 0..5 {
        assert_eq!(api.put(&entity(i), &json!({"user_id": uid(i)})).await.0, 201);
    }
    until_query_is(&api, &json!({"where": {"user_id": uid(2)}}), &[&entity(2)]).await;

    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let target = dev.url.trim_start_matches("http://").trim_end_matches('/').to_string();
    let dir = env.dir.path();
    let alerts = repo().join("deploy/prometheus/alerts.yml");
    let config = format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
         rule_files:\n  - {alerts:?}\n\
         scrape_configs:\n  - job_name: bagstore-dev\n    static_configs:\n      - targets: [{target:?}]\n"
    );
    std::fs::write(dir.join("prometheus.yml"), config).unwrap();
    let mut prometheus = bagstore_tests::command(prometheus_tool("prometheus"))
        .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.join("prometheus.out")).unwrap())
        .stderr(std::fs::File::create(dir.join("prometheus.log")).unwrap())
        .kill_on_drop(true)
        .spawn()
        .expect("start prometheus");
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();

    let lag = eventually("Prometheus to hold index_user_id's lag", Duration::from_secs(60), || async {
        let v = prom_get(&http, &base, "/api/v1/query", Some("bagstore_index_lag_seconds")).await;
        v["data"]["result"]
            .as_array()?
            .iter()
            .find(|s| s["metric"]["index"] == "index_user_id" && s["metric"]["job"] == "bagstore-dev")
            .cloned()
    })
    .await;
    let value: f64 = lag["value"][1].as_str().and_then(|s| s.parse().ok()).expect("a sample value");
    assert!(value >= 0.0, "{lag}");

    // Every alert rule loads and evaluates without error on real series.
    let want = read("deploy/prometheus/alerts.yml").matches("- alert:").count();
    let rules = eventually("every rule to be evaluated", Duration::from_secs(30), || async {
        let v = prom_get(&http, &base, "/api/v1/rules", None).await;
        let rules: Vec<Value> = v["data"]["groups"]
            .as_array()?
            .iter()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        (rules.len() == want && rules.iter().all(|r| r["health"] != "unknown")).then_some(rules)
    })
    .await;
    for r in &rules {
        let name = r["name"].as_str().unwrap_or_default();
        assert_eq!(r["type"], "alerting", "{r}");
        assert_eq!(r["health"], "ok", "rule {name}: {}", r["lastError"]);
        assert!(r["labels"]["severity"].is_string(), "rule {name} has no severity");
        for a in ["summary", "description"] {
            assert!(r["annotations"][a].as_str().is_some_and(|s| !s.is_empty()), "rule {name} has no {a}");
        }
    }

    // Every dashboard query is valid PromQL; the core panels have data.
    for expr in dashboard_exprs(&dashboard()) {
        if expr.starts_with("label_values(") {
            continue; // a Grafana variable query, not PromQL
        }
        let q = as_grafana_sends_it(&expr);
        let needs_data =
            ["bagstore_index_lag_seconds", "bagstore_index_state", "bagstore_http_requests_total"]
                .iter()
                .any(|m| expr.contains(m))
                || expr.starts_with("max by (shard, instance) (bagstore_writer_relay_leader)");
        let what = format!("Prometheus to answer the dashboard query {q}");
        eventually(&what, Duration::from_secs(30), || async {
            let v = prom_get(&http, &base, "/api/v1/query", Some(&q)).await;
            if v["status"] == "error" {
                panic!("dashboard query {q} is refused: {}", v["error"]);
            }
            let rows = v["data"]["result"].as_array()?.len();
            (v["status"] == "success" && (rows > 0 || !needs_data)).then_some(())
        })
        .await;
    }
    prometheus.kill().await.ok();
    dev.terminate().await;
}
