//! The local-stack harness for bagstore's end-to-end suites.
//!
//! - Two private `mariadbd` servers per test process, started once on a
//!   thread of their own (so they outlive each test's runtime) and stopped
//!   when the process exits. Every test gets fresh databases on them, so
//!   tests run in parallel without seeing each other's rows.
//! - Every test gets its own Kafka: librdkafka's mock cluster, reachable
//!   over TCP by the `bagstore` processes the test starts, with fault
//!   injection (broker down/up).
//! - [`Proc`] runs the real `bagstore` binary and waits for its ready line.
//! - [`Api`] is a typed HTTP client for the v1 API.
//! - [`eventually`] polls with a deadline; tests never sleep blindly.

use anyhow::{bail, Context};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use serde_json::{json, Value};
use sqlx::mysql::MySqlPool;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};

pub use bagstore::local::mariadb::MariaDb;

pub mod chaos;
pub mod model;
pub mod tansu;

/// The ports of this process's two private MariaDB servers.
fn servers() -> &'static [u16] {
    static PORTS: OnceLock<Vec<u16>> = OnceLock::new();
    PORTS.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("mariadb-servers".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
                rt.block_on(async move {
                    let base = std::env::temp_dir().join(format!("bagstore-test-{}", std::process::id()));
                    let started = futures_lite_join(
                        MariaDb::start_with(&base.join("a"), opts()),
                        MariaDb::start_with(&base.join("b"), opts()),
                    )
                    .await;
                    match started {
                        (Ok(a), Ok(b)) => {
                            tx.send(Ok(vec![a.port(), b.port()])).ok();
                            // Keep both alive for the life of the process: the
                            // wrapper stops mariadbd when this process exits.
                            let _keep = (a, b);
                            std::future::pending::<()>().await;
                        }
                        (a, b) => {
                            let err = a.err().or(b.err()).expect("one failed");
                            tx.send(Err(format!("{err:#}"))).ok();
                        }
                    }
                });
            })
            .expect("spawn server thread");
        match rx.recv().expect("server thread answers") {
            Ok(ports) => ports,
            Err(e) => panic!("cannot start the private MariaDB servers: {e}"),
        }
    })
}

fn opts() -> bagstore::local::mariadb::MariaDbOptions {
    bagstore::local::mariadb::MariaDbOptions { ephemeral: true, ..Default::default() }
}

async fn futures_lite_join<A: std::future::Future, B: std::future::Future>(
    a: A,
    b: B,
) -> (A::Output, B::Output) {
    tokio::join!(a, b)
}

/// A unique, valid identifier for this test's databases and topics.
fn unique(name: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let clean: String =
        name.chars().filter(|c| c.is_ascii_alphanumeric()).take(20).collect::<String>().to_lowercase();
    format!(
        "t{}_{}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        clean,
        rand::random::<u16>()
    )
}

