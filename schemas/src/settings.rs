//! Typed configuration: a TOML file, then `BAGSTORE_<SECTION>__<KEY>`
//! environment variables on top (`BAGSTORE_KAFKA__BROKERS=kafka:9092`).
//! Deeper keys nest with more `__`. A value is read as TOML when it parses
//! as one (`8`, `true`, `["a","b"]`) and as a plain string otherwise.
//! Variables without `__` are not settings and are ignored.

use serde::{Deserialize, Deserializer, Serialize};
use std::fmt;
use std::path::Path;

use crate::index::IndexSpec;

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
}

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
    pub auth: AuthSettings,
    #[serde(default)]
    pub indexes: Vec<IndexSpec>,
}

/// A bearer token. It never appears in Debug output or logs.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl Secret {
    /// Compares without stopping at the first differing byte.
    pub fn matches(&self, presented: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), presented.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

fn secrets_list_or_csv<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Secret>, D::Error> {
    Ok(list_or_csv(d)?.into_iter().map(|dsn| Secret(dsn.0)).collect())
}

/// Optional bearer tokens per role. A role with no tokens is open; admin
/// tokens are accepted everywhere.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthSettings {
    /// Writes: `POST/PUT/DELETE /v1/entities…`.
    #[serde(deserialize_with = "secrets_list_or_csv")]
    pub write_tokens: Vec<Secret>,
    /// Reads: entity gets, queries, index list, lag.
    #[serde(deserialize_with = "secrets_list_or_csv")]
    pub read_tokens: Vec<Secret>,
    /// Index administration (`DELETE /v1/indexes/{table}`), and everything else.
    #[serde(deserialize_with = "secrets_list_or_csv")]
    pub admin_tokens: Vec<Secret>,
    /// Require a read token for `/metrics` too.
    pub protect_metrics: bool,
}

/// A MySQL connection URL. Its password never appears in Debug or Display.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Dsn(pub String);

impl Dsn {
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The URL with any password replaced by `***`: the one in the user
    /// info, and the value of any query parameter that names a password
    /// (sqlx ignores those, but DSNs copied from other drivers carry them).
    /// TLS parameters (`ssl-mode`, `ssl-ca`, `ssl-cert`, `ssl-key`) are paths
    /// and modes, not secrets, and stay readable.
    pub fn redacted(&self) -> String {
        let s = &self.0;
        let Some(scheme_end) = s.find("://").map(|i| i + 3) else { return s.clone() };
        // The authority ends at the first '/', '?' or '#'. The user info is
        // everything before its *last* '@', so an unescaped '@' inside a
        // password does not leave the password's tail visible.
        let authority_end = s[scheme_end..].find(['/', '?', '#']).map_or(s.len(), |i| scheme_end + i);
        let authority = &s[scheme_end..authority_end];
        let mut out = String::with_capacity(s.len());
        out.push_str(&s[..scheme_end]);
        match authority.rfind('@') {
            Some(at) => {
                let user_info = &authority[..at];
                match user_info.split_once(':') {
                    Some((user, _password)) => {
                        out.push_str(user);
                        out.push_str(":***");
                    }
                    None => out.push_str(user_info),
                }
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        let rest = &s[authority_end..];
        let (path, query) = match rest.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (rest, None),
        };
        out.push_str(path);
        if let Some(query) = query {
            out.push('?');
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((key, _)) if names_a_password(key) => format!("{key}=***"),
                    _ => pair.to_string(),
                })
                .collect();
            out.push_str(&pairs.join("&"));
        }
        out
    }
}

/// `password`, `pwd`, `passwd`, and spellings like `db-password`.
fn names_a_password(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    key.contains("password") || key.contains("passwd") || key == "pwd" || key.contains("secret")
}

impl fmt::Debug for Dsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Dsn({})", self.redacted())
    }
}

impl fmt::Display for Dsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MysqlSettings {
    /// One DSN per shard, in shard order. Order is part of the data layout:
    /// reordering it sends reads to the wrong shard. May be a TOML list or,
    /// from the environment, a comma-separated string.
    #[serde(deserialize_with = "list_or_csv")]
    pub shards: Vec<Dsn>,
    /// Pool size per shard and process; the hot-path connections
    /// ([`crate::conns`]) have their own cap of the same size.
    pub max_connections: u32,
    pub connect_timeout_ms: u64,
}

impl Default for MysqlSettings {
    fn default() -> Self {
        MysqlSettings { shards: Vec::new(), max_connections: 16, connect_timeout_ms: 10_000 }
    }
}

