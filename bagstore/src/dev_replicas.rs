//! `bagstore dev --replicas N`: each private shard is a primary and N
//! private replicas (semi-sync, GTID; see `devstack::replication`), the
//! metadata shard included, and dev keeps them.
//!
//! - The servers of shard `i` live in `shard-<i>` (its first primary) and
//!   `shard-<i>-replica-<j>`, each on a port recorded in its directory the
//!   first time (`port`), so the addresses the map lists stay true across
//!   restarts. The replica count is recorded too (`replicas`): a data dir
//!   keeps the count it was made with.
//! - The services connect as `devstack::replication::SERVICE_USER`, an
//!   account without `SUPER` or `READ_ONLY ADMIN`, as production should;
//!   root is the admin account.
//! - A new cluster: migrate on the first primaries, then each replica is
//!   added as `bagstore shards replicas add` adds one. A shard added by
//!   `--shards` growth gets its replicas the same way.
//! - A restart: every server starts read-only as a replica (its crash
//!   recovery discards a tail no replica acknowledged), then each listed
//!   replica rejoins its shard's primary, which takes writes again once
//!   one acknowledges.
//! - While dev runs: a server that dies is logged; dev waits for the
//!   coordinator to fail its shard over when it was the primary, restarts
//!   it as a replica on its port, and the coordinator takes it back.

use anyhow::{bail, Context};
use devstack::mariadb::{MariaDb, MariaDbOptions, Replicated};
use devstack::replication::{self, REPLICATION_PASSWORD, REPLICATION_USER};
use schemas::settings::{Dsn, Secret};
use schemas::Settings;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use storage::dsn::place_of;
use storage::Shards;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

/// The database every private shard uses (as `dev`'s lone servers do).
const DATABASE: &str = "bagstore";
/// The most replicas per shard `--replicas` takes.
pub const MAX_REPLICAS: u8 = 4;

/// One private server of a replicated shard.
#[derive(Debug)]
struct Member {
    shard: usize,
    index: u8,
    dir: PathBuf,
    port: u16,
    server: Option<MariaDb>,
}

impl Member {
    /// The address the map lists it at.
    fn address(&self) -> String {
        format!("mysql://{}@127.0.0.1:{}/{DATABASE}", replication::SERVICE_USER, self.port)
    }

    fn dsn(&self) -> Dsn {
        Dsn(self.address())
    }
}

/// dev's replicated private servers.
#[derive(Debug, Clone)]
pub struct Group {
    members: Arc<Mutex<Vec<Member>>>,
    replicas: u8,
}

fn member_dir(data_dir: &Path, shard: usize, index: u8) -> PathBuf {
    match index {
        0 => data_dir.join(format!("shard-{shard}")),
        j => data_dir.join(format!("shard-{shard}-replica-{j}")),
    }
}

/// The replica count of the data dir: the one it was made with (recorded
/// in `replicas`), or `wanted` for a new one. A data dir made without
/// replicas, or with another count, is refused with a message.
pub fn replicas_of(data_dir: &Path, wanted: Option<u8>) -> anyhow::Result<u8> {
    let file = data_dir.join("replicas");
    let existing = data_dir.join("shard-0").exists();
    let recorded = match std::fs::read_to_string(&file) {
        Ok(text) => {
            Some(text.trim().parse::<u8>().with_context(|| format!("{} is not a count", file.display()))?)
        }
        Err(_) if existing => Some(0),
        Err(_) => None,
    };
    match (recorded, wanted) {
        (Some(r), Some(w)) if r != w => bail!(
            "the data dir {} was made with {r} replica(s) per shard; --replicas cannot change that: use \
             another --data-dir",
            data_dir.display()
        ),
        (Some(r), _) => Ok(r),
        (None, w) => {
            let n = w.unwrap_or(0);
            if n > 0 {
                std::fs::write(&file, format!("{n}\n"))
                    .with_context(|| format!("writing {}", file.display()))?;
            }
            Ok(n)
        }
    }
}

/// Starts (or restarts) the servers of `total` shards with `replicas`
/// replicas each, sets `settings` to reach them (the services' account,
/// the admin and replication accounts), and on a restart lets each listed
/// replica rejoin. Returns the group and the shards new to the cluster
/// (the first ones of a new cluster, or those `--shards` adds).
pub async fn start(
    data_dir: &Path,
    total: usize,
    replicas: u8,
    settings: &mut Settings,
) -> anyhow::Result<(Group, Vec<usize>)> {
    let existing = (0..).take_while(|i| member_dir(data_dir, *i, 0).exists()).count();
    if total < existing {
        bail!("--shards cannot shrink a cluster with replicas ({existing} shards in {})", data_dir.display());
    }
    let mut starts = Vec::new();
    for shard in 0..total {
        for index in 0..=replicas {
            // A server of a cluster that existed starts as a replica: its
            // role is settled below from the map.
            let as_replica = shard < existing || index > 0;
            starts.push(start_member(data_dir, shard, index, as_replica));
        }
    }
    let mut members = Vec::new();
    for m in futures::future::join_all(starts).await {
        members.push(m?);
    }
    let m = &mut settings.mysql;
    m.admin_user = "root".into();
    m.replication_user = REPLICATION_USER.into();
    m.replication_password = Secret(REPLICATION_PASSWORD.into());
    m.shards = if existing == 0 {
        members.iter().filter(|m| m.index == 0).map(Member::dsn).collect()
    } else {
        members.iter().filter(|m| m.shard < existing).map(Member::dsn).collect()
    };
    let group = Group { members: Arc::new(Mutex::new(members)), replicas };
    if existing > 0 {
        group.rejoin_all(settings).await?;
    }
    Ok((group, (existing..total).collect()))
}

