//! MariaDB replication as bagstore runs it (issue 33), on private servers
//! of each test's own: what `storage::replication` reads and checks, and
//! the window a failover must not lose a write in. With semi-sync at
//! `AFTER_SYNC` and a timeout that never passes, a commit no replica
//! acknowledged hangs and is seen by no other session; after the primary
//! dies and a replica is promoted it is nowhere, and the dead primary,
//! started again as a replica, truncates it before it rejoins.

use bagstore_tests::eventually;
use devstack::mariadb::MariaDb;
use devstack::replication;
use sqlx::{Connection, MySqlConnection};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use storage::replication::{check_server, server_state, Role};

pub(crate) use bagstore_tests::replicated::{start_on, ADMIN_ENV};

pub(crate) async fn start(dir: &Path, server_id: u32, as_replica: bool) -> MariaDb {
    start_on(dir, server_id, as_replica, None).await
}

pub(crate) async fn connect(dsn: &str) -> MySqlConnection {
    MySqlConnection::connect(dsn).await.expect("connect")
}

/// The rows of `d.t` on `server`, as the service account sees them (none
/// while the table has not reached it).
async fn rows(server: &MariaDb) -> Vec<(i32, String)> {
    let mut c = connect(&replication::service_dsn(server, "")).await;
    sqlx::query_as("SELECT id, v FROM d.t ORDER BY id").fetch_all(&mut c).await.unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_no_replica_acknowledged_is_lost_to_nobody_and_truncated_when_its_primary_rejoins() {
    let dir = tempfile::tempdir().expect("tempdir");
    let primary = start(&dir.path().join("a"), 1, false).await;
    let replica = start(&dir.path().join("b"), 2, true).await;
    for s in [&primary, &replica] {
        replication::create_accounts(s).await.expect("accounts");
    }
    replication::replicate(&replica, &primary).await.expect("replicate");
    // The primary's commits wait for acknowledgements from now on.
    let mut root = connect(&primary.server_dsn()).await;
    storage::replication::require_acks(0, &mut root, true).await.unwrap();

    // Both servers are what bagstore needs, seen from its service account.
    let mut p = connect(&replication::service_dsn(&primary, "")).await;
    let mut r = connect(&replication::service_dsn(&replica, "")).await;
    assert_eq!(check_server(0, &mut p, Role::Primary).await.unwrap(), Vec::<String>::new());
    assert_eq!(check_server(1, &mut r, Role::Replica).await.unwrap(), Vec::<String>::new());
    // Root holds every privilege: read_only would not stop it.
    let wrong = check_server(0, &mut root, Role::Primary).await.unwrap();
    assert!(wrong.iter().any(|w| w.contains("read_only does not stop")), "{wrong:?}");

    eventually("the replica to acknowledge", Duration::from_secs(20), || async {
        let mut p = connect(&replication::service_dsn(&primary, "")).await;
        (server_state(0, &mut p).await.unwrap().semi_sync_clients == 1).then_some(())
    })
    .await;
    sqlx::raw_sql("CREATE DATABASE d; CREATE TABLE d.t (id INT PRIMARY KEY, v TEXT); INSERT INTO d.t VALUES (1, 'acknowledged')")
        .execute(&mut p)
        .await
        .expect("an acknowledged write");
    let acknowledged: Vec<(i32, String)> = vec![(1, "acknowledged".into())];
    eventually("the replica to apply it", Duration::from_secs(20), || async {
        (rows(&replica).await == acknowledged).then_some(())
    })
    .await;
    // The service account cannot write where read_only is on.
    let refused = sqlx::query("INSERT INTO d.t VALUES (9, 'on a replica')").execute(&mut r).await;
    assert!(refused.as_ref().is_err_and(|e| e.to_string().contains("read-only")), "{refused:?}");

    // The replica stops acknowledging: the next commit hangs, unseen.
    let mut rroot = connect(&replica.server_dsn()).await;
    storage::replication::stop_receiving(1, &mut rroot).await.unwrap();
    eventually("the primary to count no acknowledging replica", Duration::from_secs(20), || async {
        let mut p = connect(&replication::service_dsn(&primary, "")).await;
        let s = server_state(0, &mut p).await.unwrap();
        (s.semi_sync_clients == 0 && s.semi_sync_on).then_some(())
    })
    .await;
    let mut w = connect(&replication::service_dsn(&primary, "d")).await;
    let hanging = tokio::spawn(async move {
        sqlx::query("INSERT INTO t VALUES (2, 'unacknowledged')").execute(&mut w).await
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!hanging.is_finished(), "a commit no replica acknowledged returned");
    assert_eq!(rows(&primary).await, vec![(1, "acknowledged".into())], "an unacknowledged commit is visible");

    // The primary dies; the replica, having applied what it received, is promoted.
    let dead = primary.pid();
    assert!(bagstore_tests::std_command("kill").args(["-9", &dead.to_string()]).status().unwrap().success());
    let _ = hanging.await;
    drop(primary);
    assert!(storage::replication::wait_applied(1, &mut rroot, Duration::from_secs(10)).await.unwrap());
    storage::replication::promote(1, &mut rroot).await.unwrap();
    assert_eq!(rows(&replica).await, vec![(1, "acknowledged".into())]);

    // The dead primary comes back as a replica: its recovery truncates the
    // unacknowledged tail, then it follows the new primary.
    let revived = start(&dir.path().join("a"), 1, true).await;
    let log = std::fs::read_to_string(dir.path().join("a/error.log")).unwrap();
    assert!(log.contains("Successfully truncated binlog"), "no truncation in the revived primary's log");
    replication::replicate(&revived, &replica).await.expect("rejoin");
    let mut p2 = connect(&replication::service_dsn(&replica, "d")).await;
    eventually("the revived server to acknowledge", Duration::from_secs(20), || async {
        let mut c = connect(&replication::service_dsn(&replica, "")).await;
        (server_state(1, &mut c).await.unwrap().semi_sync_clients == 1).then_some(())
    })
    .await;
    sqlx::query("INSERT INTO t VALUES (3, 'after the failover')").execute(&mut p2).await.unwrap();
    let want: Vec<(i32, String)> = vec![(1, "acknowledged".into()), (3, "after the failover".into())];
    eventually(
        "the revived server to hold exactly the new primary's rows",
        Duration::from_secs(20),
        || async { (rows(&revived).await == want).then_some(()) },
    )
    .await;
    let mut c = connect(&replication::service_dsn(&revived, "")).await;
    let s = server_state(0, &mut c).await.unwrap();
    let r = s.replica.expect("a replica");
    assert!(r.io_running && r.sql_running && r.last_error.is_none(), "{r:?}");
    for server in [revived, replica] {
        server.stop().await.expect("a clean stop");
    }
}

/// `shards replicas add` and `remove` on a running cluster: a server that
/// replication without loss cannot use is refused before anything on it
/// changes; a good one is seeded (the primary's binary log was purged, so
/// from a `mariadb-dump --gtid` copy), catches up, and from then on the
/// shard's writes wait for its acknowledgement; `shards list` shows both
/// servers; removing it stops the waiting first, so writes go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_is_checked_seeded_listed_and_removed_while_the_shard_serves() {
    use bagstore_tests::TestEnv;
    use serde_json::{json, Value};
    let mut env = TestEnv::new("replicas", "").await;
    let dir = env.dir.path().to_path_buf();
    let (a, b) = (start(&dir.join("a"), 1, false).await, start(&dir.join("b"), 2, false).await);
    let c = start(&dir.join("c"), 3, true).await;
    for s in [&a, &b, &c] {
        replication::create_accounts(s).await.expect("accounts");
    }
    let plain = env.extra_dsn(0);
    let db = |i: usize| format!("{}_s{i}", env.name);
    env.dsns = vec![replication::service_dsn(&a, &db(0)), replication::service_dsn(&b, &db(1))];
    env.migrate().await;
    // The writer loads the map rarely, so that after the removal below it
    // routes with a map that still lists the replica for seconds.
    let writer = env.spawn_env(&["writer"], &[("BAGSTORE_MYSQL__MAP_REFRESH_MS", "4000")]).await;
    let api = writer.api();
    let ids: Vec<String> = (0..40).map(|_| schemas::EntityId(rand::random()).to_hex()).collect();
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(api.put(id, &json!({"n": i})).await.0, 201);
    }
    let count = |server: &MariaDb| {
        let dsn = replication::service_dsn(server, &db(1));
        async move {
            let mut c = connect(&dsn).await;
            sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM entities")
                .fetch_one(&mut c)
                .await
                .unwrap_or(-1)
        }
    };
    let on_b = count(&b).await;
    assert!(on_b > 0, "no entity landed on s1");
    // Its history leaves the binary log: a replica needs a seed now.
    let mut broot = connect(&b.server_dsn()).await;
    sqlx::raw_sql("FLUSH BINARY LOGS").execute(&mut broot).await.unwrap();
    let status = sqlx::query("SHOW MASTER STATUS").fetch_one(&mut broot).await.unwrap();
    let file: String = sqlx::Row::try_get(&status, 0).unwrap();
    // A file crash recovery may still need (until InnoDB's checkpoint
    // passes it) outlives the first PURGE.
    eventually("the binary log to be purged", Duration::from_secs(30), || async {
        let mut root = connect(&b.server_dsn()).await;
        sqlx::raw_sql(&format!("PURGE BINARY LOGS TO '{file}'")).execute(&mut root).await.unwrap();
        (sqlx::query("SHOW BINARY LOGS").fetch_all(&mut root).await.unwrap().len() == 1).then_some(())
    })
    .await;

    let admin = ADMIN_ENV;
    let run = |args: &[&str]| {
        let args = env.args(args);
        let env = &env;
        async move { env.run(&args, &admin).await }
    };
    // A server without the binary log is refused, and left as it was.
    let (ok, _, err) = run(&["shards", "replicas", "add", "s0", &plain]).await;
    assert!(!ok && err.contains("the binary log is off"), "{err}");
    let mut p = connect(&plain.replace(&format!("/{}", db(0)), "/")).await;
    assert!(sqlx::query("SHOW SLAVE STATUS").fetch_optional(&mut p).await.unwrap().is_none());

    let replica_dsn = replication::service_dsn(&c, &db(1));
    let (ok, out, err) = run(&["shards", "replicas", "add", "s1", &replica_dsn]).await;
    assert!(ok, "replicas add failed: {out}{err}");
    assert!(out.contains("seeded from a copy"), "{out}");
    assert_eq!(count(&c).await, on_b, "the seeded replica holds another number of entities");
    let mut bs = connect(&replication::service_dsn(&b, "")).await;
    let s = server_state(1, &mut bs).await.unwrap();
    assert!(s.semi_sync_on && s.semi_sync_clients == 1, "{s:?}");
    // Writes go on, acknowledged by the replica, and reach it.
    for id in &ids {
        assert_eq!(api.put(id, &json!({"n": "again"})).await.0, 200);
    }
    let versions = |server: &MariaDb| {
        let dsn = replication::service_dsn(server, &db(1));
        async move {
            let mut c = connect(&dsn).await;
            sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM entities WHERE version = 2")
                .fetch_one(&mut c)
                .await
                .unwrap_or(-1)
        }
    };
    assert_eq!(versions(&b).await, on_b);
    eventually("the replica to apply the new versions", Duration::from_secs(20), || async {
        (versions(&c).await == on_b).then_some(())
    })
    .await;

    // The replica stops acknowledging: once the writer's watch sees it,
    // writes to s1 are refused before they begin (none hangs), health and
    // the gauge say why; acknowledging again, writes pass.
    let mut croot = connect(&c.server_dsn()).await;
    storage::replication::stop_receiving(2, &mut croot).await.unwrap();
    let gauge = |n: i64| format!("bagstore_writer_acknowledging_replicas{{shard=\"1\"}} {n}");
    eventually("the writer to see no acknowledging replica", Duration::from_secs(20), || async {
        api.metrics().await.contains(&gauge(0)).then_some(())
    })
    .await;
    let on_s1: String = {
        let mut bs1 = connect(&replication::service_dsn(&b, &db(1))).await;
        sqlx::query_scalar("SELECT LOWER(HEX(id)) FROM entities LIMIT 1").fetch_one(&mut bs1).await.unwrap()
    };
    let (status, body) =
        tokio::time::timeout(Duration::from_secs(5), api.put(&on_s1, &json!({"n": "refused"})))
            .await
            .expect("a write to a shard without an acknowledging replica hung");
    assert_eq!(status, 503, "{body}");
    assert!(body["type"].as_str().is_some_and(|t| t.ends_with("no-acknowledging-replica")), "{body}");
    let (_, health) = api.raw(reqwest::Method::GET, "/health/ready", Vec::new()).await;
    assert!(health.to_string().contains("replicas of shard s1"), "{health}");
    sqlx::query("START SLAVE IO_THREAD").execute(&mut croot).await.unwrap();
    eventually("the writer to see the replica acknowledge again", Duration::from_secs(20), || async {
        api.metrics().await.contains(&gauge(1)).then_some(())
    })
    .await;
    assert_eq!(api.put(&on_s1, &json!({"n": "again"})).await.0, 200);

    let s1 =
        |doc: Value| doc["shards"].as_array().unwrap().iter().find(|s| s["name"] == "s1").unwrap().clone();
    let list = || async {
        let (ok, out, err) = run(&["shards", "list", "--json"]).await;
        assert!(ok, "{err}");
        s1(serde_json::from_str::<Value>(&out).unwrap())
    };
    let shard = eventually("shards list to show the replica online", Duration::from_secs(20), || async {
        let s = list().await;
        (s["servers"][1]["state"] == "online").then_some(s)
    })
    .await;
    let servers = shard["servers"].as_array().unwrap();
    assert_eq!(servers.len(), 2, "{shard}");
    assert_eq!(servers[0]["role"], "primary");
    assert_eq!(servers[0]["address"], shard["address"]);
    assert_eq!(servers[1]["role"], "replica");
    assert_eq!(servers[1]["lag_ms"], 0);
    let address = servers[1]["address"].as_str().unwrap().to_string();
    assert!(!address.contains("bagstore_repl"), "{address}");

    // migrate checks every server of a replicated shard.
    let (ok, out, err) = run(&["migrate"]).await;
    assert!(ok, "migrate refused a sound replicated shard: {out}{err}");
    sqlx::query("SET GLOBAL gtid_strict_mode = 0").execute(&mut croot).await.unwrap();
    let (ok, _, err) = run(&["migrate"]).await;
    assert!(!ok && err.contains("gtid_strict_mode must be ON") && err.contains(&address), "{err}");
    sqlx::query("SET GLOBAL gtid_strict_mode = 1").execute(&mut croot).await.unwrap();

    // Removed: the primary stops waiting first, so writes still pass,
    // also while the writer's map still lists the replica and the primary
    // counts no acknowledging one.
    let (ok, out, err) = run(&["shards", "replicas", "remove", "s1", &address]).await;
    assert!(ok, "replicas remove failed: {out}{err}");
    let s = server_state(1, &mut bs).await.unwrap();
    assert!(!s.semi_sync_on, "{s:?}");
    let mut cs = connect(&replication::service_dsn(&c, "")).await;
    assert!(
        server_state(2, &mut cs).await.unwrap().replica.is_none(),
        "the removed replica still replicates"
    );
    eventually("the writer to count no replica of s1", Duration::from_secs(20), || async {
        let reply =
            tokio::time::timeout(Duration::from_secs(10), api.put(&on_s1, &json!({"n": "after"}))).await;
        let (status, body) = reply.expect("a write after the removal hung");
        assert_eq!(status, 200, "a write after the removal: {body}");
        api.metrics().await.contains(&gauge(-1)).then_some(())
    })
    .await;
    assert_eq!(list().await["servers"].as_array().unwrap().len(), 1);
    let (ok, _, err) = run(&["shards", "replicas", "remove", "s1", &address]).await;
    assert!(!ok && err.contains("has no replica at"), "{err}");
    drop(writer);
    for server in [a, b, c] {
        server.stop().await.expect("a clean stop");
    }
}

