//! Private replicated shards for the suites and benchmarks of issue 33:
//! servers started with what replication needs, the settings the
//! replicas and failover commands take, and a cluster of two shards whose
//! second has replicas.

use devstack::mariadb::{MariaDb, MariaDbOptions, Replicated};
use devstack::replication;
use std::path::Path;

use crate::TestEnv;

/// The settings a `shards replicas` or failover command (and the failover
/// coordinator) needs on the private servers: root as the admin account,
/// the replication account.
pub const ADMIN_ENV: [(&str, &str); 3] = [
    ("BAGSTORE_MYSQL__ADMIN_USER", "root"),
    ("BAGSTORE_MYSQL__REPLICATION_USER", replication::REPLICATION_USER),
    ("BAGSTORE_MYSQL__REPLICATION_PASSWORD", replication::REPLICATION_PASSWORD),
];

/// A private server of a replicated shard on `port` (a dead server
/// restarted where the map lists it), or a free one; `as_replica` starts
/// it read-only with `--init-rpl-role=SLAVE`.
pub async fn start_on(dir: &Path, server_id: u32, as_replica: bool, port: Option<u16>) -> MariaDb {
    let opts = MariaDbOptions {
        innodb_buffer_pool_size: Some("16M".into()),
        replicated: Some(Replicated { server_id, as_replica }),
        port,
        ..Default::default()
    };
    MariaDb::start_with(dir, opts).await.expect("a private mariadbd")
}

/// The address the map lists database `db` of `server` at.
pub fn address(server: &MariaDb, db: &str) -> String {
    format!("mysql://{}@127.0.0.1:{}/{db}", replication::SERVICE_USER, server.port())
}

/// A cluster of two shards on servers of `env`'s own: `s0` on one server,
/// `s1` on a primary with `replicas` replicas, migrated, the replicas
/// added. Returns the servers: `s0`'s, then `s1`'s primary, then its
/// replicas.
pub async fn two_shards(env: &mut TestEnv, replicas: u32) -> Vec<MariaDb> {
    let dir = env.dir.path().to_path_buf();
    let mut servers = Vec::new();
    for i in 0..2 + replicas {
        let server = start_on(&dir.join(format!("m{i}")), i + 1, i >= 2, None).await;
        replication::create_accounts(&server).await.expect("accounts");
        servers.push(server);
    }
    let db = |i: usize| format!("{}_s{i}", env.name);
    env.dsns =
        vec![replication::service_dsn(&servers[0], &db(0)), replication::service_dsn(&servers[1], &db(1))];
    env.migrate().await;
    for replica in &servers[2..] {
        let add = env.args(&["shards", "replicas", "add", "s1", &replication::service_dsn(replica, &db(1))]);
        let (ok, out, err) = env.run(&add, &ADMIN_ENV).await;
        assert!(ok, "replicas add: {out}{err}");
    }
    servers
}
