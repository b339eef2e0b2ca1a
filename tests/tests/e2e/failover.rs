//! Automatic failover (issue 33): the cleaner's coordinator promotes a
//! replica when a primary has not answered for `mysql.failover_after_ms`,
//! takes the dead server back as a replica once it answers again (started
//! where the map lists it), and opens the shard for writes; no command is
//! run, and every acknowledged write reads back at its version.

use bagstore_tests::{eventually, TestEnv};
use devstack::mariadb::MariaDb;
use devstack::replication;
use serde_json::Value;
use std::time::{Duration, Instant};

use bagstore_tests::replicated::{cannot_truncate, two_shards, Cluster};

use crate::replication::{all_read_back, start, start_on, SteadyWriter, ADMIN_ENV};

/// The coordinator's settings in these tests: the admin and replication
/// accounts, and a failover after one second without an answer.
fn coordinator_env() -> Vec<(&'static str, &'static str)> {
    let mut env = ADMIN_ENV.to_vec();
    env.push(("BAGSTORE_MYSQL__FAILOVER_AFTER_MS", "1000"));
    env
}

/// One shard of `shards list --json`.
async fn shard(env: &TestEnv, name: &str) -> Value {
    let (ok, out, err) = env.run(&env.args(&["shards", "list", "--json"]), &[]).await;
    assert!(ok, "{err}");
    let doc: Value = serde_json::from_str(&out).unwrap();
    doc["shards"].as_array().unwrap().iter().find(|s| s["name"] == name).cloned().unwrap()
}