/// `shards switchover` under a steady stream of writes, on a shard and on
/// the metadata shard: every acknowledged write reads back at its version
/// afterwards, writes go on without restarting anything, the map and
/// `shards list` show the new primary with the old one replicating from
/// it, and switching back with `--to` works the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_switchover_loses_no_acknowledged_write_and_the_running_writer_follows_it() {
    use bagstore_tests::TestEnv;
    use serde_json::{json, Value};
    let mut env = TestEnv::new("switchover", "").await;
    // s0 on a with its replica d; s1 on b with its replica c.
    let cluster = bagstore_tests::replicated::Cluster::start(&mut env, 2, 1).await;
    let server = |shard: usize, m: usize| cluster.shards[shard][m].server.as_ref().expect("running");
    let (a, b, c, d) = (server(0, 0), server(1, 0), server(1, 1), server(0, 1));
    let db = |i: usize| format!("{}_s{i}", env.name);
    let admin = ADMIN_ENV;
    let run = |args: Vec<String>| {
        let env = &env;
        async move { env.run(&args, &admin).await }
    };
    let writer = env.spawn(&["writer"]).await;
    let api = writer.api();

    let client = SteadyWriter::start(writer.api());
    let written = |n: usize| client.more(n);
    written(20).await;
    let shard_doc = |name: &'static str| {
        let env = &env;
        async move {
            let (ok, out, err) = env.run(&env.args(&["shards", "list", "--json"]), &[]).await;
            assert!(ok, "{err}");
            let doc: Value = serde_json::from_str(&out).unwrap();
            doc["shards"].as_array().unwrap().iter().find(|s| s["name"] == name).unwrap().clone()
        }
    };
    let address_of =
        |server: &MariaDb, i: usize| format!("mysql://bagstore@127.0.0.1:{}/{}", server.port(), db(i));
    // The epoch a server's database says its shard has, and the map's.
    let epoch_on = |server: &MariaDb, i: usize| {
        let dsn = replication::service_dsn(server, &db(i));
        async move {
            let mut c = connect(&dsn).await;
            sqlx::query_scalar::<_, u64>("SELECT epoch FROM bagstore_shard WHERE id = 1")
                .fetch_one(&mut c)
                .await
                .unwrap()
        }
    };
    let mut meta = a;
    for (shard, old, new, i, to) in
        [("s1", b, c, 1, None), ("s0", a, d, 0, None), ("s1", c, b, 1, Some(address_of(b, 1)))]
    {
        let before = epoch_on(old, i).await;
        let mut args = vec!["shards", "switchover", shard];
        if let Some(to) = to.as_deref() {
            args.extend(["--to", to]);
        }
        let (ok, out, err) = run(env.args(&args)).await;
        assert!(ok, "switchover {shard}: {out}{err}");
        eprint!("{out}");
        let doc = eventually(
            "shards list to show the new primary with its replica online",
            Duration::from_secs(30),
            || async {
                let s = shard_doc(shard).await;
                (s["address"] == address_of(new, i) && s["servers"][1]["state"] == "online").then_some(s)
            },
        )
        .await;
        assert_eq!(doc["servers"][1]["address"], address_of(old, i), "{doc}");
        // The new primary's epoch rose, and the map has it: a replica that
        // has not applied the change shows the older one.
        if shard == "s0" {
            meta = new;
        }
        let raised = epoch_on(new, i).await;
        assert!(raised > before, "{shard}: the new primary's epoch {raised}, before {before}");
        let mut m = connect(&replication::service_dsn(meta, &db(0))).await;
        let mapped: u64 = sqlx::query_scalar("SELECT epoch FROM bagstore_physical WHERE name = ?")
            .bind(shard)
            .fetch_one(&mut m)
            .await
            .unwrap();
        assert_eq!(mapped, raised, "{shard}: the map's epoch");
        // The running writer follows: writes are acknowledged again.
        written(20).await;
    }
    let (acked, refused) = client.finish().await;
    eprintln!("{} writes acknowledged, {refused} answered 503 across three switchovers", acked.len());
    let reader = env.spawn(&["reader"]).await;
    all_read_back(&reader.api(), &acked).await;
    assert_eq!(api.put(&acked[0].0, &json!({"v": 2})).await.0, 200);
    drop((writer, reader));
    cluster.stop().await;
}

