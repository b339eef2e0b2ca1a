//! Private replicated shards for the suites and benchmarks of issue 33:
//! servers started with what replication needs, the settings the
//! replicas and failover commands take, and a cluster of two shards whose
//! second has replicas.

use devstack::mariadb::{MariaDb, MariaDbOptions, Replicated};
use devstack::replication;
use std::path::{Path, PathBuf};

use crate::TestEnv;

/// The settings a `shards replicas` or failover command (and the failover
/// coordinator) needs on the private servers: root as the admin account,
/// the replication account.
pub const ADMIN_ENV: [(&str, &str); 3] = [
    ("BAGSTORE_MYSQL__ADMIN_USER", "root"),
    ("BAGSTORE_MYSQL__REPLICATION_USER", replication::REPLICATION_USER),
    ("BAGSTORE_MYSQL__REPLICATION_PASSWORD", replication::REPLICATION_PASSWORD),
];

/// How big a private server of a replicated shard is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Size {
    /// The suites': many servers on one machine, a 16 MiB buffer pool.
    Test,
    /// As `bench` runs its servers, so their figures compare
    /// ([`MariaDbOptions::bench_sized`]).
    Bench,
}

impl Size {
    fn options(self) -> MariaDbOptions {
        match self {
            Size::Test => {
                MariaDbOptions { innodb_buffer_pool_size: Some("16M".into()), ..Default::default() }
            }
            Size::Bench => MariaDbOptions::bench_sized(false),
        }
    }
}

/// A private server of a replicated shard on `port` (a dead server
/// restarted where the map lists it), or a free one; `as_replica` starts
/// it read-only with `--init-rpl-role=SLAVE`.
pub async fn start_on(dir: &Path, server_id: u32, as_replica: bool, port: Option<u16>) -> MariaDb {
    try_start_on(dir, server_id, as_replica, port, Size::Test).await.expect("a private mariadbd")
}

/// [`start_on`] at `size`, with mariadbd's refusal to start as an error.
async fn try_start_on(
    dir: &Path,
    server_id: u32,
    as_replica: bool,
    port: Option<u16>,
    size: Size,
) -> anyhow::Result<MariaDb> {
    let opts =
        MariaDbOptions { replicated: Some(Replicated { server_id, as_replica }), port, ..size.options() };
    MariaDb::start_with(dir, opts).await
}

/// Whether mariadbd refused to start because its crash recovery could not
/// truncate a binary-log tail no replica acknowledged: a statement it
/// cannot take back (a DDL, such as a move's journal triggers) follows the
/// tail. Such a server cannot rejoin; it is re-seeded.
pub fn cannot_truncate(refusal: &anyhow::Error) -> bool {
    format!("{refusal:#}").contains("Cannot truncate the binary log")
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

/// One server of a [`Cluster`]: where it lives, so a killed one restarts
/// where the map lists it (its directory, `server_id` and port).
pub struct Member {
    pub dir: PathBuf,
    pub server_id: u32,
    pub port: u16,
    /// `None` while it is dead.
    pub server: Option<MariaDb>,
}

impl std::fmt::Debug for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Member").field("port", &self.port).field("alive", &self.server.is_some()).finish()
    }
}

/// Physical shards on servers of a test's own, each a primary and
/// `replicas` semi-sync replicas, the metadata shard's included. Which
/// member is a shard's primary is the map's to say ([`Cluster::refresh`]
/// follows it into the env's DSNs).
#[derive(Debug)]
pub struct Cluster {
    /// Per physical shard, in order: its servers.
    pub shards: Vec<Vec<Member>>,
    replicas: u32,
    size: Size,
}

impl Cluster {
    /// Starts `shards` physical shards (named `s0`, `s1`, …) with
    /// `replicas` replicas each, migrates them (the first `shards.min(2)`
    /// with `migrate`, the rest with `shards add`), registers the replicas,
    /// and points `env` at the primaries (the metadata shard's replicas as
    /// seeds).
    pub async fn start(env: &mut TestEnv, shards: usize, replicas: u32) -> Cluster {
        Cluster::start_sized(env, shards, replicas, Size::Test).await
    }

    /// [`Cluster::start`] on servers of `size`.
    pub async fn start_sized(env: &mut TestEnv, shards: usize, replicas: u32, size: Size) -> Cluster {
        let mut cluster = Cluster { shards: Vec::new(), replicas, size };
        let first = shards.min(2);
        for _ in 0..first {
            cluster.start_shard(env).await;
        }
        env.dsns = (0..first).map(|i| cluster.dsn(env, i, 0)).collect();
        env.migrate().await;
        for i in 0..first {
            cluster.add_replicas(env, i).await;
        }
        for i in first..shards {
            cluster.start_shard(env).await;
            let dsn = cluster.dsn(env, i, 0);
            let (ok, out, err) = env.run(&env.args(&["shards", "add", &format!("s{i}"), &dsn]), &[]).await;
            assert!(ok, "shards add: {out}{err}");
            env.dsns.push(dsn);
            cluster.add_replicas(env, i).await;
        }
        env.seeds = (1..=replicas as usize).map(|m| cluster.dsn(env, 0, m)).collect();
        cluster
    }