/// `(address, role, state)` of each server of a shard.
fn servers(doc: &Value) -> Vec<(String, String, String)> {
    let text = |s: &Value, k: &str| s[k].as_str().unwrap_or_default().to_string();
    doc["servers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (text(s, "address"), text(s, "role"), text(s, "state")))
        .collect()
}

/// Kills a mariadbd with `kill -9`.
fn kill_9(server: MariaDb) -> (u16, u32) {
    let (port, pid) = (server.port(), server.pid());
    assert!(bagstore_tests::std_command("kill").args(["-9", &pid.to_string()]).status().unwrap().success());
    drop(server);
    (port, pid)
}

/// The value of a sample of `/metrics` whose line starts with `prefix`.
fn sample(metrics: &str, prefix: &str) -> Option<f64> {
    metrics.lines().find(|l| l.starts_with(prefix)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// A data shard's primary killed under a steady writer: the coordinator
/// promotes its replica on its own; the shard, left without a replica,
/// refuses writes (503) until the dead server, restarted on its port as a
/// replica, is taken back; then writes resume and the cleaner's metrics
/// count one failover and one rejoin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_fails_a_dead_primary_over_and_takes_it_back_as_a_replica() {
    let mut env = TestEnv::new("autofailover", "").await;
    let dir = env.dir.path().to_path_buf();
    // s0 on m0; s1 on m1 and its replica m2 (server ids 1, 2, 3).
    let mut members = two_shards(&mut env, 1).await.into_iter();
    let (a, b, c) = (members.next().unwrap(), members.next().unwrap(), members.next().unwrap());
    let db = |i: usize| format!("{}_s{i}", env.name);
    let cleaner = env.spawn_env(&["cleaner"], &coordinator_env()).await;
    let writer = env.spawn(&["writer"]).await;
    let client = SteadyWriter::start(writer.api());
    client.more(30).await;

    let address = |port: u16| format!("mysql://bagstore@127.0.0.1:{port}/{}", db(1));
    let (b_port, _) = kill_9(b);
    let killed = Instant::now();
    let doc = eventually("the coordinator to promote s1's replica", Duration::from_secs(60), || async {
        let doc = shard(&env, "s1").await;
        (doc["address"] == address(c.port())).then_some(doc)
    })
    .await;
    eprintln!("s1 failed over {} ms after the kill", killed.elapsed().as_millis());
    assert!(servers(&doc).contains(&(address(b_port), "replica".into(), "down".into())), "{doc}");
    // s0's writes go on meanwhile.
    client.more(20).await;

    let revived = start_on(&dir.join("m1"), 2, true, Some(b_port)).await;
    eventually("the coordinator to take the dead server back", Duration::from_secs(60), || async {
        let doc = shard(&env, "s1").await;
        servers(&doc).contains(&(address(b_port), "replica".into(), "online".into())).then_some(())
    })
    .await;
    let count = || async {
        let mut cs = crate::replication::connect(&replication::service_dsn(&c, &db(1))).await;
        sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM entities").fetch_one(&mut cs).await.unwrap()
    };
    let before = count().await;
    eventually("writes to s1 to resume on its new primary", Duration::from_secs(30), || async {
        (count().await > before).then_some(())
    })
    .await;
    eprintln!("s1 took writes again {} ms after the kill", killed.elapsed().as_millis());
    let (acked, refused) = client.finish().await;
    eprintln!("{} writes acknowledged, {refused} answered 503", acked.len());
    let reader = env.spawn(&["reader"]).await;
    all_read_back(&reader.api(), &acked).await;

    let metrics = cleaner.api().metrics().await;
    let failovers = sample(&metrics, "bagstore_failovers_total{reason=\"primary_unreachable\",shard=\"s1\"}");
    assert_eq!(failovers, Some(1.0), "{metrics}");
    assert_eq!(sample(&metrics, "bagstore_rejoins_total{outcome=\"ok\",shard=\"s1\"}"), Some(1.0));
    let unavailable = sample(&metrics, "bagstore_failover_unavailable_seconds{shard=\"s1\"}").unwrap();
    assert!(unavailable >= 1.0, "at least failover_after_ms: {unavailable}");
    eprintln!("the coordinator measured s1's write unavailability: {unavailable:.2} s");
    // The rejoined replica's series (the observability suite's stack has
    // no replica to show them).
    let replica = format!("127.0.0.1:{b_port}/{}", db(1));
    let behind = format!("bagstore_replica_gtid_behind{{server=\"{replica}\",shard=\"s1\"}}");
    let lag = format!("bagstore_replica_lag_seconds{{server=\"{replica}\",shard=\"s1\"}}");
    let clients = "bagstore_semi_sync_clients{shard=\"s1\"}";
    eventually("the rejoined replica's series", Duration::from_secs(20), || async {
        let m = cleaner.api().metrics().await;
        let shown = sample(&m, &behind) == Some(0.0) && sample(&m, &lag).is_some();
        (shown && sample(&m, clients) == Some(1.0)).then_some(())
    })
    .await;
    drop((writer, reader, cleaner));
    for server in [a, c, revived] {
        server.stop().await.expect("a clean stop");
    }
}

/// A primary killed with `kill -9` and restarted (read-only, as a replica
/// restarts) before its failover is due, twice. The first time, with no
/// write in flight at the kill, it holds everything its replica holds: the
/// coordinator opens it again (no failover) once the replica acknowledges
/// from it. The second time its replica holds a transaction it lacks (as
/// when its recovery discarded a tail the replica had received; made here
/// by a statement on the replica): the coordinator fails over to the
/// replica and takes the old primary back. Each time writes resume without
/// an operator; at the end a switchover run while the coordinator watches
/// completes, and every acknowledged write reads back. Without the
/// settling, the shard refuses writes for good after the first restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_restarted_before_its_failover_is_opened_or_replaced() {
    let mut env = TestEnv::new("revived", "").await;
    let dir = env.dir.path().to_path_buf();
    let mut members = two_shards(&mut env, 1).await.into_iter();
    let (a, b, c) = (members.next().unwrap(), members.next().unwrap(), members.next().unwrap());
    let s1 = format!("{}_s1", env.name);
    let address = |port: u16| format!("mysql://bagstore@127.0.0.1:{port}/{s1}");
    let read_only_failovers = "bagstore_failovers_total{reason=\"primary_read_only\",shard=\"s1\"}";
    // A failover delay a restart fits in, on a busy machine too.
    let mut coordinator = ADMIN_ENV.to_vec();
    coordinator.push(("BAGSTORE_MYSQL__FAILOVER_AFTER_MS", "12000"));
    let cleaner = env.spawn_env(&["cleaner"], &coordinator).await;
    let writer = env.spawn(&["writer"]).await;
    let mut acked = writes_reach(writer.api(), &b, &s1).await;
    // Nothing in flight: the writer stopped (its relay's last deletes
    // done), b holding still, and its replica holding what b holds.
    writer.terminate().await;
    let position = |server: &MariaDb| {
        let dsn = server.dsn(&s1);
        async move {
            let mut conn = crate::replication::connect(&dsn).await;
            storage::replication::current_position(1, &mut conn).await.unwrap()
        }
    };
    eventually("b to hold still, its replica level with it", Duration::from_secs(30), || async {
        let held = position(&b).await;
        let level = position(&c).await.includes(&held);
        (level && position(&b).await == held).then_some(())
    })
    .await;

    let (b_port, _) = kill_9(b);
    let killed = Instant::now();
    let b = start_on(&dir.join("m1"), 2, true, Some(b_port)).await;
    eprintln!("s1's primary restarted read-only {} ms after the kill", killed.elapsed().as_millis());
    let writer = env.spawn(&["writer"]).await;
    acked.extend(writes_reach(writer.api(), &b, &s1).await);
    eprintln!("s1 took writes again {} ms after the kill", killed.elapsed().as_millis());
    assert_eq!(shard(&env, "s1").await["address"], address(b_port), "opened again, not failed over");
    assert_eq!(sample(&cleaner.api().metrics().await, read_only_failovers), Some(0.0));

    let (b_port, _) = kill_9(b);
    let killed = Instant::now();
    let mut on_c = crate::replication::connect(&c.dsn(&s1)).await;
    sqlx::query("CREATE DATABASE lost_tail").execute(&mut on_c).await.expect("a transaction on the replica");
    let b = start_on(&dir.join("m1"), 2, true, Some(b_port)).await;
    eventually("the coordinator to fail s1 over and take b back", Duration::from_secs(90), || async {
        let doc = shard(&env, "s1").await;
        let back = servers(&doc).contains(&(address(b_port), "replica".into(), "online".into()));
        (doc["address"] == address(c.port()) && back).then_some(())
    })
    .await;
    acked.extend(writes_reach(writer.api(), &c, &s1).await);
    eprintln!("s1 took writes on its replica {} ms after the kill", killed.elapsed().as_millis());
    let metrics = cleaner.api().metrics().await;
    assert_eq!(sample(&metrics, read_only_failovers), Some(1.0), "{metrics}");

    let (ok, out, err) = env.run(&env.args(&["shards", "switchover", "s1"]), &ADMIN_ENV).await;
    assert!(ok, "a switchover while the coordinator watches: {out}{err}");
    assert_eq!(shard(&env, "s1").await["address"], address(b_port));
    acked.extend(writes_reach(writer.api(), &b, &s1).await);
    let reader = env.spawn(&["reader"]).await;
    all_read_back(&reader.api(), &acked).await;
    drop((writer, reader, cleaner));
    for server in [a, b, c] {
        server.stop().await.expect("a clean stop");
    }
}

/// Writes new entities until database `db` on `server` (its shard's
/// primary) holds more of them than before: the acknowledged writes.
async fn writes_reach(api: bagstore_tests::Api, server: &MariaDb, db: &str) -> Vec<(String, u64)> {
    let dsn = replication::service_dsn(server, db);
    let count = || async {
        let mut conn = crate::replication::connect(&dsn).await;
        sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM entities").fetch_one(&mut conn).await.unwrap()
    };
    let before = count().await;
    let client = SteadyWriter::start(api);
    eventually("writes to reach the shard's primary", Duration::from_secs(90), || async {
        (count().await > before).then_some(())
    })
    .await;
    client.finish().await.0
}

/// The metadata shard's primary killed: the coordinator (elected by a
/// lock on the other shard) promotes its replica; a process started
/// afterwards with the same configuration (listing the dead server and
/// the replica) finds the new primary and serves; the dead server,
/// restarted on its port, is taken back as a replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metadata_shard_fails_over_and_new_processes_find_its_primary() {
    let mut env = TestEnv::new("metafailover", "").await;
    let dir = env.dir.path().to_path_buf();
    let (a, b) = (start(&dir.join("a"), 1, false).await, start(&dir.join("b"), 2, false).await);
    let d = start(&dir.join("d"), 4, true).await;
    for s in [&a, &b, &d] {
        replication::create_accounts(s).await.expect("accounts");
    }
    let db = |i: usize| format!("{}_s{i}", env.name);
    env.dsns = vec![replication::service_dsn(&a, &db(0)), replication::service_dsn(&b, &db(1))];
    env.migrate().await;
    let add = env.args(&["shards", "replicas", "add", "s0", &replication::service_dsn(&d, &db(0))]);
    let (ok, out, err) = env.run(&add, &ADMIN_ENV).await;
    assert!(ok, "replicas add: {out}{err}");
    // The configuration lists the metadata shard's servers: seeds.
    env.dsns.push(replication::service_dsn(&d, &db(0)));
    let cleaner = env.spawn_env(&["cleaner"], &coordinator_env()).await;
    let writer = env.spawn(&["writer"]).await;
    let client = SteadyWriter::start(writer.api());
    client.more(30).await;

    let address = |port: u16| format!("mysql://bagstore@127.0.0.1:{port}/{}", db(0));
    let (a_port, _) = kill_9(a);
    let killed = Instant::now();
    eventually("the metadata shard to fail over", Duration::from_secs(60), || async {
        let (ok, out, _) = env.run(&env.args(&["shards", "list", "--json"]), &[]).await;
        let doc: Value = serde_json::from_str(&out).ok()?;
        let s0 = doc["shards"].as_array()?.iter().find(|s| s["name"] == "s0")?.clone();
        (ok && s0["address"] == address(d.port())).then_some(())
    })
    .await;
    eprintln!("s0 failed over {} ms after the kill", killed.elapsed().as_millis());
    // A process started now, with the same configuration, serves.
    let reader = env.spawn(&["reader"]).await;
    let (status, _) = reader.api().get(&schemas::EntityId(rand::random()).to_hex()).await;
    assert_eq!(status, 404);

    let revived = start_on(&dir.join("a"), 1, true, Some(a_port)).await;
    eventually("the coordinator to take the dead server back", Duration::from_secs(60), || async {
        let doc = shard(&env, "s0").await;
        servers(&doc).contains(&(address(a_port), "replica".into(), "online".into())).then_some(())
    })
    .await;
    client.more(30).await;
    let (acked, refused) = client.finish().await;
    eprintln!("{} writes acknowledged, {refused} answered 503", acked.len());
    all_read_back(&reader.api(), &acked).await;
    drop((writer, reader, cleaner));
    for server in [b, d, revived] {
        server.stop().await.expect("a clean stop");
    }
}

