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

#[test]
fn every_bagstore_variable_in_docker_compose_is_a_setting() {
    let compose = std::fs::read_to_string(repo("docker-compose.yml")).unwrap();
    let vars: Vec<(String, String)> = compose
        .lines()
        .filter_map(|l| l.trim().strip_prefix("BAGSTORE_"))
        .map(|rest| {
            let (k, v) = rest.split_once(':').expect("KEY: value");
            (format!("BAGSTORE_{k}"), v.trim().trim_matches('"').to_string())
        })
        .collect();
    assert!(vars.len() >= 3, "{vars:?}");
    let base = std::fs::read_to_string(repo("deploy/bagstore.toml")).unwrap();
    let s = Settings::from_toml_and_env(&base, vars.clone()).unwrap();
    assert_eq!(s.kafka.brokers, "kafka:9092");
    assert_eq!(s.mysql.shards.len(), 2);
    // An unknown key would have been rejected (deny_unknown_fields); prove the check bites.
    let typo = vec![("BAGSTORE_KAFKA__BROKER".to_string(), "x".to_string())];
    assert!(Settings::from_toml_and_env(&base, typo).is_err());
}
