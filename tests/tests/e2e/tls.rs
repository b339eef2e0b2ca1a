//! TLS to MySQL and Kafka, with real components: a private MariaDB that
//! serves TLS with a certificate made at test time by the `openssl` tool,
//! the real `bagstore migrate` binary, the storage layer's own pools, and
//! librdkafka clients built from bagstore's configs talking to an
//! `openssl s_server` (librdkafka's mock cluster has no TLS listener, so a
//! TLS server that prints what it decrypted stands in for the broker).
//!
//! MySQL TLS is configured in the DSN (`?ssl-mode=VERIFY_CA&ssl-ca=…`), Kafka
//! TLS in `kafka.options` (`security.protocol`, `ssl.ca.location`).

use bagstore_tests::{bagstore_bin, eventually};
use devstack::mariadb::{MariaDb, MariaDbOptions};
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, Producer};
use schemas::settings::{Dsn, KafkaSettings, MysqlSettings};
use sqlx::{Connection, MySqlConnection};
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use storage::dsn::dedicated_connection;
use storage::Shards;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::{Child, ChildStdin};

/// The password of both TLS-only users. Checked to never show in output.
const PASSWORD: &str = "Tls-Secret-7781";

// ------------------------------------------------------------------ fixtures

/// Certificates made with the `openssl` tool: a CA, a server certificate it
/// signed (for 127.0.0.1 and localhost), a client certificate it signed, and
/// an unrelated CA that signed nothing we serve.
#[derive(Debug, Clone)]
struct Pki {
    ca: PathBuf,
    wrong_ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
}

async fn openssl(dir: &Path, args: &[&str]) -> anyhow::Result<()> {
    let out = bagstore_tests::command("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| anyhow::anyhow!("running `openssl` ({e}); install the openssl package"))?;
    anyhow::ensure!(out.status.success(), "openssl {args:?} failed: {}", text(&out));
    Ok(())
}

/// A P-256 key and a certificate for `cn`, self-signed when `ca` is `None`.
async fn issue(dir: &Path, name: &str, cn: &str, ca: Option<&str>, ext: &str) -> anyhow::Result<()> {
    let (key, cert, csr) = (format!("{name}.key"), format!("{name}.pem"), format!("{name}.csr"));
    let subj = format!("/CN={cn}");
    let new_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", &key];
    match ca {
        None => {
            let mut args = vec!["req", "-x509", "-days", "2", "-subj", &subj, "-out", &cert];
            args.extend(new_key);
            openssl(dir, &args).await
        }
        Some(ca) => {
            let mut args = vec!["req", "-subj", &subj, "-out", &csr];
            args.extend(new_key);
            openssl(dir, &args).await?;
            let ext_file = format!("{name}.ext");
            std::fs::write(dir.join(&ext_file), ext)?;
            let (ca_cert, ca_key) = (format!("{ca}.pem"), format!("{ca}.key"));
            openssl(
                dir,
                &[
                    "x509", "-req", "-in", &csr, "-CA", &ca_cert, "-CAkey", &ca_key, "-days", "2", "-out",
                    &cert, "-extfile", &ext_file,
                ],
            )
            .await
        }
    }
}

async fn make_pki(dir: &Path) -> anyhow::Result<Pki> {
    std::fs::create_dir_all(dir)?;
    issue(dir, "ca", "bagstore test CA", None, "").await?;
    issue(dir, "wrong-ca", "some other CA", None, "").await?;
    let server = "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
                  keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n";
    issue(dir, "server", "127.0.0.1", Some("ca"), server).await?;
    let client = "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n";
    issue(dir, "client", "bagstore", Some("ca"), client).await?;
    Ok(Pki {
        ca: dir.join("ca.pem"),
        wrong_ca: dir.join("wrong-ca.pem"),
        server_cert: dir.join("server.pem"),
        server_key: dir.join("server.key"),
        client_cert: dir.join("client.pem"),
        client_key: dir.join("client.key"),
    })
}

/// This process's TLS MariaDB and the certificates it serves.
#[derive(Debug)]
struct World {
    port: u16,
    pki: Pki,
}

/// Started once per test process on a thread of its own, so the server
/// outlives each test's runtime. The server's wrapper deletes its ephemeral
/// directory when this process exits; the certificates sit next to it (a
/// failed start deletes that directory before retrying on another port) and
/// are swept by the next run.
fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("tls-mariadb".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
                rt.block_on(async move {
                    match start_world().await {
                        Ok((server, world)) => {
                            tx.send(Ok(world)).ok();
                            let _keep = server;
                            std::future::pending::<()>().await;
                        }
                        Err(e) => {
                            tx.send(Err(format!("{e:#}"))).ok();
                        }
                    }
                });
            })
            .expect("spawn the MariaDB thread");
        match rx.recv().expect("the MariaDB thread answers") {
            Ok(world) => world,
            Err(e) => panic!("cannot start the TLS MariaDB: {e}"),
        }
    })
}