fn list_or_csv<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Dsn>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        List(Vec<String>),
        Csv(String),
    }
    Ok(match Either::deserialize(d)? {
        Either::List(v) => v.into_iter().map(Dsn).collect(),
        Either::Csv(s) => {
            s.split(',').map(str::trim).filter(|s| !s.is_empty()).map(|s| Dsn(s.to_string())).collect()
        }
    })
}

/// Debug output redacts secret `options` (see [`is_secret_kafka_option`]).
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaSettings {
    /// bootstrap.servers
    pub brokers: String,
    /// The change-event topic; undecodable events go to `<topic>.dlq`.
    pub topic: String,
    /// Partitions `bagstore migrate` creates the topic with.
    pub partitions: i32,
    pub replication_factor: i32,
    /// Consumer session timeout: how long a dead indexer holds its partitions.
    pub session_timeout_ms: u64,
    /// How long the relay lets librdkafka retry one event before it gives up
    /// and the outbox row is tried again.
    pub message_timeout_ms: u64,
    /// Extra librdkafka properties for every client (e.g. `security.protocol`,
    /// `ssl.ca.location`, `sasl.password`, `debug`), applied last. This is
    /// how TLS and SASL reach every producer, consumer and admin client.
    pub options: std::collections::BTreeMap<String, String>,
}

/// Whether a librdkafka property holds a secret, so its value must never be
/// printed: the properties librdkafka itself marks sensitive (and redacts in
/// its own `debug=conf` dump), plus anything whose name looks like a
/// password, secret, token, credential or private key, including common
/// misspellings (`ssl.key.pasword`), since a typo is still the secret.
pub fn is_secret_kafka_option(key: &str) -> bool {
    const SENSITIVE: &[&str] = &[
        "ssl.key.location",
        "ssl.key.password",
        "ssl.key.pem",
        "ssl_key",
        "ssl.ca.pem",
        "ssl.keystore.password",
        "sasl.username",
        "sasl.password",
        "sasl.oauthbearer.config",
        "sasl.oauthbearer.client.secret",
        "sasl.oauthbearer.assertion.private.key.file",
        "sasl.oauthbearer.assertion.private.key.passphrase",
        "sasl.oauthbearer.assertion.private.key.pem",
        "sasl.jaas.config",
    ];
    let key = key.trim().to_ascii_lowercase();
    SENSITIVE.contains(&key.as_str())
        || ["pass", "pasw", "pwd", "secret", "token", "credential", "private", "jaas"]
            .iter()
            .any(|word| key.contains(word))
}

impl fmt::Debug for KafkaSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Destructured so a new field cannot be forgotten here.
        let KafkaSettings {
            brokers,
            topic,
            partitions,
            replication_factor,
            session_timeout_ms,
            message_timeout_ms,
            options,
        } = self;
        let options: std::collections::BTreeMap<&str, &str> = options
            .iter()
            .map(|(k, v)| (k.as_str(), if is_secret_kafka_option(k) { "***" } else { v.as_str() }))
            .collect();
        f.debug_struct("KafkaSettings")
            .field("brokers", brokers)
            .field("topic", topic)
            .field("partitions", partitions)
            .field("replication_factor", replication_factor)
            .field("session_timeout_ms", session_timeout_ms)
            .field("message_timeout_ms", message_timeout_ms)
            .field("options", &options)
            .finish()
    }
}

impl KafkaSettings {
    pub fn dlq_topic(&self) -> String {
        format!("{}.dlq", self.topic)
    }

    pub fn group_for(&self, table: &str) -> String {
        format!("bagstore-index-{table}")
    }
}

