//! The configuration files shipped in `deploy/` load, and the variables
//! docker-compose sets are ones the loader understands.

use schemas::Settings;
use std::path::Path;

fn repo(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

#[test]
fn the_shipped_configs_load_and_validate() {
    for file in ["deploy/bagstore.toml", "deploy/bagstore.dev.toml"] {
        let s = Settings::from_toml_and_env(&std::fs::read_to_string(repo(file)).unwrap(), Vec::new())
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(s.indexes.len(), 3, "{file}");
    }
}

/// docker-compose cannot run here (no Docker engine), so it is checked
/// statically: it parses, every service has an image or a build whose files
/// exist, dependencies name real services, host ports do not collide,
/// mounted files exist, and every `BAGSTORE_…` variable is a setting the
/// loader accepts (unknown keys are errors there).
#[test]
fn docker_compose_is_consistent() {
    let text = std::fs::read_to_string(repo("docker-compose.yml")).unwrap();
    let mut doc: serde_yaml::Value = serde_yaml::from_str(&text).expect("docker-compose.yml parses");
    doc.apply_merge().expect("merge keys resolve");
    let services = doc["services"].as_mapping().expect("services");
    let names: Vec<String> = services.keys().map(|k| k.as_str().unwrap().to_string()).collect();
    for want in [
        "mysql0",
        "mysql1",
        "kafka",
        "migrate",
        "writer",
        "indexer",
        "reader",
        "cleaner",
        "prometheus",
        "grafana",
    ] {
        assert!(names.iter().any(|n| n == want), "service {want} missing");
    }
    let base = std::fs::read_to_string(repo("deploy/bagstore.toml")).unwrap();
    let mut host_ports = Vec::new();
    for (name, svc) in services {
        let name = name.as_str().unwrap();
        let has_image = svc["image"].as_str().is_some();
        if let Some(build) = svc.get("build") {
            let ctx = build["context"].as_str().unwrap_or(".");
            let file = build["dockerfile"].as_str().unwrap_or("Dockerfile");
            assert!(repo(ctx).join(file).exists(), "{name}: {file} missing");
        } else {
            assert!(has_image, "{name} has neither image nor build");
        }
        let deps: Vec<String> = match &svc["depends_on"] {
            serde_yaml::Value::Mapping(m) => m.keys().map(|k| k.as_str().unwrap().to_string()).collect(),
            serde_yaml::Value::Sequence(v) => v.iter().map(|k| k.as_str().unwrap().to_string()).collect(),
            _ => Vec::new(),
        };
        for d in deps {
            assert!(names.contains(&d), "{name} depends on unknown service {d}");
            assert_ne!(d, name, "{name} depends on itself");
        }
        if let Some(ports) = svc["ports"].as_sequence() {
            for p in ports {
                let host = p.as_str().unwrap().split(':').next().unwrap().to_string();
                assert!(!host_ports.contains(&host), "host port {host} published twice");
                host_ports.push(host);
            }
        }
        if let Some(vols) = svc["volumes"].as_sequence() {
            for v in vols {
                let src = v.as_str().unwrap().split(':').next().unwrap();
                if src.starts_with("./") {
                    assert!(repo(src).exists(), "{name} mounts missing {src}");
                }
            }
        }
        let vars: Vec<(String, String)> = svc["environment"]
            .as_mapping()
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| {
                        let k = k.as_str()?.to_string();
                        let v = match v {
                            serde_yaml::Value::String(s) => s.clone(),
                            other => serde_yaml::to_string(other).ok()?.trim().to_string(),
                        };
                        k.starts_with("BAGSTORE_").then_some((k, v))
                    })
                    .collect()
            })
            .unwrap_or_default();
        if svc["command"].as_sequence().is_some_and(|c| c.iter().any(|a| a.as_str() == Some("--config"))) {
            assert!(
                vars.len() >= 3,
                "{name}: the bagstore services take their settings from BAGSTORE_ variables"
            );
            let s = schemas::Settings::from_toml_and_env(&base, vars.clone())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(s.kafka.brokers, "kafka:9092", "{name}");
            assert_eq!(s.mysql.shards.len(), 2, "{name}");
            for dsn in &s.mysql.shards {
                let host = dsn.expose().split('@').nth(1).unwrap().split(':').next().unwrap();
                assert!(names.iter().any(|n| n == host), "{name}: DSN host {host} is not a service");
            }
        }
    }
    // An unknown key would have been rejected (deny_unknown_fields); prove the check bites.
    let typo = vec![("BAGSTORE_KAFKA__BROKER".to_string(), "x".to_string())];
    assert!(schemas::Settings::from_toml_and_env(&base, typo).is_err());
}

