//! Typed configuration: one TOML file, then `BAGSTORE_<SECTION>__<KEY>`
//! environment variables on top (`BAGSTORE_KAFKA__BROKERS=kafka:9092`).
//! Deeper keys nest with more `__` (`BAGSTORE_KAFKA__OPTIONS__SASL.PASSWORD`).
//! A value is read as TOML when it parses as one (`8`, `true`, `["a","b"]`)
//! and as a plain string otherwise. Variables without `__` are not settings
//! and are ignored.
//!
//! Every field's doc comment is its entry in the configuration reference,
//! `docs/configuration.md`, which `schemas/src/settings/reference.rs`
//! generates and checks: a setting without one fails that test.

use serde::{Deserialize, Serialize};

use crate::index::IndexSpec;

mod mysql;
#[cfg(test)]
mod reference;
mod secrets;
mod sections;

pub use mysql::{FailoverMode, MysqlSettings};
pub use secrets::{is_secret_kafka_option, Dsn, Secret};
pub use sections::{
    AuthSettings, ChangesSettings, CleanerSettings, ExpirySettings, HttpSettings, IndexerSettings,
    IngestSettings, KafkaSettings, MoverSettings, ReadFrom, ReaderSettings, WriterSettings,
    EMBEDDED_FETCH_WAIT_MS, FETCH_WAIT_MS,
};

#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("cannot read config file {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("config is not valid TOML or has an unknown or mistyped key: {0}")]
    Parse(String),
    #[error("environment variable {var}: {reason}")]
    Env { var: String, reason: String },
    #[error("invalid config: {0}")]
    Invalid(String),
    /// A key of an earlier release that no longer exists. Refused rather
    /// than ignored: it asked for a behaviour this release does not have.
    #[error("{key} (set in {place}) was removed: {why}; delete it")]
    Removed { key: String, place: String, why: &'static str },
}

/// Keys that earlier releases read, and why each went (see
/// [`SettingsError::Removed`]).
const REMOVED: &[(&str, &str, &str)] = &[
    (
        "writer",
        "outbox",
        "the outbox is always the InnoDB table (the binary-log outbox is gone; \
         docs/operations.md says how to upgrade a store that ran it)",
    ),
    ("cleaner", "backfill_method", "a backfill always upserts in small resumable transactions"),
    ("cleaner", "backfill_bulk_rows", "it sized the bulk backfill, which is gone"),
    (
        "indexer",
        "assignment",
        "the index consumers always take their partitions by member leases on the metadata shard \
         (the broker's group protocol is gone; docs/operations.md says how to upgrade)",
    ),
    (
        "ingest",
        "assignment",
        "the writers' ingest always takes its partitions by member leases on the metadata shard \
         (the broker's group protocol is gone; docs/operations.md says how to upgrade)",
    ),
];

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    #[serde(default)]
    pub mysql: MysqlSettings,
    #[serde(default)]
    pub kafka: KafkaSettings,
    #[serde(default)]
    pub http: HttpSettings,
    #[serde(default)]
    pub writer: WriterSettings,
    #[serde(default)]
    pub indexer: IndexerSettings,
    #[serde(default)]
    pub reader: ReaderSettings,
    #[serde(default)]
    pub cleaner: CleanerSettings,
    #[serde(default)]
    pub expiry: ExpirySettings,
    #[serde(default)]
    pub changes: ChangesSettings,
    #[serde(default)]
    pub ingest: IngestSettings,
    #[serde(default)]
    pub mover: MoverSettings,
    #[serde(default)]
    pub auth: AuthSettings,
    /// The secondary indexes, one `[[indexes]]` table each, in the file
    /// only (no environment variable sets them). Each has:
    ///
    /// - `table`: the index table's name, `[a-z][a-z0-9_]{0,63}`;
    /// - `properties`: the indexed properties in order, each `{ name, type }`
    ///   with `type` one of `uuid`, `string` (with `max_len`, in characters,
    ///   default 255), `int`, `float`, `bool`;
    /// - `shard_on`: the property whose value picks the shard of an index
    ///   row (default: the first property);
    /// - `match_on`: equality conditions an entity must meet to be in the
    ///   index (a partial index), e.g. `match_on = { kind = "post" }`;
    /// - `unique`: `true` lets at most one live entity hold each key; a
    ///   write that would give a second one a key is refused (409
    ///   `unique-violation`). Its rows are written by the writers, not an
    ///   indexer. See `docs/operations.md`, "Unique indexes".
    ///
    /// An entity that lacks an indexed property is not in the index; an
    /// array value is indexed once per element. A new index is created by
    /// `bagstore migrate` and filled by the cleaner's backfill; a changed
    /// definition is refused (drop it, or use a new table name). See
    /// `docs/operations.md`, "Adding and dropping an index".
    #[serde(default)]
    pub indexes: Vec<IndexSpec>,
}