/// A client writing new entities without pause, each acknowledged write
/// recorded (id, version), 503s counted (a write that may be retried);
/// any other answer fails the test.
pub(crate) struct SteadyWriter {
    acked: Arc<Mutex<Vec<(String, u64)>>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<u64>,
}

impl SteadyWriter {
    pub(crate) fn start(api: bagstore_tests::api::Api) -> SteadyWriter {
        let acked: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
        let stop: Arc<AtomicBool> = Arc::default();
        let task = {
            let (acked, stop) = (acked.clone(), stop.clone());
            tokio::spawn(async move {
                let mut refused = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let id = schemas::EntityId(rand::random()).to_hex();
                    let (status, body) = api.put(&id, &serde_json::json!({"v": 1})).await;
                    match status {
                        201 => acked.lock().unwrap().push((id, body["version"].as_u64().unwrap())),
                        // As Retry-After asks, though sooner.
                        503 => {
                            refused += 1;
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        other => panic!("a write answered {other}: {body}"),
                    }
                }
                refused
            })
        };
        SteadyWriter { acked, stop, task }
    }

    /// Waits for `n` more acknowledged writes.
    pub(crate) async fn more(&self, n: usize) {
        let start = self.acked.lock().unwrap().len();
        eventually("writes to be acknowledged", Duration::from_secs(60), || async {
            (self.acked.lock().unwrap().len() >= start + n).then_some(())
        })
        .await;
    }

