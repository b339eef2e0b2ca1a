//! [`TestEnv`]: one test's world (databases, Kafka, temp dir, config).

use anyhow::bail;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use sqlx::mysql::MySqlPool;
use std::path::PathBuf;
use std::time::Duration;

use crate::servers::{logged_servers, servers, unique};
use crate::{bagstore_bin, eventually, tansu, Proc};

/// One test's world: fresh databases on both servers, its own Kafka, a
/// temp dir, and a config file pointing at all of them.
pub struct TestEnv {
    pub name: String,
    /// Declared before `dir`: a broker process stops before its data goes.
    pub kafka: Kafka,
    pub dir: tempfile::TempDir,
    /// One DSN per physical shard (its primary), `s0` first.
    pub dsns: Vec<String>,
    /// The metadata shard's other servers, listed after `dsns` in the
    /// config (seeds: a process asks them which is the primary).
    pub seeds: Vec<String>,
    pub topic: String,
    /// Extra TOML appended to the config (indexes, tuning).
    pub indexes_toml: String,
    /// The MariaDB servers' ports.
    ports: &'static [u16],
}

impl Drop for TestEnv {
    /// A failing test keeps its config and process logs for a post-mortem.
    fn drop(&mut self) {
        if std::env::var_os("BAGSTORE_KEEP_TEST_DIRS").is_some() {
            self.dir.disable_cleanup(true);
            eprintln!("test files kept in {} (BAGSTORE_KEEP_TEST_DIRS)", self.dir.path().display());
        } else if std::thread::panicking() {
            self.dir.disable_cleanup(true);
            eprintln!("test files (config, process logs) kept in {}", self.dir.path().display());
        }
    }
}

impl std::fmt::Debug for TestEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestEnv").field("name", &self.name).field("dsns", &self.dsns).finish()
    }
}

/// The Kafka a test talks to.
pub enum Kafka {
    /// librdkafka's mock cluster, in this process; faults: broker down/up.
    Mock(MockCluster<'static, DefaultProducerContext>),
    /// A standalone `tansu` broker process; faults: `kill -9` and restart.
    Tansu(Box<tansu::Tansu>),
}

impl std::fmt::Debug for Kafka {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Kafka::Mock(c) => write!(f, "Kafka::Mock({})", c.bootstrap_servers()),
            Kafka::Tansu(t) => write!(f, "Kafka::Tansu({})", t.bootstrap_servers()),
        }
    }
}

impl Kafka {
    pub fn bootstrap_servers(&self) -> String {
        match self {
            Kafka::Mock(c) => c.bootstrap_servers(),
            Kafka::Tansu(t) => t.bootstrap_servers(),
        }
    }

    /// Takes mock broker `id` down (its connections fail until [`Kafka::broker_up`]).
    pub fn broker_down(&self, id: i32) -> anyhow::Result<()> {
        match self {
            Kafka::Mock(c) => Ok(c.broker_down(id)?),
            Kafka::Tansu(_) => bail!("broker_down is a mock-cluster fault; kill the tansu process instead"),
        }
    }

    pub fn broker_up(&self, id: i32) -> anyhow::Result<()> {
        match self {
            Kafka::Mock(c) => Ok(c.broker_up(id)?),
            Kafka::Tansu(_) => bail!("broker_up is a mock-cluster fault; restart the tansu process instead"),
        }
    }

    pub fn tansu(&self) -> Option<&tansu::Tansu> {
        match self {
            Kafka::Tansu(t) => Some(t),
            Kafka::Mock(_) => None,
        }
    }
}

/// The example indexes of `deploy/bagstore.dev.toml` (those `bagstore dev`
/// maintains) plus a multi-valued one, used by most suites.
pub const STANDARD_INDEXES: &str = r#"
[[indexes]]
table = "index_user_id"
properties = [{ name = "user_id", type = "uuid" }]
shard_on = "user_id"

[[indexes]]
table = "index_user_name"
properties = [{ name = "first_name", type = "string" }, { name = "last_name", type = "string" }]

[[indexes]]
table = "index_foo"
properties = [{ name = "bar", type = "int" }]
match_on = { m = "right" }

[[indexes]]
table = "index_tag"
properties = [{ name = "tags", type = "string", max_len = 64 }]
"#;

impl TestEnv {
    pub async fn new(name: &str, indexes_toml: &str) -> TestEnv {
        TestEnv::on(servers(), name, indexes_toml)
    }

    /// Like [`TestEnv::new`], on servers with the binary log on, as
    /// production runs MySQL (see `servers::logged_servers`).
    pub async fn with_binary_log(name: &str, indexes_toml: &str) -> TestEnv {
        TestEnv::on(logged_servers(), name, indexes_toml)
    }

