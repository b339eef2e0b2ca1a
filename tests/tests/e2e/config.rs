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