/// The unacknowledged window. With the replica's I/O thread stopped, a
/// write through the writers' own transaction (`storage::write::commit`)
/// waits for an acknowledgement that cannot come: it is not acknowledged,
/// no other session sees it, and the relay publishes no event for it. The
/// primary is killed with `kill -9` and the replica promoted: the write is
/// absent there; the dead primary, restarted as a replica, discards it and
/// rejoins; the write never reaches the topic (writes made after it do).
/// `scripts/broken-builds semisync` runs this against a build whose
/// semi-sync falls back to asynchronous replication, and must see it fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_no_replica_acknowledged_is_never_acknowledged_published_or_kept() {
    let mut env = TestEnv::new("unacked", "").await;
    let dir = env.dir.path().to_path_buf();
    // s0 on m0; s1 on m1 and its replica m2 (server ids 1, 2, 3).
    let mut members = two_shards(&mut env, 1).await.into_iter();
    let (a, b, c) = (members.next().unwrap(), members.next().unwrap(), members.next().unwrap());
    let db = |i: usize| format!("{}_s{i}", env.name);
    let b_dsn = replication::service_dsn(&b, &db(1));
    let writer = env.spawn(&["writer"]).await;

    let shards = store_of(&env).await;
    let (held, after) = (id_on(&shards, 1), id_on(&shards, 1));
    let mut commit = a_held_write(&env, &shards, &c.server_dsn(), held, Duration::from_secs(5)).await;
    let mut service_b = crate::replication::connect(&b_dsn).await;
    let seen: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM entities WHERE id = ?")
        .bind(&held.0[..])
        .fetch_one(&mut service_b)
        .await
        .unwrap();
    assert_eq!(seen, 0, "another session saw a write no replica acknowledged");
    drop(service_b);

    let (b_port, _) = kill_9(b);
    let ended = tokio::time::timeout(Duration::from_secs(30), &mut commit).await.expect("the commit ends");
    assert!(!matches!(ended, Ok(Ok(_))), "the write was acknowledged: {ended:?}");
    let (ok, out, err) = env.run(&env.args(&["shards", "failover", "s1"]), &ADMIN_ENV).await;
    assert!(ok, "failover: {out}{err}");
    let mut service_c = crate::replication::connect(&replication::service_dsn(&c, &db(1))).await;
    assert_eq!(count(&mut service_c, held).await, 0, "the promoted replica holds the unacknowledged write");

    let revived = start_on(&dir.join("m1"), 2, true, Some(b_port)).await;
    let (ok, out, err) = env.run(&env.args(&["shards", "replicas", "add", "s1", &b_dsn]), &ADMIN_ENV).await;
    assert!(ok && out.contains("rejoined"), "the old primary's rejoin: {out}{err}");
    let mut service_b = crate::replication::connect(&b_dsn).await;
    assert_eq!(count(&mut service_b, held).await, 0, "the revived primary kept its unacknowledged tail");

    // A write after it is acknowledged and published; the held one never is.
    let api = writer.api();
    let after_hex = after.to_hex();
    eventually("a write to s1 after the failover", Duration::from_secs(30), || async {
        (api.put(&after_hex, &serde_json::json!({"v": "after"})).await.0 == 201).then_some(())
    })
    .await;
    let events = eventually("the later write's event on the topic", Duration::from_secs(30), || async {
        let events = bagstore_tests::model::read_topic(&env.brokers(), &env.topic, 4);
        events.iter().any(|e| e.event.id == after).then_some(events)
    })
    .await;
    assert!(
        !events.iter().any(|e| e.event.id == held),
        "an event was published for a write never acknowledged"
    );
    shards.close().await;
    drop(writer);
    for server in [a, c, revived] {
        server.stop().await.expect("a clean stop");
    }
}

