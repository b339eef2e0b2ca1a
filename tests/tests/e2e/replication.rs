//! MariaDB replication as bagstore runs it (issue 33), on private servers
//! of each test's own: what `storage::replication` reads and checks, and
//! the window a failover must not lose a write in. With semi-sync at
//! `AFTER_SYNC` and a timeout that never passes, a commit no replica
//! acknowledged hangs and is seen by no other session; after the primary
//! dies and a replica is promoted it is nowhere, and the dead primary,
//! started again as a replica, truncates it before it rejoins.

use bagstore_tests::eventually;
use devstack::mariadb::{MariaDb, MariaDbOptions, Replicated};
use devstack::replication;
use sqlx::{Connection, MySqlConnection};
use std::path::Path;
use std::time::Duration;
use storage::replication::{check_server, server_state, Role};

async fn start(dir: &Path, server_id: u32, as_replica: bool) -> MariaDb {
    let opts = MariaDbOptions {
        innodb_buffer_pool_size: Some("16M".into()),
        replicated: Some(Replicated { server_id, as_replica }),
        ..Default::default()
    };
    MariaDb::start_with(dir, opts).await.expect("a private mariadbd")
}

async fn connect(dsn: &str) -> MySqlConnection {
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