impl Default for KafkaSettings {
    fn default() -> Self {
        KafkaSettings {
            brokers: String::new(),
            topic: "bagstore.entity-changes".into(),
            partitions: 8,
            replication_factor: 1,
            session_timeout_ms: 10_000,
            message_timeout_ms: 10_000,
            options: Default::default(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpSettings {
    pub addr: String,
    /// How long a stopping server waits for requests in flight.
    pub shutdown_grace_ms: u64,
    /// How long a client may take to send a request body, counted from the
    /// end of its headers. A slower (or stalled) client gets 408 and its
    /// connection is closed, so it cannot hold a task and a socket forever.
    pub request_timeout_ms: u64,
}

impl HttpSettings {
    pub fn request_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.request_timeout_ms)
    }
}

impl Default for HttpSettings {
    fn default() -> Self {
        HttpSettings { addr: "127.0.0.1:8080".into(), shutdown_grace_ms: 10_000, request_timeout_ms: 30_000 }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct WriterSettings {
    /// Largest accepted request body (and so entity), bytes.
    pub max_body_bytes: usize,
    /// Most entities in one batch request.
    pub max_batch: usize,
    /// Outbox rows the relay publishes per round.
    pub relay_batch: usize,
    /// How often a relay looks at its outbox without being woken, and how
    /// often a follower tries to become leader.
    pub relay_poll_ms: u64,
    /// Transactions in flight per shard for single writes; a slot that comes
    /// free commits every single write queued meanwhile in one transaction
    /// (group commit).
    pub commit_slots: usize,
}

impl Default for WriterSettings {
    fn default() -> Self {
        WriterSettings {
            max_body_bytes: 1 << 20,
            max_batch: 1000,
            relay_batch: 500,
            relay_poll_ms: 200,
            commit_slots: 2,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct IndexerSettings {
    /// Most events applied in one round (one transaction per shard).
    pub batch_max: usize,
    /// How long to wait for more events once one has arrived.
    pub batch_wait_ms: u64,
    /// Ceiling of the retry backoff after a database error.
    pub retry_max_ms: u64,
}

impl Default for IndexerSettings {
    fn default() -> Self {
        IndexerSettings { batch_max: 500, batch_wait_ms: 5, retry_max_ms: 5_000 }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReaderSettings {
    pub default_limit: usize,
    pub max_limit: usize,
    /// Most values in one `in` list, and most index keys one query may expand to.
    pub max_in: usize,
    pub max_batch_get: usize,
    /// Longest a query may take, including a `consistent_with` wait.
    pub query_timeout_ms: u64,
    /// Entity locations (id → the row's clustered key) remembered, so a
    /// fetch by id takes one B-tree descent instead of two (0: off).
    pub location_cache: usize,
}

impl Default for ReaderSettings {
    fn default() -> Self {
        ReaderSettings {
            default_limit: 100,
            max_limit: 1000,
            max_in: 1000,
            max_batch_get: 1000,
            query_timeout_ms: 5000,
            location_cache: 200_000,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct CleanerSettings {
    /// Pause between sweep cycles (0: sweep as fast as possible).
    pub interval_ms: u64,
    /// Every cycle re-checks the entities updated this recently, so fresh
    /// drift is repaired within one cycle.
    pub recent_window_secs: u64,
    /// Entities (or index entity ids) per shard per step.
    pub batch: usize,
    /// Backfill speed limit in rows per second (0: unlimited).
    pub backfill_rate: u64,
    /// Shards a backfill scans at the same time.
    pub backfill_concurrency: usize,
    /// Entities per backfill batch.
    pub backfill_batch: usize,
}

impl Default for CleanerSettings {
    fn default() -> Self {
        CleanerSettings {
            interval_ms: 1000,
            recent_window_secs: 60,
            batch: 500,
            backfill_rate: 0,
            backfill_concurrency: 2,
            backfill_batch: 1000,
        }
    }
}

impl Settings {
    /// Reads `path` (if any), applies the process environment, validates.
    pub fn load(path: Option<&Path>) -> Result<Settings, SettingsError> {
        let text = match path {
            Some(p) => std::fs::read_to_string(p)
                .map_err(|source| SettingsError::Read { path: p.display().to_string(), source })?,
            None => String::new(),
        };
        Settings::from_toml_and_env(&text, std::env::vars())
    }

    pub fn from_toml_and_env(
        text: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Settings, SettingsError> {
        let mut doc: toml::Table = toml::from_str(text).map_err(|e| SettingsError::Parse(e.to_string()))?;
        let mut vars: Vec<(String, String)> = env.into_iter().collect();
        vars.sort();
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
        if self.writer.max_body_bytes == 0
            || self.writer.max_batch == 0
            || self.writer.relay_batch == 0
            || self.writer.commit_slots == 0
        {
            return Err(SettingsError::Invalid("writer limits must be positive".into()));
        }
        if self.cleaner.batch == 0
            || self.cleaner.backfill_batch == 0
            || self.cleaner.backfill_concurrency == 0
        {
            return Err(SettingsError::Invalid(
                "cleaner batch sizes and concurrency must be positive".into(),
            ));
        }
        if self.indexer.batch_max == 0 || self.reader.max_limit == 0 || self.reader.max_in == 0 {
            return Err(SettingsError::Invalid("indexer and reader limits must be positive".into()));
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
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
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

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
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
    fn mistakes_are_reported() {
        assert!(Settings::from_toml_and_env("[kafka]\nbrokerz = 1", env(&[])).is_err());
        assert!(Settings::from_toml_and_env("", env(&[("BAGSTORE_KAFKA__PARTITIONS", "0")])).is_err());
        let dup = "[[indexes]]\ntable='t'\nproperties=[{name='a',type='int'}]\n".repeat(2);
        assert!(Settings::from_toml_and_env(&dup, env(&[])).is_err());
    }

    #[test]
    fn tokens_never_show_in_debug_output_and_compare_exactly() {
        let s = Settings::from_toml_and_env(
            "[auth]\nwrite_tokens = [\"sekrit\"]",
            env(&[("BAGSTORE_AUTH__READ_TOKENS", "r1,r2")]),
        )
        .unwrap();
        assert!(!format!("{s:?}").contains("sekrit"));
        assert_eq!(s.auth.read_tokens.len(), 2);
        assert!(s.auth.write_tokens[0].matches("sekrit"));
        assert!(!s.auth.write_tokens[0].matches("sekri"));
        assert!(!s.auth.write_tokens[0].matches("sekriT"));
    }

    #[test]
    fn passwords_never_show_in_debug_output() {
        let s = Settings::from_toml_and_env(EXAMPLE, env(&[])).unwrap();
        let dbg = format!("{s:?}");
        assert!(!dbg.contains("hunter2"), "{dbg}");
        assert!(dbg.contains("root:***@127.0.0.1:3308"));
    }

    #[test]
    fn dsn_redaction_keeps_tls_parameters_and_hides_every_password() {
        let cases = [
            (
                "mysql://app:hunter2@db:3306/bagstore?ssl-mode=VERIFY_CA&ssl-ca=/etc/ca.pem",
                "mysql://app:***@db:3306/bagstore?ssl-mode=VERIFY_CA&ssl-ca=/etc/ca.pem",
            ),
            // No database: the query string follows the authority directly.
            ("mysql://app:hunter2@db?ssl-mode=REQUIRED", "mysql://app:***@db?ssl-mode=REQUIRED"),
            // An '@' in the query is not user info.
            ("mysql://db:3306?ssl-ca=/certs/a@b.pem", "mysql://db:3306?ssl-ca=/certs/a@b.pem"),
            ("mysql://db:3306/x?ssl-key=/k@hunter2", "mysql://db:3306/x?ssl-key=/k@hunter2"),
            // An unescaped '@' inside the password.
            ("mysql://app:hun@ter2@db/x", "mysql://app:***@db/x"),
            // A password passed the way other drivers take it.
            (
                "mysql://app@db/x?password=hunter2&ssl-mode=REQUIRED",
                "mysql://app@db/x?password=***&ssl-mode=REQUIRED",
            ),
            ("mysql://root@127.0.0.1:3307/bagstore", "mysql://root@127.0.0.1:3307/bagstore"),
            ("not a url", "not a url"),
        ];
        for (dsn, want) in cases {
            let dsn = Dsn(dsn.to_string());
            assert_eq!(dsn.redacted(), want);
            assert_eq!(format!("{dsn}"), want);
            assert_eq!(format!("{dsn:?}"), format!("Dsn({want})"));
        }
    }

    #[test]
    fn kafka_secrets_never_show_in_debug_output() {
        let s = Settings::from_toml_and_env(
            r#"
            [kafka]
            brokers = "kafka:9093"
            [kafka.options]
            "security.protocol" = "sasl_ssl"
            "ssl.ca.location" = "/etc/bagstore/ca.pem"
            "ssl.key.password" = "hunter2-key"
            "sasl.username" = "bagstore"
            "sasl.oauthbearer.client.secret" = "hunter2-oauth"
            "ssl.key.pasword" = "hunter2-typo"
            "#,
            env(&[
                ("BAGSTORE_KAFKA__OPTIONS__SASL.PASSWORD", "hunter2-sasl"),
                ("BAGSTORE_KAFKA__OPTIONS__SSL.KEYSTORE.PASSWORD", "hunter2-keystore"),
            ]),
        )
        .unwrap();
        assert_eq!(s.kafka.options["sasl.password"], "hunter2-sasl");
        assert_eq!(s.kafka.options["ssl.keystore.password"], "hunter2-keystore");
        for dbg in [format!("{s:?}"), format!("{:?}", s.kafka), format!("{:#?}", s)] {
            assert!(!dbg.contains("hunter2"), "{dbg}");
            assert!(dbg.contains(r#""security.protocol": "sasl_ssl""#), "{dbg}");
            assert!(dbg.contains(r#""ssl.ca.location": "/etc/bagstore/ca.pem""#), "{dbg}");
            assert!(dbg.contains(r#""sasl.password": "***""#), "{dbg}");
        }
    }
}