impl Settings {
    /// The topics besides `kafka.topic` and its dead-letter topic that
    /// `migrate` (and `bagstore dev`'s embedded Kafka) create: the public
    /// change stream's and Kafka ingest's, those that are on.
    pub fn extra_topics(&self) -> Vec<String> {
        let mut topics = Vec::new();
        if self.changes.enabled {
            topics.push(self.changes.topic.clone());
        }
        if self.ingest.enabled {
            topics.push(self.ingest.topic.clone());
            topics.push(self.ingest.dlq_topic());
            if !self.ingest.reply_topic.is_empty() {
                topics.push(self.ingest.reply_topic.clone());
            }
        }
        topics
    }

    /// Parses a TOML document, applies the `BAGSTORE_…` variables of `env`
    /// on top, validates. (Reading the file and the process environment is
    /// the caller's: `service::config::load`.)
    pub fn from_toml_and_env(
        text: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Settings, SettingsError> {
        let mut doc: toml::Table = toml::from_str(text).map_err(|e| SettingsError::Parse(e.to_string()))?;
        for &(section, key, why) in REMOVED {
            if doc.get(section).and_then(|t| t.get(key)).is_some() {
                let place = "the config file".into();
                return Err(SettingsError::Removed { key: format!("{section}.{key}"), place, why });
            }
        }
        let mut vars: Vec<(String, String)> = env.into_iter().collect();
        vars.sort();
        for (var, _) in &vars {
            let removed = REMOVED.iter().find(|(section, key, _)| {
                *var == format!("BAGSTORE_{}__{}", section.to_ascii_uppercase(), key.to_ascii_uppercase())
            });
            if let Some(&(section, key, why)) = removed {
                let place = format!("the environment, {var}");
                return Err(SettingsError::Removed { key: format!("{section}.{key}"), place, why });
            }
        }
        for (var, raw) in vars {
            let Some(path) = var.strip_prefix("BAGSTORE_") else { continue };
            if !path.contains("__") {
                continue;
            }
            let keys: Vec<String> = path.split("__").map(str::to_ascii_lowercase).collect();
            if keys.iter().any(String::is_empty) {
                return Err(SettingsError::Env { var, reason: "empty section or key".into() });
            }
            let value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
                .ok()
                .and_then(|mut t| t.remove("v"))
                .unwrap_or(toml::Value::String(raw));
            let mut table = &mut doc;
            for k in &keys[..keys.len() - 1] {
                let entry = table.entry(k.clone()).or_insert_with(|| toml::Value::Table(Default::default()));
                table = entry.as_table_mut().ok_or_else(|| SettingsError::Env {
                    var: var.clone(),
                    reason: format!("{k} is not a section"),
                })?;
            }
            table.insert(keys[keys.len() - 1].clone(), value);
        }
        let settings: Settings = toml::Value::Table(doc)
            .try_into()
            .map_err(|e: toml::de::Error| SettingsError::Parse(e.to_string()))?;
        settings.validate()?;
        Ok(settings)
    }

    pub fn validate(&self) -> Result<(), SettingsError> {
        for (i, spec) in self.indexes.iter().enumerate() {
            spec.validate().map_err(|e| SettingsError::Invalid(e.to_string()))?;
            if self.indexes[..i].iter().any(|o| o.table == spec.table) {
                return Err(SettingsError::Invalid(format!("index {:?} is defined twice", spec.table)));
            }
        }
        if self.http.request_timeout_ms == 0 {
            return Err(SettingsError::Invalid("http.request_timeout_ms must be positive".into()));
        }
        if self.kafka.partitions < 1 {
            return Err(SettingsError::Invalid("kafka.partitions must be at least 1".into()));
        }
        if self.kafka.replication_factor < 1 {
            return Err(SettingsError::Invalid("kafka.replication_factor must be at least 1".into()));
        }
        // Kafka's rule for group ids is "any string"; ours keeps them
        // printable and short enough for logs, metrics and tools.
        let prefix = &self.kafka.group_prefix;
        if prefix.len() > 100 || !prefix.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c)) {
            return Err(SettingsError::Invalid(format!(
                "kafka.group_prefix {prefix:?}: use at most 100 of the characters a-z, A-Z, 0-9, '.', '_' and '-'"
            )));
        }
        for (key, member) in
            [("indexer.member", &self.indexer.member), ("ingest.member", &self.ingest.member)]
        {
            if let Some(m) = member {
                if m.is_empty() || m.len() > 255 || m.chars().any(char::is_control) {
                    return Err(SettingsError::Invalid(format!(
                        "{key} {m:?}: give 1 to 255 printable characters (the pod's name, say)"
                    )));
                }
            }
        }
        if self.writer.max_body_bytes == 0
            || self.writer.max_batch == 0
            || self.writer.relay_batch == 0
            || self.writer.commit_slots == 0
            || self.writer.max_pending_writes < self.writer.max_batch
            || self.reader.max_concurrent == 0
        {
            return Err(SettingsError::Invalid(
                "writer and reader limits must be positive, and writer.max_pending_writes at least writer.max_batch"
                    .into(),
            ));
        }
        self.validate_topics()?;
        if self.expiry.property.as_deref().is_some_and(|p| p.is_empty()) {
            return Err(SettingsError::Invalid(
                "expiry.property must name a property (or be left out)".into(),
            ));
        }
        if self.cleaner.batch == 0
            || self.cleaner.expiry_interval_ms == 0
            || self.cleaner.purge_interval_ms == 0
            || self.cleaner.backfill_batch == 0
            || self.cleaner.backfill_concurrency == 0
        {
            return Err(SettingsError::Invalid(
                "cleaner batch sizes, intervals and concurrency must be positive".into(),
            ));
        }
        if !(self.cleaner.backfill_health_slack_ms > 0.0 && self.cleaner.backfill_health_slack_ms.is_finite())
        {
            return Err(SettingsError::Invalid(
                "cleaner.backfill_health_slack_ms must be a positive number".into(),
            ));
        }
        if self.mover.batch == 0
            || self.mover.logicals_per_move == 0
            || self.mover.cutover_attempts == 0
            || self.mysql.map_refresh_ms == 0
            || self.mysql.failover_after_ms == 0
            || self.writer.commit_timeout_ms == 0
        {
            return Err(SettingsError::Invalid(
                "mover.batch, mover.logicals_per_move, mover.cutover_attempts, mysql.map_refresh_ms, \
                 mysql.failover_after_ms and writer.commit_timeout_ms must be positive"
                    .into(),
            ));
        }
        if !(1..=10_000).contains(&self.writer.unique_reservation_ms) {
            return Err(SettingsError::Invalid("writer.unique_reservation_ms must be 1 to 10000".into()));
        }
        if self.indexer.batch_max == 0 || self.reader.max_limit == 0 || self.reader.max_in == 0 {
            return Err(SettingsError::Invalid("indexer and reader limits must be positive".into()));
        }
        Ok(())
    }

    /// The change stream's and the Kafka ingest's topics: each of its own.
    fn validate_topics(&self) -> Result<(), SettingsError> {
        if self.changes.enabled
            && (self.changes.topic.is_empty()
                || self.changes.topic == self.kafka.topic
                || self.changes.topic == self.kafka.dlq_topic())
        {
            return Err(SettingsError::Invalid(format!(
                "changes.topic {:?} must be a topic of its own (not kafka.topic or its dead-letter topic)",
                self.changes.topic
            )));
        }
        if self.ingest.enabled {
            let ours = [&self.kafka.topic, &self.kafka.dlq_topic(), &self.changes.topic];
            let (topic, replies) = (&self.ingest.topic, &self.ingest.reply_topic);
            if topic.is_empty() || ours.contains(&topic) || ours.contains(&replies) || replies == topic {
                return Err(SettingsError::Invalid(format!(
                    "ingest.topic {topic:?} and ingest.reply_topic {replies:?} must be topics of their own (not kafka.topic, its dead-letter topic or changes.topic)"
                )));
            }
            if self.ingest.batch == 0 {
                return Err(SettingsError::Invalid("ingest.batch must be positive".into()));
            }
        }
        Ok(())
    }

    /// What a service needs before it starts: real shards and brokers.
    pub fn require_external(&self) -> Result<(), SettingsError> {
        if self.mysql.shards.is_empty() {
            return Err(SettingsError::Invalid(
                "mysql.shards is empty: list one DSN per shard (or set BAGSTORE_MYSQL__SHARDS)".into(),
            ));
        }
        if self.kafka.brokers.is_empty() {
            return Err(SettingsError::Invalid(
                "kafka.brokers is empty (or set BAGSTORE_KAFKA__BROKERS)".into(),
            ));
        }
        Ok(())
    }

    pub fn index(&self, table: &str) -> Option<&IndexSpec> {
        self.indexes.iter().find(|s| s.table == table)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) const EXAMPLE: &str = r#"
        [mysql]
        shards = ["mysql://root@127.0.0.1:3307/bagstore", "mysql://root:hunter2@127.0.0.1:3308/bagstore"]
        [kafka]
        brokers = "127.0.0.1:9092"
        topic = "bagstore.entity-changes"
        [[indexes]]
        table = "index_user_id"
        properties = [{ name = "user_id", type = "uuid" }]
        shard_on = "user_id"
        [[indexes]]
        table = "index_foo"
        properties = [{ name = "bar", type = "int" }]
        match_on = { m = "right" }
    "#;

    pub(crate) fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn the_readme_example_loads() {
        let s = Settings::from_toml_and_env(EXAMPLE, env(&[])).unwrap();
        assert_eq!(s.mysql.shards.len(), 2);
        assert_eq!(s.indexes[1].match_on["m"], serde_json::json!("right"));
        assert_eq!(s.kafka.dlq_topic(), "bagstore.entity-changes.dlq");
    }

    #[test]
    fn production_kafka_defaults_and_the_group_prefix() {
        let s = Settings::from_toml_and_env(EXAMPLE, env(&[])).unwrap();
        assert_eq!(s.kafka.replication_factor, 3);
        assert_eq!(s.kafka.group_for("index_foo"), "bagstore-index-index_foo");
        let s = Settings::from_toml_and_env(EXAMPLE, env(&[("BAGSTORE_KAFKA__GROUP_PREFIX", "staging.")]))
            .unwrap();
        assert_eq!(s.kafka.group_for("index_foo"), "staging.bagstore-index-index_foo");
        for bad in ["with space", "tab\t", "ünïcode", &"x".repeat(101)] {
            let err = Settings::from_toml_and_env(EXAMPLE, env(&[("BAGSTORE_KAFKA__GROUP_PREFIX", bad)]));
            assert!(err.is_err_and(|e| e.to_string().contains("kafka.group_prefix")), "{bad:?} accepted");
        }
        let err = Settings::from_toml_and_env(EXAMPLE, env(&[("BAGSTORE_KAFKA__REPLICATION_FACTOR", "0")]));
        assert!(err.is_err_and(|e| e.to_string().contains("kafka.replication_factor")));
    }

    #[test]
    fn environment_overrides_the_file() {
        let s = Settings::from_toml_and_env(
            EXAMPLE,
            env(&[
                ("BAGSTORE_KAFKA__BROKERS", "kafka:9092"),
                ("BAGSTORE_KAFKA__PARTITIONS", "3"),
                ("BAGSTORE_MYSQL__SHARDS", "mysql://a/x, mysql://b/x"),
                ("BAGSTORE_HTTP__ADDR", "0.0.0.0:9000"),
                ("BAGSTORE_SOAK", "ignored: no section"),
            ]),
        )
        .unwrap();
        assert_eq!(s.kafka.brokers, "kafka:9092");
        assert_eq!(s.kafka.partitions, 3);
        assert_eq!(s.mysql.shards, vec![Dsn("mysql://a/x".into()), Dsn("mysql://b/x".into())]);
        assert_eq!(s.http.addr, "0.0.0.0:9000");
    }

    #[test]
    fn the_request_timeout_defaults_to_30_s_and_must_be_positive() {
        let s = Settings::from_toml_and_env("", env(&[])).unwrap();
        assert_eq!(s.http.request_timeout(), std::time::Duration::from_secs(30));
        let s =
            Settings::from_toml_and_env("", env(&[("BAGSTORE_HTTP__REQUEST_TIMEOUT_MS", "500")])).unwrap();
        assert_eq!(s.http.request_timeout_ms, 500);
        assert!(Settings::from_toml_and_env("[http]\nrequest_timeout_ms = 0", env(&[])).is_err());
    }

    #[test]
    fn a_removed_key_fails_naming_it_whether_in_the_file_or_the_environment() {
        for (toml, var) in [
            ("[writer]\noutbox = \"binlog\"", "BAGSTORE_WRITER__OUTBOX"),
            ("[cleaner]\nbackfill_method = \"bulk\"", "BAGSTORE_CLEANER__BACKFILL_METHOD"),
            ("[cleaner]\nbackfill_bulk_rows = 10", "BAGSTORE_CLEANER__BACKFILL_BULK_ROWS"),
            ("[indexer]\nassignment = \"leases\"", "BAGSTORE_INDEXER__ASSIGNMENT"),
            ("[ingest]\nassignment = \"group\"", "BAGSTORE_INGEST__ASSIGNMENT"),
        ] {
            let key = var.trim_start_matches("BAGSTORE_").replace("__", ".").to_ascii_lowercase();
            let e = Settings::from_toml_and_env(toml, env(&[])).unwrap_err().to_string();
            assert!(e.contains(&key) && e.contains("removed") && e.contains("config file"), "{e}");
            // Even set to what is now the only behaviour: the key is gone.
            let e = Settings::from_toml_and_env("", env(&[(var, "table")])).unwrap_err().to_string();
            assert!(e.contains(&key) && e.contains("removed") && e.contains(var), "{e}");
        }
    }

    #[test]
    fn a_member_is_named_by_the_process_unless_a_sound_name_is_set() {
        let s = Settings::from_toml_and_env("", env(&[])).unwrap();
        assert_eq!((s.indexer.member.as_deref(), s.ingest.member.as_deref()), (None, None));
        let vars =
            [("BAGSTORE_INDEXER__MEMBER", "bagstore-indexer-7f9c"), ("BAGSTORE_INGEST__MEMBER", "writer-1")];
        let s = Settings::from_toml_and_env("", env(&vars)).unwrap();
        assert_eq!(s.indexer.member.as_deref(), Some("bagstore-indexer-7f9c"));
        assert_eq!(s.ingest.member.as_deref(), Some("writer-1"));
        let s = Settings::from_toml_and_env("[ingest]\nmember = \"writer-0\"", env(&[])).unwrap();
        assert_eq!((s.ingest.member.as_deref(), s.indexer.member.as_deref()), (Some("writer-0"), None));
        for bad in ["\"\"", "\"a\\tb\"", &format!("{:?}", "m".repeat(256))] {
            for section in ["indexer", "ingest"] {
                let e = Settings::from_toml_and_env(&format!("[{section}]\nmember = {bad}"), env(&[]))
                    .unwrap_err();
                assert!(e.to_string().contains(&format!("{section}.member")), "{bad}: {e}");
            }
        }
    }

    #[test]
    fn the_index_consumers_fetch_wait_is_20_ms_unless_set() {
        let s = Settings::from_toml_and_env("", env(&[])).unwrap();
        assert_eq!(s.indexer.fetch_wait_ms, None);
        assert_eq!(s.indexer.fetch_wait_ms(), FETCH_WAIT_MS);
        let s = Settings::from_toml_and_env("[indexer]\nfetch_wait_ms = 5", env(&[])).unwrap();
        assert_eq!(s.indexer.fetch_wait_ms(), 5);
        let s = Settings::from_toml_and_env("", env(&[("BAGSTORE_INDEXER__FETCH_WAIT_MS", "7")])).unwrap();
        assert_eq!(s.indexer.fetch_wait_ms(), 7);
    }

    #[test]
    fn mistakes_are_reported() {
        assert!(Settings::from_toml_and_env("[kafka]\nbrokerz = 1", env(&[])).is_err());
        assert!(Settings::from_toml_and_env("", env(&[("BAGSTORE_KAFKA__PARTITIONS", "0")])).is_err());
        let dup = "[[indexes]]\ntable='t'\nproperties=[{name='a',type='int'}]\n".repeat(2);
        assert!(Settings::from_toml_and_env(&dup, env(&[])).is_err());
    }
}