/// The re-seed path (docs/operations.md), made on purpose rather than left
/// to the chaos suite's luck. A write waits for an acknowledgement no
/// replica can give (the replica's I/O thread stopped) and a DDL follows
/// it in the primary's binary log, as a move's journal triggers can. The
/// primary is killed with `kill -9` and failed over. Restarted as a
/// replica, mariadbd refuses to start: its recovery cannot truncate a tail
/// a DDL follows. Re-seeded as an operator would (`replicas remove`, an
/// empty server on its port, `replicas add`), it holds every write the
/// shard acknowledged, at its version, and not the unacknowledged one, and
/// the shard takes writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_primary_that_cannot_truncate_its_tail_is_reseeded_with_every_acknowledged_write() {
    use sqlx::Row;
    let mut env = TestEnv::new("reseed", "").await;
    let mut cluster = Cluster::start(&mut env, 2, 1).await;
    let writer = env.spawn(&["writer"]).await;
    let client = SteadyWriter::start(writer.api());
    client.more(40).await;
    let (acked, _) = client.finish().await;
    // No other commit may wait on s1 beside the held write and the DDL: the
    // second to wait holds the binary log, and the DDL must be the one
    // written (a writer's relay and ingest commit in the background).
    writer.terminate().await;

    let shards = store_of(&env).await;
    let on_s1 = |hex: &str| shards.of_id(&schemas::EntityId::parse(hex).unwrap()) == 1;
    let acked_s1: Vec<(String, u64)> = acked.into_iter().filter(|(id, _)| on_s1(id)).collect();
    assert!(!acked_s1.is_empty(), "no acknowledged write landed on s1");
    let held = id_on(&shards, 1);

    // The primary's binary log, named before any commit waits: while two
    // do, the server answers no `SHOW MASTER STATUS`. The DDL below is
    // found in the file instead.
    let primary = cluster.shards[1][0].server.as_ref().unwrap().server_dsn();
    let mut root = crate::replication::connect(&primary).await;
    let file: String = sqlx::query("SHOW MASTER STATUS").fetch_one(&mut root).await.unwrap().get("File");
    drop(root);
    let binlog = cluster.shards[1][0].dir.join("data").join(file);
    let logged = || std::fs::read(&binlog).expect("the primary's binary log");

    let replica = cluster.shards[1][1].server.as_ref().unwrap().server_dsn();
    let mut commit = a_held_write(&env, &shards, &replica, held, Duration::from_secs(3)).await;

    // A DDL after the held write in the binary log: its commit waits too.
    let ddl = {
        let (primary, db) = (primary.clone(), format!("{}_s1", env.name));
        tokio::spawn(async move {
            let mut root = crate::replication::connect(&primary).await;
            sqlx::query(&format!("CREATE TABLE `{db}`.reseed_marker (x INT)")).execute(&mut root).await
        })
    };
    eventually("the DDL to reach the primary's binary log", Duration::from_secs(30), || async {
        logged().windows(b"reseed_marker".len()).any(|w| w == b"reseed_marker").then_some(())
    })
    .await;

    cluster.kill_9(1, 0);
    let ended = tokio::time::timeout(Duration::from_secs(30), &mut commit).await.expect("the commit ends");
    assert!(!matches!(ended, Ok(Ok(_))), "the write was acknowledged: {ended:?}");
    assert!(!matches!(ddl.await, Ok(Ok(_))), "the DDL was acknowledged");
    let (ok, out, err) = env.run(&env.args(&["shards", "failover", "s1"]), &ADMIN_ENV).await;
    assert!(ok, "failover: {out}{err}");
    env.dsns[1] = cluster.dsn(&env, 1, 1);

    let refusal =
        cluster.restart_as_replica(1, 0).await.expect_err("mariadbd started over a DDL it cannot take back");
    assert!(cannot_truncate(&refusal), "refused for another reason: {refusal:#}");
    cluster.reseed(&env, 1, 0).await;

    // The shard takes writes again: the re-seeded server acknowledges them.
    let writer = env.spawn(&["writer"]).await;
    let api = writer.api();
    let after = eventually("a write to s1 after the re-seed", Duration::from_secs(60), || async {
        let id = schemas::EntityId(rand::random());
        if shards.of_id(&id) != 1 {
            return None;
        }
        let (status, body) = api.put(&id.to_hex(), &serde_json::json!({"v": "after"})).await;
        (status == 201).then(|| (id.to_hex(), body["version"].as_u64().unwrap()))
    })
    .await;
    let reseeded = cluster.dsn(&env, 1, 0);
    let mut conn = crate::replication::connect(&reseeded).await;
    let rows: Vec<(String, u64)> =
        sqlx::query_as("SELECT LOWER(HEX(id)), version FROM entities").fetch_all(&mut conn).await.unwrap();
    let rows: std::collections::HashMap<String, u64> = rows.into_iter().collect();
    for (id, version) in acked_s1.iter().chain([&after]) {
        assert_eq!(rows.get(id), Some(version), "the re-seeded server lacks an acknowledged write {id}");
    }
    assert!(!rows.contains_key(&held.to_hex()), "the re-seeded server holds the unacknowledged write");
    shards.close().await;
    drop(writer);
    cluster.stop().await;
}