/// Production's default is 3 replicas. Against a cluster with fewer
/// brokers `migrate` says which setting to change and exits non-zero
/// before it makes a topic. (The topics themselves are made through the
/// admin API by the tansu suites' `migrate`, with 1 replica.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_names_the_replication_factor_a_small_cluster_cannot_hold() {
    let env = bagstore_tests::TestEnv::new("replication", "").await;
    let fresh = format!("{}-fresh", env.topic);
    let toml = env
        .config_toml()
        .replace("replication_factor = 1\n", "")
        .replace(&format!("topic = {:?}", env.topic), &format!("topic = {fresh:?}"));
    assert!(toml.contains(&fresh) && !toml.contains("replication_factor"), "{toml}");
    let path = env.dir.path().join("default-replication.toml");
    std::fs::write(&path, toml).unwrap();
    let args: Vec<String> = vec!["migrate".into(), "--config".into(), path.display().to_string()];
    let (ok, out, err) = env.run(&args, &[]).await;
    assert!(!ok, "migrate succeeded with 3 replicas on one broker: {out}");
    assert!(
        err.contains("1 broker(s), fewer than kafka.replication_factor = 3")
            && err.contains("1 for a single broker"),
        "{err}"
    );
    // The env's own topics exist: the same check does not stand in the way.
    let (ok, out, err) =
        env.run(&env.args(&["migrate"]), &[("BAGSTORE_KAFKA__REPLICATION_FACTOR", "3")]).await;
    assert!(ok, "{out}{err}");
}

/// Indexers of an environment with `kafka.group_prefix` consume and commit
/// under their own groups, leaving the unprefixed ones untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_prefix_keeps_an_environments_consumer_groups_apart() {
    let env = bagstore_tests::TestEnv::new("groupprefix", bagstore_tests::STANDARD_INDEXES).await;
    env.migrate().await;
    let writer = env.spawn(&["writer"]).await;
    let _indexer = env.spawn_env(&["indexer"], &[("BAGSTORE_KAFKA__GROUP_PREFIX", "env-a.")]).await;
    for i in 0..5u32 {
        let id = format!("{:032x}", 0xabc000 + i);
        let (status, body) =
            writer.api().put(&id, &serde_json::json!({"user_id": format!("{:032x}", i)})).await;
        assert_eq!(status, 201, "{body}");
    }
    let kafka = env.kafka_settings();
    bagstore_tests::eventually(
        "the prefixed group committed every event",
        std::time::Duration::from_secs(60),
        || {
            let kafka = kafka.clone();
            async move {
                let parts =
                    service::kafka::group_lag(&kafka, "env-a.bagstore-index-index_user_id").await.ok()?;
                let events: i64 = parts.iter().map(|p| p.high_watermark).sum();
                (events >= 5
                    && parts.iter().all(|p| p.lag() == 0 && (p.committed.is_some() || p.high_watermark == 0)))
                .then_some(())
            }
        },
    )
    .await;
    let plain = service::kafka::group_lag(&kafka, "bagstore-index-index_user_id").await.unwrap();
    assert!(plain.iter().all(|p| p.committed.is_none()), "the unprefixed group committed: {plain:?}");
}

/// The image, checked statically (no Docker engine here): a build stage and
/// a runtime stage, the runtime running as a numeric non-root user, OCI
/// labels with the license Cargo.toml declares, and a `.dockerignore` that
/// keeps build output and history out of the context.
#[test]
fn the_image_builds_in_two_stages_and_runs_as_a_non_root_user() {
    let text = std::fs::read_to_string(repo("deploy/Dockerfile")).unwrap();
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.starts_with('#')).collect();
    let stages: Vec<usize> = (0..lines.len()).filter(|&i| lines[i].starts_with("FROM ")).collect();
    assert_eq!(stages.len(), 2, "expected a build and a runtime stage");
    let runtime = &lines[*stages.last().unwrap()..];
    assert!(
        runtime.iter().any(|l| l.starts_with("COPY --from=build ")),
        "the runtime stage copies the build's binary"
    );
    let user =
        runtime.iter().rev().find_map(|l| l.strip_prefix("USER ")).expect("the runtime stage sets USER");
    let uid = user.split(':').next().unwrap();
    assert!(
        uid.parse::<u32>().is_ok_and(|u| u != 0),
        "USER {user}: a numeric non-root uid (runAsNonRoot can check it)"
    );
    let manifest = std::fs::read_to_string(repo("Cargo.toml")).unwrap();
    let license = manifest.lines().find_map(|l| l.strip_prefix("license = ")).unwrap().trim_matches('"');
    for label in ["org.opencontainers.image.title=", "org.opencontainers.image.description="] {
        assert!(text.contains(label), "missing label {label}");
    }
    assert!(
        text.contains(&format!("org.opencontainers.image.licenses=\"{license}\"")),
        "license label ≠ {license}"
    );
    assert!(repo("LICENSE").exists(), "LICENSE file");
    let ignore = std::fs::read_to_string(repo(".dockerignore")).expect(".dockerignore");
    for entry in ["target/", ".git/"] {
        assert!(ignore.lines().any(|l| l.trim() == entry), ".dockerignore lacks {entry}");
    }
}