/// Polls `f` until it returns `Some`, or fails after `deadline`.
pub async fn eventually<T, F, Fut>(what: &str, deadline: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let until = Instant::now() + deadline;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if Instant::now() >= until {
            panic!("timed out after {deadline:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `bagstore` binary built from this workspace.
pub fn bagstore_bin() -> PathBuf {
    if let Ok(p) = std::env::var("BAGSTORE_BIN") {
        return PathBuf::from(p);
    }
    // target/<profile>/deps/<test binary> → target/<profile>/bagstore
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let bin = dir.join("bagstore");
    assert!(bin.exists(), "{} is missing: run `cargo build -p bagstore` before the tests", bin.display());
    bin
}

/// One test's world: fresh databases on both servers, its own Kafka, a
/// temp dir, and a config file pointing at all of them.
pub struct TestEnv {
    pub name: String,
    /// Declared before `dir`: a broker process stops before its data goes.
    pub kafka: Kafka,
    pub dir: tempfile::TempDir,
    pub dsns: Vec<String>,
    pub topic: String,
    /// Extra TOML appended to the config (indexes, tuning).
    pub indexes_toml: String,
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

/// The README's example indexes plus a multi-valued one, used by most suites.
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
        let ports = servers().to_vec();
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
        let dir = tempfile::Builder::new().prefix(&format!("{name}-")).tempdir().expect("tempdir");
        TestEnv { name, dir, kafka: Kafka::Mock(kafka), dsns, topic, indexes_toml: indexes_toml.to_string() }
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
        let shards: Vec<String> = self.dsns.iter().map(|d| format!("{d:?}")).collect();
        format!(
            "[mysql]\nshards = [{}]\nmax_connections = 8\n\n[kafka]\nbrokers = {:?}\ntopic = {:?}\npartitions = 4\n\
             session_timeout_ms = 6000\nmessage_timeout_ms = 3000\n\n[writer]\nrelay_poll_ms = 100\n\n[http]\n\
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

    /// `bagstore migrate` with this env's config; panics on failure.
    pub async fn migrate(&self) -> String {
        let out = tokio::process::Command::new(bagstore_bin())
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
        let k = self.kafka_settings();
        eventually("outbox empty and every index caught up", Duration::from_secs(60), || {
            let k = k.clone();
            async move {
                if self.count_rows("outbox").await != 0 {
                    return None;
                }
                for table in indexes {
                    let lag = schemas::kafka::group_lag(&k, &k.group_for(table)).await.ok()?;
                    if lag.iter().map(|p| p.lag()).sum::<i64>() != 0 {
                        return None;
                    }
                }
                Some(())
            }
        })
        .await
    }

    /// Migrated, with writer, reader and all indexers in one `bagstore dev`
    /// process using this env's shards and Kafka.
    pub async fn dev(&self) -> Proc {
        self.spawn(&["dev", "--http", "127.0.0.1:0"]).await
    }

    pub async fn pool(&self, shard: usize) -> MySqlPool {
        MySqlPool::connect(&self.dsns[shard]).await.expect("connect to shard")
    }

    /// Rows in `table` on every shard.
    pub async fn count_rows(&self, table: &str) -> i64 {
        let counts: Vec<(usize, (i64,))> =
            self.fetch_all_shards(&format!("SELECT COUNT(*) FROM `{table}`")).await;
        counts.into_iter().map(|(_, (n,))| n).sum()
    }

    /// For every row of index `table` on every shard: its entity id, the
    /// location the row gives for it, and where the entity's row really is
    /// (its `added_id`; `None` if no shard has the entity).
    pub async fn index_row_locations(&self, table: &str) -> Vec<RowLocation> {
        type Row = (Vec<u8>, Option<u64>);
        let rows: Vec<(usize, Row)> =
            self.fetch_all_shards(&format!("SELECT entity_id, entity_added_id FROM `{table}`")).await;
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

/// A running `bagstore` process.
#[derive(Debug)]
pub struct Proc {
    pub child: tokio::process::Child,
    /// The `http=` URL from the ready line.
    pub url: String,
    pub ready_line: String,
    pub log: PathBuf,
}

impl Proc {
    pub async fn start(args: &[String], dir: &Path, env: &[(&str, &str)]) -> anyhow::Result<Proc> {
        static N: AtomicU32 = AtomicU32::new(0);
        let log = dir.join(format!("{}-{}.log", args[0], N.fetch_add(1, Ordering::Relaxed)));
        let logfile = std::fs::File::create(&log)?;
        let mut cmd = tokio::process::Command::new(bagstore_bin());
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(logfile)
            .env(
                "RUST_LOG",
                std::env::var("BAGSTORE_TEST_RUST_LOG").unwrap_or_else(|_| {
                    "info,bagstore=debug,bagstore_indexer=debug,bagstore_writer=debug,bagstore_reader=debug".into()
                }),
            )
            .kill_on_drop(true);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().context("spawn bagstore")?;
        let stdout = child.stdout.take().expect("piped");
        let mut lines = BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(Duration::from_secs(90), async {
            while let Some(line) = lines.next_line().await? {
                if line.contains(" ready: ") {
                    return Ok::<_, std::io::Error>(Some(line));
                }
            }
            Ok(None)
        })
        .await;
        let line = match ready {
            Ok(Ok(Some(l))) => l,
            other => {
                let tail = std::fs::read_to_string(&log).unwrap_or_default();
                let tail: String = tail
                    .lines()
                    .rev()
                    .take(30)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n");
                bail!("bagstore {args:?} did not become ready ({other:?}); log tail:\n{tail}");
            }
        };
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let url = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("http="))
            .context("ready line without http=")?
            .to_string();
        Ok(Proc { child, url, ready_line: line, log })
    }

    pub fn api(&self) -> Api {
        Api::new(&self.url)
    }

    pub fn pid(&self) -> i32 {
        self.child.id().expect("running") as i32
    }

    /// SIGKILL: a crash, no cleanup.
    pub async fn kill9(mut self) {
        self.child.kill().await.ok();
    }

    /// SIGTERM and wait (bounded) for a clean exit; returns the exit code.
    pub async fn terminate(mut self) -> Option<i32> {
        let pid = self.pid();
        std::process::Command::new("kill").arg("-TERM").arg(pid.to_string()).status().ok();
        match tokio::time::timeout(Duration::from_secs(60), self.child.wait()).await {
            Ok(Ok(status)) => status.code(),
            _ => {
                self.child.kill().await.ok();
                panic!("bagstore did not stop within 60 s of SIGTERM; log: {}", self.log.display())
            }
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// A status code and a JSON body (or `null`).
pub type Reply = (u16, Value);

/// Typed helpers over the v1 HTTP API.
#[derive(Debug, Clone)]
pub struct Api {
    base: String,
    http: reqwest::Client,
}

impl Api {
    pub fn new(base: &str) -> Api {
        Api { base: base.trim_end_matches('/').to_string(), http: reqwest::Client::new() }
    }

    async fn reply(r: reqwest::RequestBuilder) -> Reply {
        let resp = r.send().await.expect("HTTP request");
        let status = resp.status().as_u16();
        let ctype =
            resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
        let text = resp.text().await.unwrap_or_default();
        let body = serde_json::from_str(&text).unwrap_or(Value::Null);
        if status >= 400 {
            assert_eq!(
                ctype, "application/problem+json",
                "error without a problem document: {status} {text}"
            );
        }
        (status, body)
    }

    pub async fn post_entity(&self, body: &Value) -> Reply {
        Self::reply(self.http.post(format!("{}/v1/entities", self.base)).json(body)).await
    }

    pub async fn put(&self, id: &str, body: &Value) -> Reply {
        Self::reply(self.http.put(format!("{}/v1/entities/{id}", self.base)).json(body)).await
    }

    pub async fn put_with(&self, id: &str, body: &Value, header: (&str, &str)) -> Reply {
        Self::reply(
            self.http.put(format!("{}/v1/entities/{id}", self.base)).header(header.0, header.1).json(body),
        )
        .await
    }

    pub async fn raw(&self, method: reqwest::Method, path: &str, body: Vec<u8>) -> Reply {
        Self::reply(self.http.request(method, format!("{}{path}", self.base)).body(body)).await
    }

    pub async fn delete(&self, id: &str) -> Reply {
        Self::reply(self.http.delete(format!("{}/v1/entities/{id}", self.base))).await
    }

    pub async fn get(&self, id: &str) -> Reply {
        Self::reply(self.http.get(format!("{}/v1/entities/{id}", self.base))).await
    }

    pub async fn get_many(&self, ids: &[&str]) -> Reply {
        Self::reply(self.http.post(format!("{}/v1/entities/get", self.base)).json(&json!({ "ids": ids })))
            .await
    }

    pub async fn batch(&self, entities: &[Value]) -> Reply {
        Self::reply(
            self.http.post(format!("{}/v1/entities/batch", self.base)).json(&json!({ "entities": entities })),
        )
        .await
    }

    pub async fn query(&self, q: &Value) -> Reply {
        Self::reply(self.http.post(format!("{}/v1/query", self.base)).json(q)).await
    }

    pub async fn indexes(&self) -> Reply {
        Self::reply(self.http.get(format!("{}/v1/indexes", self.base))).await
    }

    pub async fn metrics(&self) -> String {
        self.http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .expect("scrape")
            .text()
            .await
            .unwrap_or_default()
    }

    /// Ids returned by a query that must succeed.
    pub async fn query_ids(&self, q: &Value) -> Vec<String> {
        let (status, body) = self.query(q).await;
        assert_eq!(status, 200, "query {q} failed: {body}");
        let mut ids: Vec<String> = body["items"]
            .as_array()
            .expect("items")
            .iter()
            .map(|e| e["id"].as_str().unwrap().to_string())
            .collect();
        ids.sort();
        ids
    }
}

/// Sum of a metric's samples whose label set contains every `labels` pair.
pub fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = match series.split_once('{') {
                Some((n, r)) => (n, r),
                None => (series, ""),
            };
            if n != name || !labels.iter().all(|(k, v)| rest.contains(&format!("{k}=\"{v}\""))) {
                return None;
            }
            value.parse::<f64>().ok()
        })
        .sum()
}

/// Waits until a query returns exactly `want` (sorted ids).
pub async fn until_query_is(api: &Api, q: &Value, want: &[&str]) {
    let mut want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
    want.sort();
    let what = format!("query {q} to return {want:?}");
    eventually(&what, Duration::from_secs(20), || {
        let api = api.clone();
        let want = want.clone();
        async move { (api.query_ids(q).await == want).then_some(()) }
    })
    .await
}