/// `env`'s configuration, as its processes read it.
fn settings_of(env: &TestEnv) -> schemas::Settings {
    let toml = std::fs::read_to_string(env.config_path()).unwrap();
    schemas::Settings::from_toml_and_env(&toml, Vec::new()).unwrap()
}

/// The shards of `env`'s configuration, connected as a writer connects.
async fn store_of(env: &TestEnv) -> storage::Shards {
    storage::Shards::connect(&settings_of(env).mysql).await.unwrap()
}

/// A random entity id that lives on `shard`.
fn id_on(shards: &storage::Shards, shard: usize) -> schemas::EntityId {
    loop {
        let id = schemas::EntityId(rand::random());
        if shards.of_id(&id) == shard {
            return id;
        }
    }
}

/// A write no replica acknowledges: `replica`'s I/O thread is stopped,
/// then `held` (an entity on s1) is put through the writers' own
/// transaction (`storage::write::commit`). The deadline `within` is the
/// assertion: a commit that returns within it was acknowledged by the
/// primary alone. Returns the commit, still waiting.
async fn a_held_write(
    env: &TestEnv,
    shards: &storage::Shards,
    replica: &str,
    held: schemas::EntityId,
    within: Duration,
) -> tokio::task::JoinHandle<Result<usize, storage::StoreError>> {
    use storage::write::{self, Change, Item, Precondition, Rules, WriteContext};
    let ctx = WriteContext::new(shards.clone(), Rules::from_settings(&settings_of(env)));
    let bag = schemas::value::bag_from_json(&serde_json::json!({"v": "never acknowledged"})).unwrap();
    let item = Item { id: held, change: Change::Put(bag), pre: Precondition::default() };
    let mut root = crate::replication::connect(replica).await;
    sqlx::query("STOP SLAVE IO_THREAD").execute(&mut root).await.unwrap();
    let mut commit =
        tokio::spawn(async move { write::commit(&ctx, 1, &[item]).await.map(|c| c.results.len()) });
    let early = tokio::time::timeout(within, &mut commit).await;
    assert!(early.is_err(), "the write was acknowledged with no replica receiving: {early:?}");
    commit
}