    async fn start_shard(&mut self, env: &TestEnv) {
        let i = self.shards.len() as u32;
        let mut members = Vec::new();
        for m in 0..=self.replicas {
            let server_id = i * 10 + m + 1;
            let dir = env.dir.path().join(format!("s{i}-{m}"));
            let server =
                try_start_on(&dir, server_id, m > 0, None, self.size).await.expect("a private mariadbd");
            replication::create_accounts(&server).await.expect("accounts");
            members.push(Member { dir, server_id, port: server.port(), server: Some(server) });
        }
        self.shards.push(members);
    }

    async fn add_replicas(&self, env: &TestEnv, shard: usize) {
        for m in 1..self.shards[shard].len() {
            let dsn = self.dsn(env, shard, m);
            let add = env.args(&["shards", "replicas", "add", &format!("s{shard}"), &dsn]);
            let (ok, out, err) = env.run(&add, &ADMIN_ENV).await;
            assert!(ok, "replicas add: {out}{err}");
        }
    }

    /// The services' DSN of shard `shard`'s database on its member `m`.
    pub fn dsn(&self, env: &TestEnv, shard: usize, m: usize) -> String {
        format!(
            "mysql://{}@127.0.0.1:{}/{}_s{shard}",
            replication::SERVICE_USER,
            self.shards[shard][m].port,
            env.name
        )
    }

    /// Which member of `shard` listens on the port of `address`.
    pub fn member_at(&self, shard: usize, address: &str) -> Option<usize> {
        let port: u16 = address.rsplit_once(':')?.1.split('/').next()?.parse().ok()?;
        self.shards[shard].iter().position(|m| m.port == port)
    }

    /// Points `env` at the primaries `addresses` names (one per shard, as
    /// the map has them): its DSNs, and the metadata shard's other members
    /// as seeds.
    pub fn refresh(&self, env: &mut TestEnv, addresses: &[String]) {
        for (shard, address) in addresses.iter().enumerate() {
            let m = self
                .member_at(shard, address)
                .unwrap_or_else(|| panic!("{address} is no member of s{shard}"));
            env.dsns[shard] = self.dsn(env, shard, m);
        }
        let meta = self.member_at(0, &addresses[0]).expect("the metadata shard's primary");
        env.seeds = (0..self.shards[0].len()).filter(|m| *m != meta).map(|m| self.dsn(env, 0, m)).collect();
    }

    /// Kills member `m` of `shard` with `kill -9`; returns its pid.
    pub fn kill_9(&mut self, shard: usize, m: usize) -> u32 {
        let server = self.shards[shard][m].server.take().expect("a live member");
        let pid = server.pid();
        let killed = crate::std_command("kill").args(["-9", &pid.to_string()]).status().expect("kill");
        assert!(killed.success(), "kill -9 {pid}");
        drop(server);
        pid
    }

    /// Restarts a killed member where it was, as a replica (its recovery
    /// discards a tail no replica acknowledged); mariadbd's refusal to
    /// start as an error (see [`cannot_truncate`]).
    pub async fn restart_as_replica(&mut self, shard: usize, m: usize) -> anyhow::Result<()> {
        let member = &mut self.shards[shard][m];
        member.server =
            Some(try_start_on(&member.dir, member.server_id, true, Some(member.port), self.size).await?);
        Ok(())
    }

    /// Re-seeds member `m` of `shard`, a dead server that cannot rejoin, as
    /// docs/operations.md tells an operator to: removed from the map, its
    /// data thrown away, an empty server started on its port (under a new
    /// server id) and added as a replica, which seeds it.
    pub async fn reseed(&mut self, env: &TestEnv, shard: usize, m: usize) {
        let (name, dsn) = (format!("s{shard}"), self.dsn(env, shard, m));
        let (ok, out, err) =
            env.run(&env.args(&["shards", "replicas", "remove", &name, &dsn]), &ADMIN_ENV).await;
        assert!(ok, "replicas remove: {out}{err}");
        let member = &mut self.shards[shard][m];
        std::fs::remove_dir_all(&member.dir).expect("the dead server's directory");
        member.server_id += 100;
        let server = try_start_on(&member.dir, member.server_id, true, Some(member.port), self.size)
            .await
            .expect("a private mariadbd");
        replication::create_accounts(&server).await.expect("accounts");
        member.server = Some(server);
        let (ok, out, err) =
            env.run(&env.args(&["shards", "replicas", "add", &name, &dsn]), &ADMIN_ENV).await;
        assert!(ok, "replicas add: {out}{err}");
    }

    /// Stops every running member cleanly.
    pub async fn stop(self) {
        for member in self.shards.into_iter().flatten() {
            if let Some(server) = member.server {
                server.stop().await.expect("a clean stop");
            }
        }
    }
}