/// Directories of this suite that earlier, finished runs left behind.
fn sweep_earlier_runs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix("bagstore-tls-test-") else { continue };
        let gone = pid.parse::<u32>().is_ok_and(|pid| !Path::new(&format!("/proc/{pid}")).exists());
        if gone {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

async fn start_world() -> anyhow::Result<(MariaDb, World)> {
    sweep_earlier_runs();
    let dir = std::env::temp_dir().join(format!("bagstore-tls-test-{}", std::process::id()));
    let pki = make_pki(&dir.join("pki")).await?;
    let arg = |name: &str, path: &Path| format!("--{name}={}", path.display());
    let opts = MariaDbOptions {
        ephemeral: true,
        innodb_buffer_pool_size: Some("32M".into()),
        extra_args: vec![
            arg("ssl-ca", &pki.ca),
            arg("ssl-cert", &pki.server_cert),
            arg("ssl-key", &pki.server_key),
        ],
        ..Default::default()
    };
    let server = MariaDb::start_with(&dir.join("server"), opts).await?;
    // Root (no TLS needed) creates two accounts that cannot log in without it.
    let mut root = MySqlConnection::connect(&format!("{}?ssl-mode=DISABLED", server.server_dsn())).await?;
    let have_ssl: (String, String) =
        sqlx::query_as("SHOW GLOBAL VARIABLES LIKE 'have_ssl'").fetch_one(&mut root).await?;
    anyhow::ensure!(have_ssl.1 == "YES", "mariadbd did not enable TLS: have_ssl={}", have_ssl.1);
    for (user, require) in [("tls_user", "SSL"), ("x509_user", "X509")] {
        sqlx::query(&format!(
            "CREATE USER '{user}'@'127.0.0.1' IDENTIFIED BY '{PASSWORD}' REQUIRE {require}"
        ))
        .execute(&mut root)
        .await?;
        sqlx::query(&format!("GRANT ALL PRIVILEGES ON *.* TO '{user}'@'127.0.0.1'"))
            .execute(&mut root)
            .await?;
    }
    root.close().await?;
    let port = server.port();
    Ok((server, World { port, pki }))
}

impl World {
    /// A DSN for `user` on database `db` (empty: none) with `query` appended.
    fn dsn(&self, user: &str, db: &str, query: &str) -> String {
        format!("mysql://{user}:{PASSWORD}@127.0.0.1:{}/{db}?{query}", self.port)
    }

    fn verify_ca(&self, ca: &Path) -> String {
        format!("ssl-mode=VERIFY_CA&ssl-ca={}", ca.display())
    }
}

/// A unique database name prefix for one test.
fn unique(name: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!("tls{}_{}_{name}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// Runs `bagstore migrate` with two shards at `dsns` and a mock Kafka.
async fn migrate(dir: &Path, dsns: &[String]) -> Output {
    let kafka = MockCluster::new(1).expect("mock cluster");
    let topic = format!("{}.changes", unique("topic"));
    kafka.create_topic(&topic, 2, 1).expect("topic");
    kafka.create_topic(&format!("{topic}.dlq"), 1, 1).expect("dlq topic");
    kafka.create_topic("bagstore.changes.v1", 2, 1).expect("change stream topic");
    for t in ["bagstore.ingest.v1", "bagstore.ingest.v1.dlq", "bagstore.ingest.v1.replies"] {
        kafka.create_topic(t, 2, 1).expect("ingest topic");
    }
    let shards: Vec<String> = dsns.iter().map(|d| format!("{d:?}")).collect();
    let config = format!(
        "[mysql]\nshards = [{}]\nconnect_timeout_ms = 5000\n\n[kafka]\nbrokers = {:?}\ntopic = {:?}\npartitions = 2\nreplication_factor = 1\n\n\
         [[indexes]]\ntable = \"index_user_id\"\nproperties = [{{ name = \"user_id\", type = \"uuid\" }}]\n",
        shards.join(", "),
        kafka.bootstrap_servers(),
        topic,
    );
    let path = dir.join("bagstore.toml");
    std::fs::write(&path, config).expect("write config");
    let run = bagstore_tests::command(bagstore_bin()).arg("migrate").arg("--config").arg(&path).output();
    tokio::time::timeout(Duration::from_secs(90), run).await.expect("migrate finishes").expect("run migrate")
}

/// Tables in database `db`, read as root.
async fn tables_in(db: &str) -> Vec<String> {
    let root = format!("mysql://root@127.0.0.1:{}/?ssl-mode=DISABLED", world().port);
    let mut conn = MySqlConnection::connect(&root).await.expect("root connects");
    let mut tables: Vec<String> = sqlx::query_scalar(
        "SELECT CAST(table_name AS CHAR) FROM information_schema.tables WHERE table_schema = ?",
    )
    .bind(db)
    .fetch_all(&mut conn)
    .await
    .expect("list tables");
    tables.sort();
    tables
}

async fn ssl_cipher(conn: &mut MySqlConnection) -> String {
    let row: (String, String) = sqlx::query_as("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
        .fetch_one(&mut *conn)
        .await
        .expect("Ssl_cipher");
    row.1
}

// --------------------------------------------------------------------- MySQL

#[tokio::test]
async fn migrate_over_a_verified_tls_connection_creates_every_table() {
    let w = world();
    let dir = tempfile::tempdir().unwrap();
    let db = unique("ok");
    let dsns: Vec<String> =
        (0..2).map(|i| w.dsn("tls_user", &format!("{db}_s{i}"), &w.verify_ca(&w.pki.ca))).collect();
    let out = migrate(dir.path(), &dsns).await;
    assert!(out.status.success(), "migrate over TLS failed: {}", text(&out));
    assert!(text(&out).contains("migrate done: 2 shards"), "{}", text(&out));
    assert!(!text(&out).contains(PASSWORD), "the password leaked: {}", text(&out));
    for i in 0..2 {
        let tables = tables_in(&format!("{db}_s{i}")).await;
        for want in ["entities", "outbox", "index_user_id"] {
            assert!(tables.iter().any(|t| t == want), "shard {i} lacks {want}: {tables:?}");
        }
    }
    assert!(tables_in(&format!("{db}_s0")).await.iter().any(|t| t == "bagstore_indexes"));
}

#[tokio::test]
async fn a_user_that_requires_ssl_is_refused_without_tls() {
    let w = world();
    let dir = tempfile::tempdir().unwrap();
    let db = unique("plain");
    let dsns: Vec<String> =
        (0..2).map(|i| w.dsn("tls_user", &format!("{db}_s{i}"), "ssl-mode=DISABLED")).collect();
    let out = migrate(dir.path(), &dsns).await;
    let all = text(&out);
    assert!(!out.status.success(), "migrate without TLS succeeded for a REQUIRE SSL user: {all}");
    assert!(all.contains("Access denied for user 'tls_user'"), "unclear error: {all}");
    assert!(all.contains("shard 0"), "the error does not say which shard: {all}");
    assert!(!all.contains(PASSWORD), "the password leaked: {all}");
    assert!(tables_in(&format!("{db}_s0")).await.is_empty(), "something was created");
}

#[tokio::test]
async fn a_server_certificate_from_another_ca_is_refused() {
    let w = world();
    let dir = tempfile::tempdir().unwrap();
    let db = unique("wrongca");
    let dsns: Vec<String> =
        (0..2).map(|i| w.dsn("tls_user", &format!("{db}_s{i}"), &w.verify_ca(&w.pki.wrong_ca))).collect();
    let out = migrate(dir.path(), &dsns).await;
    let all = text(&out);
    assert!(!out.status.success(), "migrate trusted a certificate from another CA: {all}");
    assert!(all.contains("certificate verify failed"), "unclear error: {all}");
    assert!(!all.contains(PASSWORD), "the password leaked: {all}");
    assert!(tables_in(&format!("{db}_s0")).await.is_empty(), "something was created");
}

#[tokio::test]
async fn store_connections_made_from_a_tls_dsn_are_encrypted() {
    let w = world();
    let db = unique("store");
    let tls = Dsn(w.dsn("tls_user", &db, &w.verify_ca(&w.pki.ca)));
    // Over TLS too: the server DSN it derives keeps the query string.
    storage::migrate::create_database(0, &tls).await.expect("CREATE DATABASE over TLS");
    // The pools every service uses.
    let settings = MysqlSettings { shards: vec![tls.clone()], ..Default::default() };
    let shards = Shards::configured(&settings).expect("valid DSN");
    let mut pooled = shards.pool(0).acquire().await.expect("pooled TLS connection");
    let cipher = ssl_cipher(&mut pooled).await;
    assert!(!cipher.is_empty(), "a pooled connection is not encrypted");
    drop(pooled);
    shards.close().await;
    // The relay's dedicated connection, and the hostname-checking mode (the
    // server certificate names 127.0.0.1).
    let identity =
        Dsn(w.dsn("tls_user", "", &format!("ssl-mode=VERIFY_IDENTITY&ssl-ca={}", w.pki.ca.display())));
    for dsn in [&tls, &identity] {
        let mut conn = dedicated_connection(dsn).await.unwrap_or_else(|e| panic!("{dsn}: {e}"));
        assert!(!ssl_cipher(&mut conn).await.is_empty(), "{dsn} is not encrypted");
    }
    // The same check sees a plain connection as plain.
    let plain = format!("mysql://root@127.0.0.1:{}/?ssl-mode=DISABLED", w.port);
    let mut conn = MySqlConnection::connect(&plain).await.expect("root connects");
    assert_eq!(ssl_cipher(&mut conn).await, "", "ssl-mode=DISABLED still encrypted");
    // Redaction keeps the TLS parameters readable and hides the password.
    let shown = format!("{tls} {tls:?}");
    assert!(shown.contains("ssl-mode=VERIFY_CA") && !shown.contains(PASSWORD), "{shown}");
}

#[tokio::test]
async fn a_client_certificate_in_the_dsn_satisfies_require_x509() {
    let w = world();
    let (cert, key) = (w.pki.client_cert.display(), w.pki.client_key.display());
    let mutual =
        Dsn(w.dsn("x509_user", "", &format!("{}&ssl-cert={cert}&ssl-key={key}", w.verify_ca(&w.pki.ca))));
    let mut conn = dedicated_connection(&mutual).await.expect("mutual TLS login");
    assert!(!ssl_cipher(&mut conn).await.is_empty());
    let user: String =
        sqlx::query_scalar("SELECT CAST(CURRENT_USER() AS CHAR)").fetch_one(&mut conn).await.unwrap();
    assert_eq!(user, "x509_user@127.0.0.1");
    // TLS without a client certificate is not enough for REQUIRE X509.
    let no_cert = Dsn(w.dsn("x509_user", "", &w.verify_ca(&w.pki.ca)));
    let err = dedicated_connection(&no_cert).await.expect_err("REQUIRE X509 without a certificate");
    assert!(err.to_string().contains("Access denied"), "{err}");
}

// --------------------------------------------------------------------- Kafka

/// A librdkafka client context that keeps every log line and error, so a
/// test can see what happened on the wire (e.g. a failed verification).
#[derive(Debug, Clone, Default)]
struct Captured(Arc<Mutex<Vec<String>>>);

impl Captured {
    fn lines(&self) -> String {
        self.0.lock().unwrap().join("\n")
    }
}

impl ClientContext for Captured {
    fn log(&self, _level: RDKafkaLogLevel, fac: &str, message: &str) {
        self.0.lock().unwrap().push(format!("log {fac}: {message}"));
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.0.lock().unwrap().push(format!("error {error}: {reason}"));
    }
}

impl ConsumerContext for Captured {}

/// Kafka settings as an operator would write them for a TLS cluster.
fn tls_kafka(brokers: &str, ca: &Path) -> KafkaSettings {
    let mut k = KafkaSettings {
        brokers: brokers.into(),
        topic: "bagstore.tls-test".into(),
        replication_factor: 1,
        ..Default::default()
    };
    k.options.insert("security.protocol".into(), "ssl".into());
    k.options.insert("ssl.ca.location".into(), ca.display().to_string());
    k
}

/// `openssl s_server` with the test's server certificate: it completes TLS
/// handshakes and prints the session's cipher and every byte it decrypts.
/// It serves one connection at a time, so each client gets its own.
struct TlsListener {
    port: u16,
    output: Arc<Mutex<Vec<u8>>>,
    _child: Child,
    /// Held open: s_server ends a session when its stdin closes.
    _stdin: ChildStdin,
}

impl TlsListener {
    async fn start(pki: &Pki) -> TlsListener {
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let mut child = bagstore_tests::command("openssl")
                .args(["s_server", "-accept", &format!("127.0.0.1:{port}")])
                .arg("-cert")
                .arg(&pki.server_cert)
                .arg("-key")
                .arg(&pki.server_key)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .expect("run openssl s_server");
            let output = collect(child.stdout.take().expect("stdout"));
            let errors = collect(child.stderr.take().expect("stderr"));
            let stdin = child.stdin.take().expect("stdin");
            // "ACCEPT" once it listens; an exit (port taken) means try another.
            let listening = eventually("openssl s_server listens or exits", Duration::from_secs(20), || {
                let accepted = String::from_utf8_lossy(&output.lock().unwrap()).contains("ACCEPT");
                let exited = child.try_wait().ok().flatten().is_some();
                async move { (accepted || exited).then_some(accepted) }
            })
            .await;
            if listening {
                return TlsListener { port, output, _child: child, _stdin: stdin };
            }
            eprintln!("s_server on {port} exited: {}", String::from_utf8_lossy(&errors.lock().unwrap()));
        }
        panic!("openssl s_server could not listen on a free port");
    }

    fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn output(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned()
    }

    /// Waits until a client finished the TLS handshake and then sent a Kafka
    /// request through it. s_server prints `CIPHER is …` once the handshake
    /// is done, then what it decrypted: librdkafka's first request is
    /// ApiVersions (API key 18, `00 12`), carrying client id `rdkafka` and
    /// client software name `librdkafka`.
    async fn until_kafka_request_over_tls(&self, who: &str) {
        let what = format!("{who}: a TLS session carrying a Kafka request");
        eventually(&what, Duration::from_secs(20), || {
            let out = self.output();
            let seen = out.find("CIPHER is").is_some_and(|at| {
                let decrypted = &out[at..];
                decrypted.contains("\u{0}\u{12}") && decrypted.contains("librdkafka")
            });
            async move { seen.then_some(()) }
        })
        .await;
    }
}

/// Everything `stream` yields, as it arrives.
fn collect(mut stream: impl AsyncRead + Unpin + Send + 'static) -> Arc<Mutex<Vec<u8>>> {
    let bytes = Arc::new(Mutex::new(Vec::new()));
    let sink = bytes.clone();
    tokio::spawn(async move {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = stream.read(&mut buf).await {
            sink.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });
    bytes
}

/// Runs a blocking metadata request on a thread of its own: it makes the
/// client connect to its bootstrap broker. The answer never comes (s_server
/// is no broker); the request's timeout ends the thread.
fn ask_for_metadata(fetch: impl FnOnce(Duration) + Send + 'static) {
    std::thread::spawn(move || fetch(Duration::from_secs(10)));
}

#[tokio::test]
async fn kafka_clients_are_created_with_tls_options() {
    let w = world();
    let k = tls_kafka("127.0.0.1:9", &w.pki.ca);
    // librdkafka built without the `ssl` feature refuses security.protocol=ssl
    // at creation ("OpenSSL not available at build time").
    let features =
        service::kafka::base_config(&k).create_native_config().unwrap().get("builtin.features").unwrap();
    assert!(features.split(',').any(|f| f == "ssl"), "librdkafka lacks TLS support: {features}");
    let _producer: FutureProducer =
        service::kafka::create(&service::kafka::producer_config(&k)).expect("producer");
    let _consumer: StreamConsumer = service::kafka::create(&service::kafka::consumer_config(
        &k,
        "bagstore-index-t",
        schemas::settings::FETCH_WAIT_MS,
    ))
    .expect("consumer");
    let _admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
        service::kafka::create(&service::kafka::base_config(&k)).expect("admin client");
    // A CA file that does not exist is caught when the client is created.
    let missing = tls_kafka("127.0.0.1:9", &w.pki.ca.with_file_name("missing.pem"));
    let Err(err) = service::kafka::create::<FutureProducer>(&service::kafka::producer_config(&missing))
    else {
        panic!("a producer was created with a CA file that does not exist")
    };
    assert!(err.to_string().contains("ssl.ca.location"), "{err}");
}

#[tokio::test]
async fn the_relay_producer_and_index_consumer_speak_kafka_inside_tls() {
    let w = world();
    let producer_listener = TlsListener::start(&w.pki).await;
    let consumer_listener = TlsListener::start(&w.pki).await;

    let log = Captured::default();
    let k = tls_kafka(&producer_listener.brokers(), &w.pki.ca);
    let producer: FutureProducer<Captured> =
        service::kafka::producer_config(&k).create_with_context(log.clone()).expect("producer");
    let p = producer.clone();
    ask_for_metadata(move |timeout| drop(p.client().fetch_metadata(None, timeout)));
    producer_listener.until_kafka_request_over_tls("the relay's producer").await;

    let k = tls_kafka(&consumer_listener.brokers(), &w.pki.ca);
    let consumer: BaseConsumer<Captured> =
        service::kafka::consumer_config(&k, "bagstore-index-t", schemas::settings::FETCH_WAIT_MS)
            .create_with_context(log.clone())
            .expect("consumer");
    ask_for_metadata(move |timeout| drop(consumer.fetch_metadata(None, timeout)));
    consumer_listener.until_kafka_request_over_tls("an index consumer").await;

    let lines = log.lines();
    assert!(!lines.contains("SSL handshake failed"), "{lines}");
}

#[tokio::test]
async fn the_lag_reader_connects_with_the_tls_options() {
    let w = world();
    let listener = TlsListener::start(&w.pki).await;
    let k = tls_kafka(&listener.brokers(), &w.pki.ca);
    // The cleaner's and reader's lag check: metadata, offsets, watermarks.
    let lag = tokio::spawn(async move { service::kafka::group_lag(&k, "bagstore-index-t").await });
    listener.until_kafka_request_over_tls("the lag reader").await;
    let result = tokio::time::timeout(Duration::from_secs(30), lag).await.expect("lag check ends").unwrap();
    assert!(result.is_err(), "s_server is no broker, yet lag was read: {result:?}");
}

#[tokio::test]
async fn a_broker_certificate_from_another_ca_fails_verification() {
    let w = world();
    let listener = TlsListener::start(&w.pki).await;
    let log = Captured::default();
    let k = tls_kafka(&listener.brokers(), &w.pki.wrong_ca);
    let producer: FutureProducer<Captured> =
        service::kafka::producer_config(&k).create_with_context(log.clone()).expect("producer");
    let p = producer.clone();
    ask_for_metadata(move |timeout| drop(p.client().fetch_metadata(None, timeout)));
    eventually("librdkafka reports the failed verification", Duration::from_secs(20), || {
        let lines = log.lines();
        async move { lines.contains("certificate verify failed").then_some(()) }
    })
    .await;
    let out = listener.output();
    assert!(!out.contains("rdkafka"), "a Kafka request reached the server: {out}");
}