/// How many rows of `entities` have id `id`, on `conn`.
async fn count(conn: &mut sqlx::MySqlConnection, id: schemas::EntityId) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM entities WHERE id = ?")
        .bind(id.0.to_vec())
        .fetch_one(conn)
        .await
        .unwrap()
}

/// A stale primary: frozen with `SIGSTOP` under a steady writer while a
/// commit of its own waits for an acknowledgement, failed over by the
/// coordinator, then let go with `SIGCONT`. No client gets an
/// acknowledgement from it: its commits wait for acknowledgements no
/// replica gives (their writes are answered 503 `outcome-unknown` after
/// `writer.commit_timeout_ms`, and a process started now routes to the
/// primary the map names, not to it). The running writer's commits stuck
/// on it hold none of the shard's commit slots on the new primary, and
/// its relay lets go of it: the shard's writes are acknowledged and
/// published from the new primary without a restart. The coordinator refuses to take it
/// back while it holds commits of its own; killed and restarted as a
/// replica, its recovery discards them and it rejoins. Every acknowledged
/// write reads back at its version, and the writes answered 503 are
/// either stored at their version or absent, never half there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_primary_never_acknowledges_after_its_failover_and_rejoins_clean() {
    let mut env = TestEnv::new("stalefailover", "").await;
    let dir = env.dir.path().to_path_buf();
    // s0 on m0; s1 on m1 and its replicas m2 and m3 (server ids 1 to 4).
    let mut members = two_shards(&mut env, 2).await.into_iter();
    let (a, b) = (members.next().unwrap(), members.next().unwrap());
    let (c, d) = (members.next().unwrap(), members.next().unwrap());
    let db = |i: usize| format!("{}_s{i}", env.name);
    let cleaner = env.spawn_env(&["cleaner"], &coordinator_env()).await;
    let writer = env.spawn_env(&["writer"], &[("BAGSTORE_WRITER__COMMIT_TIMEOUT_MS", "2000")]).await;
    let client = SteadyWriter::start(writer.api());
    client.more(30).await;

    // Both replicas stop receiving, so b's next commits wait for an
    // acknowledgement nobody gives; b is frozen only once one waits (a
    // freeze between commits would leave it nothing of its own to refuse).
    for replica in [&c, &d] {
        let mut root = crate::replication::connect(&replica.server_dsn()).await;
        storage::replication::stop_receiving(1, &mut root).await.expect("stop receiving");
    }
    eventually("a commit on b to wait for an acknowledgement", Duration::from_secs(30), || async {
        let mut conn = crate::replication::connect(&replication::service_dsn(&b, "")).await;
        let state = storage::replication::server_state(1, &mut conn).await.expect("b's state");
        (state.waiting_commits >= 1).then_some(())
    })
    .await;
    let (b_port, b_pid) = (b.port(), b.pid().to_string());
    let signal = |sig: &str| {
        assert!(bagstore_tests::std_command("kill").args([sig, &b_pid]).status().unwrap().success());
    };
    signal("-STOP");
    // Writes of s1 sent now wait on b (as many as the writer has commit
    // slots, and one more queued behind them): each is answered 503 after
    // the commit timeout, its commit still waiting there.
    let on_s1 = crate::group_commit::ids_on(1, 0x5b, 4);
    let stuck = futures::future::join_all(on_s1[..3].iter().map(|id| {
        let api = writer.api();
        async move { api.put(id, &serde_json::json!({"v": 1})).await.0 }
    }))
    .await;
    assert_eq!(stuck, [503, 503, 503], "writes to a frozen primary");
    let address = |port: u16| format!("mysql://bagstore@127.0.0.1:{port}/{}", db(1));
    let promoted =
        eventually("the coordinator to fail the frozen primary over", Duration::from_secs(60), || async {
            let doc = shard(&env, "s1").await;
            (doc["address"] != address(b_port)).then_some(doc)
        })
        .await;
    // Two replicas: the other one acknowledges, so the shard takes writes,
    // in the running writer too: the commits stuck on b hold none of its
    // slots on the new primary, and its relay lets go of b.
    eventually("the running writer to write to s1 on its new primary", Duration::from_secs(30), || async {
        (writer.api().put(&on_s1[3], &serde_json::json!({"v": 2})).await.0 == 201).then_some(())
    })
    .await;
    let new_primary = promoted["address"].as_str().unwrap().to_string();
    eventually("the relay to publish that write from the new primary", Duration::from_secs(30), || async {
        let mut conn = crate::replication::connect(&new_primary).await;
        let left: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM outbox WHERE entity_id = UNHEX(?)")
            .bind(&on_s1[3])
            .fetch_one(&mut conn)
            .await
            .unwrap();
        (left == 0).then_some(())
    })
    .await;
    client.more(20).await;
    signal("-CONT");
    // It answers again, holding commits nobody will acknowledge: the
    // coordinator refuses to take it back.
    eventually("the coordinator to refuse the stale primary", Duration::from_secs(30), || async {
        let m = cleaner.api().metrics().await;
        (sample(&m, "bagstore_rejoins_total{outcome=\"refused\",shard=\"s1\"}") >= Some(1.0)).then_some(())
    })
    .await;
    assert!(cleaner.log_text().contains("still waits for acknowledgements"), "{}", cleaner.log_text());
    // A process started now routes s1 to the map's primary, not to it.
    let late = env.spawn(&["writer"]).await;
    let late_client = SteadyWriter::start(late.api());
    late_client.more(10).await;
    client.more(10).await;

    // Killed and restarted as a replica, it discards its tail and rejoins.
    kill_9(b);
    let revived = start_on(&dir.join("m1"), 2, true, Some(b_port)).await;
    eventually("the coordinator to take the old primary back", Duration::from_secs(60), || async {
        let doc = shard(&env, "s1").await;
        let back = servers(&doc).contains(&(address(b_port), "replica".into(), "online".into()));
        (back && doc["address"] == new_primary).then_some(())
    })
    .await;
    let (mut acked, refused) = client.finish().await;
    let (late_acked, _) = late_client.finish().await;
    acked.extend(late_acked);
    eprintln!("{} writes acknowledged, {refused} answered 503 across the freeze", acked.len());
    let reader = env.spawn(&["reader"]).await;
    all_read_back(&reader.api(), &acked).await;
    let m = writer.api().metrics().await;
    eprintln!("outcome-unknown answers: {:?}", sample(&m, "bagstore_writer_outcome_unknown_total"));
    drop((writer, late, reader, cleaner));
    for server in [a, c, d, revived] {
        server.stop().await.expect("a clean stop");
    }
}