    fn on(ports: &'static [u16], name: &str, indexes_toml: &str) -> TestEnv {
        let name = unique(name);
        let dsns: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, p)| format!("mysql://root@127.0.0.1:{p}/{name}_s{i}"))
            .collect();
        let kafka = MockCluster::new(1).expect("mock cluster");
        let topic = format!("{name}.changes");
        kafka.create_topic(&topic, 4, 1).expect("topic");
        kafka.create_topic(&format!("{topic}.dlq"), 1, 1).expect("dlq topic");
        // The public change stream (on by default): the mock cluster has no
        // admin API for `migrate` to create it with.
        kafka.create_topic("bagstore.changes.v1", 4, 1).expect("change stream topic");
        // Kafka ingest's topics (on by default).
        for t in ["bagstore.ingest.v1", "bagstore.ingest.v1.dlq", "bagstore.ingest.v1.replies"] {
            kafka.create_topic(t, 4, 1).expect("ingest topic");
        }
        let dir = tempfile::Builder::new().prefix(&format!("{name}-")).tempdir().expect("tempdir");
        TestEnv {
            name,
            dir,
            kafka: Kafka::Mock(kafka),
            dsns,
            seeds: Vec::new(),
            topic,
            indexes_toml: indexes_toml.to_string(),
            ports,
        }
    }

    /// Like [`TestEnv::new`], with a standalone `tansu` broker process
    /// (PostgreSQL storage on a private cluster) instead of the mock
    /// cluster. `migrate` creates the topics through the admin API.
    pub async fn with_tansu(name: &str, indexes_toml: &str) -> TestEnv {
        let mut env = TestEnv::new(name, indexes_toml).await;
        let tansu = tansu::Tansu::start(&env.dir.path().join("tansu")).await.expect("tansu starts");
        env.kafka = Kafka::Tansu(Box::new(tansu));
        env
    }

    pub fn brokers(&self) -> String {
        self.kafka.bootstrap_servers()
    }

    /// The full config for separate services (and `dev` with external parts).
    pub fn config_toml(&self) -> String {
        let listed: Vec<String> = self.dsns.iter().chain(&self.seeds).cloned().collect();
        self.config_toml_with(&listed, "")
    }

    /// The config with other shard DSNs and extra `[mysql]` lines.
    pub fn config_toml_with(&self, dsns: &[String], mysql_extra: &str) -> String {
        let shards: Vec<String> = dsns.iter().map(|d| format!("{d:?}")).collect();
        format!(
            "[mysql]\nshards = [{}]\nmax_connections = 8\n{mysql_extra}\n\n[kafka]\nbrokers = {:?}\ntopic = {:?}\npartitions = 4\n\
             replication_factor = 1\nsession_timeout_ms = 6000\nmessage_timeout_ms = 3000\n\n[writer]\nrelay_poll_ms = 100\n\n[http]\n\
             addr = \"127.0.0.1:0\"\nshutdown_grace_ms = 3000\n{}",
            shards.join(", "),
            self.brokers(),
            self.topic,
            self.indexes_toml
        )
    }

    pub fn config_path(&self) -> PathBuf {
        let p = self.dir.path().join("bagstore.toml");
        std::fs::write(&p, self.config_toml()).expect("write config");
        p
    }

    /// Writes [`TestEnv::config_toml_with`] to `file` in the temp dir.
    pub fn config_file_with(&self, file: &str, dsns: &[String], mysql_extra: &str) -> PathBuf {
        let p = self.dir.path().join(file);
        std::fs::write(&p, self.config_toml_with(dsns, mysql_extra)).expect("write config");
        p
    }

    /// The DSN of a further database of this test (a shard to add), on one
    /// of the two servers.
    pub fn extra_dsn(&self, i: usize) -> String {
        format!("mysql://root@127.0.0.1:{}/{}_s{i}", self.ports[i % self.ports.len()], self.name)
    }

    /// Runs `bagstore <args…>` to completion: (success, stdout, stderr).
    pub async fn run(&self, args: &[String], env: &[(&str, &str)]) -> (bool, String, String) {
        let out = crate::command(bagstore_bin())
            .args(args)
            .envs(env.iter().copied())
            .output()
            .await
            .expect("run bagstore");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into(),
            String::from_utf8_lossy(&out.stderr).into(),
        )
    }

    /// `bagstore migrate` with this env's config; panics on failure.
    pub async fn migrate(&self) -> String {
        let out = crate::command(bagstore_bin())
            .arg("migrate")
            .arg("--config")
            .arg(self.config_path())
            .output()
            .await
            .expect("run migrate");
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(out.status.success(), "migrate failed: {}{}", stdout, String::from_utf8_lossy(&out.stderr));
        stdout
    }

    /// Runs `bagstore <args…> --config <this env's config>` and waits for ready.
    pub async fn spawn(&self, args: &[&str]) -> Proc {
        self.spawn_env(args, &[]).await
    }

    /// [`TestEnv::spawn`] with extra environment (e.g. `BAGSTORE_CLEANER__INTERVAL_MS`).
    pub async fn spawn_env(&self, args: &[&str], env: &[(&str, &str)]) -> Proc {
        Proc::start(&self.args(args), self.dir.path(), env).await.expect("bagstore starts")
    }

    /// `args` followed by `--config <this env's config>`.
    pub fn args(&self, args: &[&str]) -> Vec<String> {
        let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        all.push("--config".into());
        all.push(self.config_path().display().to_string());
        all
    }

    /// Kafka settings pointing at this env (for lag checks from the test).
    pub fn kafka_settings(&self) -> schemas::settings::KafkaSettings {
        schemas::settings::KafkaSettings {
            brokers: self.brokers(),
            topic: self.topic.clone(),
            ..Default::default()
        }
    }

    /// Waits until every outbox is empty and every index group has applied
    /// everything on the topic.
    pub async fn until_caught_up(&self, indexes: &[&str]) {
        eventually("outbox empty and every index caught up", Duration::from_secs(60), || async {
            self.caught_up(indexes).await.then_some(())
        })
        .await
    }

    /// Whether every outbox is empty and every index group in `indexes` has applied every
    /// event (false also when the lag cannot be read).
    pub async fn caught_up(&self, indexes: &[&str]) -> bool {
        for shard in 0..self.dsns.len() {
            let pool = self.pool(shard).await;
            match storage::outbox::outbox_backlog(shard, &pool).await {
                Ok(b) if b.rows == 0 => {}
                _ => return false,
            }
        }
        let k = self.kafka_settings();
        for table in indexes {
            match service::kafka::group_lag(&k, &k.group_for(table)).await {
                Ok(lag) if lag.iter().map(|p| p.lag()).sum::<i64>() == 0 => {}
                _ => return false,
            }
        }
        true
    }

    /// Migrated, with writer, reader and all indexers in one `bagstore dev`
    /// process using this env's shards and Kafka.
    pub async fn dev(&self) -> Proc {
        self.spawn(&["dev", "--http", "127.0.0.1:0"]).await
    }

    pub async fn pool(&self, shard: usize) -> MySqlPool {
        MySqlPool::connect(&self.dsns[shard]).await.expect("connect to shard")
    }

    /// Rows in `table` on every shard; of an index table (`index_…`), its
    /// live rows (not its tombstones, see `storage::index_rows`).
    pub async fn count_rows(&self, table: &str) -> i64 {
        let live = if table.starts_with("index_") { " WHERE removed_us IS NULL" } else { "" };
        let counts: Vec<(usize, (i64,))> =
            self.fetch_all_shards(&format!("SELECT COUNT(*) FROM `{table}`{live}")).await;
        counts.into_iter().map(|(_, (n,))| n).sum()
    }

    /// For every live row of index `table` on every shard: its entity id, the
    /// location the row gives for it, and where the entity's row really is
    /// (its `added_id`; `None` if no shard has the entity).
    pub async fn index_row_locations(&self, table: &str) -> Vec<RowLocation> {
        type Row = (Vec<u8>, Option<u64>);
        let rows: Vec<(usize, Row)> = self
            .fetch_all_shards(&format!(
                "SELECT entity_id, entity_added_id FROM `{table}` WHERE removed_us IS NULL"
            ))
            .await;
        let entities: std::collections::HashMap<Vec<u8>, u64> = self
            .fetch_all_shards("SELECT id, added_id FROM entities")
            .await
            .into_iter()
            .map(|(_, r)| r)
            .collect();
        rows.into_iter()
            .map(|(_, (id, given))| {
                let actual = entities.get(&id).copied();
                RowLocation { entity: schemas::id::hex(&id), given, actual }
            })
            .collect()
    }

    /// Runs `sql` on every shard and returns (shard, row) for every row.
    pub async fn fetch_all_shards<T>(&self, sql: &str) -> Vec<(usize, T)>
    where
        T: for<'r> sqlx::FromRow<'r, sqlx::mysql::MySqlRow> + Send + Unpin,
    {
        let mut out = Vec::new();
        for s in 0..self.dsns.len() {
            let pool = self.pool(s).await;
            let rows: Vec<T> = sqlx::query_as(sql).fetch_all(&pool).await.unwrap();
            out.extend(rows.into_iter().map(|r| (s, r)));
            pool.close().await;
        }
        out
    }
}

/// See [`TestEnv::index_row_locations`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowLocation {
    pub entity: String,
    pub given: Option<u64>,
    pub actual: Option<u64>,
}