async fn start_member(data_dir: &Path, shard: usize, index: u8, as_replica: bool) -> anyhow::Result<Member> {
    let dir = member_dir(data_dir, shard, index);
    let port_file = dir.join("port");
    let port = std::fs::read_to_string(&port_file).ok().and_then(|p| p.trim().parse().ok());
    let opts = MariaDbOptions {
        port,
        replicated: Some(Replicated { server_id: shard as u32 * 8 + index as u32 + 1, as_replica }),
        ..Default::default()
    };
    let server = MariaDb::start_with(&dir, opts)
        .await
        .with_context(|| format!("starting shard {shard}'s server {index} in {}", dir.display()))?;
    std::fs::write(&port_file, format!("{}\n", server.port()))?;
    replication::create_accounts(&server).await?;
    Ok(Member { shard, index, dir, port: server.port(), server: Some(server) })
}

impl Group {
    /// A restart: each listed replica of each shard rejoins its primary
    /// (which then takes writes again).
    async fn rejoin_all(&self, settings: &Settings) -> anyhow::Result<()> {
        let shards =
            Shards::connect(&settings.mysql).await.context("finding the private shards' primaries")?;
        let t = shards.topology();
        for p in &t.shards {
            for r in t.replicas_of(p.id) {
                match failover::rejoin::rejoin(&shards, settings, p, &r.address).await {
                    Ok(how) => tracing::info!(shard = %p.name, server = %r.address, ?how, "replica rejoined"),
                    Err(e) => tracing::warn!(shard = %p.name, server = %r.address, error = format!("{e:#}"),
                        "a replica could not rejoin"),
                }
            }
        }
        shards.close().await;
        Ok(())
    }

    /// Adds the replicas of the new shards `new` (named `s<i>`), as
    /// `shards replicas add` does; then lists every server in `settings`.
    pub async fn add_replicas(
        &self,
        shards: &Shards,
        settings: &mut Settings,
        new: &[usize],
    ) -> anyhow::Result<()> {
        let members = self.members.lock().await;
        for m in members.iter().filter(|m| m.index > 0 && new.contains(&m.shard)) {
            let name = format!("s{}", m.shard);
            crate::replicas::add_to(shards, settings, &name, &m.dsn())
                .await
                .with_context(|| format!("adding {} as a replica of {name}", m.address()))?;
            tracing::info!(shard = %name, server = %m.address(), "added a private replica");
        }
        settings.mysql.shards = members.iter().map(Member::dsn).collect();
        Ok(())
    }

    /// Keeps the servers: one that died is restarted as a replica once the
    /// map no longer names it a primary (the coordinator failed it over),
    /// and the coordinator takes it back. Runs until `stop`.
    pub async fn keep(self, shards: Shards, stop: CancellationToken) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stop.cancelled() => return,
            }
            let mut members = self.members.lock().await;
            for m in members.iter_mut() {
                let alive =
                    m.server.as_ref().is_some_and(|s| Path::new(&format!("/proc/{}", s.pid())).exists());
                if alive {
                    continue;
                }
                if m.server.take().is_some() {
                    tracing::warn!(server = %m.address(), shard = m.shard, "a private mariadbd died");
                }
                let t = shards.topology();
                let primary = t.shards.iter().any(|p| place_of(&p.address) == place_of(&m.address()));
                if primary {
                    continue; // The coordinator fails the shard over first.
                }
                match start_member(m.dir.parent().expect("in the data dir"), m.shard, m.index, true).await {
                    Ok(fresh) => {
                        tracing::warn!(server = %m.address(), "restarted the dead mariadbd as a replica; the failover coordinator takes it back");
                        m.server = fresh.server;
                    }
                    Err(e) => {
                        tracing::error!(server = %m.address(), error = format!("{e:#}"), "restarting a dead mariadbd failed")
                    }
                }
            }
        }
    }

    /// The DSN of shard `shard`'s first primary.
    pub async fn primary_dsn(&self, shard: usize) -> Dsn {
        let members = self.members.lock().await;
        members
            .iter()
            .find(|m| m.shard == shard && m.index == 0)
            .map(Member::dsn)
            .expect("every shard has a first server")
    }

    /// How many replicas each shard has.
    pub fn replicas(&self) -> u8 {
        self.replicas
    }

    /// Stops every server.
    pub async fn stop(&self) {
        let mut members = self.members.lock().await;
        for m in members.iter_mut() {
            if let Some(s) = m.server.take() {
                if let Err(e) = s.stop().await {
                    tracing::warn!(error = %e, "mariadbd did not stop cleanly");
                }
            }
        }
    }
}