/// `bagstore dev --replicas 1`: every private shard (the metadata shard
/// included) gets a semi-sync replica, and `GET /v1/shards` shows them. A
/// client writes continuously; one shard's primary is killed with
/// `kill -9`: writes to that shard resume on their own (the coordinator
/// fails it over, dev restarts the dead server as a replica and the
/// coordinator takes it back, each step logged), every acknowledged write
/// reads back at its version, and a query equals the truth.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bagstore_dev_with_replicas_fails_a_dead_primary_over_on_its_own() {
    use bagstore_tests::{until_query_is, Proc, STANDARD_INDEXES};
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("indexes.toml");
    std::fs::write(&config, STANDARD_INDEXES).unwrap();
    let data = dir.path().join("data");
    let args: Vec<String> = ["dev", "--http", "127.0.0.1:0", "--replicas", "1", "--data-dir"]
        .iter()
        .map(|s| s.to_string())
        .chain([data.display().to_string(), "--config".into(), config.display().to_string()])
        .collect();
    let dev = Proc::start(&args, dir.path(), &[("BAGSTORE_MYSQL__FAILOVER_AFTER_MS", "1000")]).await.unwrap();
    let api = dev.api();
    let shards = || shards_of(&api);
    let before = shards().await;
    assert_eq!(before.len(), 2, "{before:?}");
    for s in &before {
        let servers = servers(s);
        assert_eq!(servers.len(), 2, "{s}");
        assert_eq!((servers[1].1.as_str(), servers[1].2.as_str()), ("replica", "online"), "{s}");
    }
    let client = SteadyWriter::start(api.clone());
    client.more(30).await;

    // s1's primary: the private server whose recorded port it listens on.
    let s1 = before.iter().find(|s| s["name"] == "s1").unwrap().clone();
    let primary = s1["address"].as_str().unwrap().to_string();
    let port = primary.rsplit_once(':').unwrap().1.split('/').next().unwrap().to_string();
    let server_dir = std::fs::read_dir(&data)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|d| std::fs::read_to_string(d.join("port")).is_ok_and(|p| p.trim() == port))
        .expect("the primary's directory");
    let pid = std::fs::read_to_string(server_dir.join("mysqld.pid")).unwrap();
    assert!(bagstore_tests::std_command("kill").args(["-9", pid.trim()]).status().unwrap().success());
    let killed = Instant::now();
    eventually(
        "s1 to fail over and the dead server to be back as a replica",
        Duration::from_secs(90),
        || async {
            let now = shards().await;
            let s1 = now.iter().find(|s| s["name"] == "s1").unwrap();
            let back = servers(s1).contains(&(primary.clone(), "replica".into(), "online".into()));
            (s1["address"] != primary.as_str() && back).then_some(())
        },
    )
    .await;
    eprintln!(
        "s1 failed over and its old primary rejoined {} ms after the kill",
        killed.elapsed().as_millis()
    );
    client.more(30).await;
    let log = dev.log_text();
    for step in [
        "a private mariadbd died",
        "failed over",
        "restarted the dead mariadbd as a replica",
        "took a server back as a replica",
    ] {
        assert!(log.contains(step), "dev's log lacks {step:?}");
    }
    let (acked, refused) = client.finish().await;
    eprintln!("{} writes acknowledged, {refused} answered 503", acked.len());
    all_read_back(&api, &acked).await;
    // Queries equal the truth: entities written after the failover, found
    // through their index on every shard.
    let user = schemas::EntityId(rand::random()).to_hex();
    let ids: Vec<String> = (0..6).map(|_| schemas::EntityId(rand::random()).to_hex()).collect();
    for id in &ids {
        assert_eq!(api.put(id, &serde_json::json!({"user_id": user})).await.0, 201);
    }
    let want: Vec<&str> = ids.iter().map(String::as_str).collect();
    until_query_is(&api, &serde_json::json!({"where": {"user_id": user}}), &want).await;
    dev.terminate().await;

    // Started again on its data dir (the replica count is the dir's): the
    // servers come back in the roles the map gives them, and serve.
    let again: Vec<String> = args.iter().filter(|a| *a != "--replicas" && *a != "1").cloned().collect();
    let dev = Proc::start(&again, dir.path(), &[]).await.unwrap();
    let api = dev.api();
    for s in shards_of(&api).await {
        let servers = servers(&s);
        assert!(servers.iter().all(|(_, _, state)| state == "online"), "{s}");
    }
    all_read_back(&api, &acked).await;
    assert_eq!(api.put(&ids[0], &serde_json::json!({"user_id": user, "again": true})).await.0, 200);
    dev.terminate().await;
}

/// `GET /v1/shards`' shards.
async fn shards_of(api: &bagstore_tests::Api) -> Vec<Value> {
    let (status, doc) = api.shards().await;
    assert_eq!(status, 200, "{doc}");
    doc["shards"].as_array().unwrap().clone()
}