    /// Stops it: the acknowledged writes, and how many were answered 503.
    pub(crate) async fn finish(self) -> (Vec<(String, u64)>, u64) {
        self.stop.store(true, Ordering::Relaxed);
        let refused = self.task.await.expect("the writing client");
        let acked = self.acked.lock().unwrap().clone();
        (acked, refused)
    }
}

/// `shards failover` after the primary of a shard with one replica is
/// killed with `kill -9` under a steady writer: the replica is promoted
/// (after the revocation and its relay log applied), the shard refuses
/// writes while no replica is left to acknowledge them (503, nothing
/// written), the dead server restarted as a replica rejoins through
/// `replicas add` (its history is the new primary's), writes to the shard
/// resume without restarting the writer, and every acknowledged write
/// reads back at its version. A failover while the primary answers is
/// refused (that is a switchover).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_promotes_the_replica_and_the_dead_primary_rejoins_as_a_replica() {
    use bagstore_tests::TestEnv;
    use serde_json::Value;
    let mut env = TestEnv::new("failover", "").await;
    let dir = env.dir.path().to_path_buf();
    // s0 on m0; s1 on m1 and its replica m2 (server ids 1, 2, 3).
    let mut members = bagstore_tests::replicated::two_shards(&mut env, 1).await.into_iter();
    let (a, b, c) = (members.next().unwrap(), members.next().unwrap(), members.next().unwrap());
    let db = |i: usize| format!("{}_s{i}", env.name);
    let admin = ADMIN_ENV;
    let run = |args: &[&str]| {
        let (env, args) = (&env, env.args(args));
        async move { env.run(&args, &admin).await }
    };
    let (ok, _, err) = run(&["shards", "failover", "s1"]).await;
    assert!(!ok && err.contains("use `bagstore shards switchover`"), "{err}");

    let writer = env.spawn(&["writer"]).await;
    let client = SteadyWriter::start(writer.api());
    client.more(30).await;
    let dead = b.pid();
    assert!(bagstore_tests::std_command("kill").args(["-9", &dead.to_string()]).status().unwrap().success());
    drop(b);
    let (ok, out, err) = run(&["shards", "failover", "s1"]).await;
    assert!(ok, "failover: {out}{err}");
    assert!(out.contains("no replica left"), "{out}");
    // s0's writes go on; s1's are refused until a replica acknowledges.
    client.more(20).await;

    let revived = start(&dir.join("m1"), 2, true).await;
    let old_dsn = replication::service_dsn(&revived, &db(1));
    let (ok, out, err) = run(&["shards", "replicas", "add", "s1", &old_dsn]).await;
    assert!(ok, "the old primary's rejoin: {out}{err}");
    assert!(out.contains("rejoined"), "{out}");
    // The map lists the new primary, the dead server's old address (down:
    // the revived server listens elsewhere) and the rejoined one; the
    // operator then removes the old address.
    let servers = || async {
        let (ok, list, err) = run(&["shards", "list", "--json"]).await;
        assert!(ok, "{err}");
        let doc: Value = serde_json::from_str(&list).unwrap();
        let s1 = doc["shards"].as_array().unwrap().iter().find(|s| s["name"] == "s1").cloned().unwrap();
        s1["servers"].as_array().unwrap().clone()
    };
    let address = |server: &MariaDb| format!("mysql://bagstore@127.0.0.1:{}/{}", server.port(), db(1));
    let states = || async {
        let listed = servers().await;
        listed
            .iter()
            .map(|s| (s["address"].as_str().unwrap().to_string(), s["state"].as_str().unwrap().to_string()))
            .collect::<Vec<(String, String)>>()
    };
    // The rejoined server caught up before `add` returned; s1's writes
    // resume with it, so a listing may still find it a moment behind.
    let online = |server: &MariaDb| (address(server), "online".to_string());
    let states = eventually("the rejoined server listed online", Duration::from_secs(30), || async {
        let states = states().await;
        states.contains(&online(&revived)).then_some(states)
    })
    .await;
    assert_eq!(states.len(), 3, "{states:?}");
    assert_eq!(states[0], online(&c), "{states:?}");
    let gone =
        states.iter().find(|(_, state)| state == "down").map(|(a, _)| a.clone()).expect("the dead address");
    let (ok, out, err) = run(&["shards", "replicas", "remove", "s1", &gone]).await;
    assert!(ok, "removing the dead address: {out}{err}");
    assert_eq!(servers().await.len(), 2);
    // s1 takes writes again: wait for one of its entities to be written.
    let mut cs = connect(&replication::service_dsn(&c, &db(1))).await;
    let before: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM entities").fetch_one(&mut cs).await.unwrap();
    eventually("writes to s1 to resume on its new primary", Duration::from_secs(30), || async {
        let mut cs = connect(&replication::service_dsn(&c, &db(1))).await;
        let now: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM entities").fetch_one(&mut cs).await.unwrap();
        (now > before).then_some(())
    })
    .await;
    let (acked, refused) = client.finish().await;
    eprintln!(
        "{} writes acknowledged, {refused} answered 503 across the failover and the rejoin",
        acked.len()
    );
    let reader = env.spawn(&["reader"]).await;
    all_read_back(&reader.api(), &acked).await;
    drop((writer, reader));
    for server in [a, c, revived] {
        server.stop().await.expect("a clean stop");
    }
}

/// Every acknowledged write reads back at its version (batch gets).
pub(crate) async fn all_read_back(api: &bagstore_tests::api::Api, acked: &[(String, u64)]) {
    for chunk in acked.chunks(100) {
        let ids: Vec<&str> = chunk.iter().map(|(id, _)| id.as_str()).collect();
        let (status, doc) = api.get_many(&ids).await;
        assert_eq!(status, 200, "{doc}");
        let found: std::collections::HashMap<&str, u64> = doc["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e["id"].as_str().unwrap(), e["version"].as_u64().unwrap()))
            .collect();
        for (id, version) in chunk {
            assert_eq!(found.get(id.as_str()), Some(version), "acknowledged write {id} (version {version})");
        }
    }
}
