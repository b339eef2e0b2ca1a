//! Keeping a process's map current: every `mysql.map_refresh_ms` it asks
//! the metadata shard for the map's epoch, reloads the map when it moved
//! (so shards added online and finished moves are picked up without a
//! restart), and records the epoch it routes with in `bagstore_processes`
//! (a move removes a source's copy only once every live process is past
//! its cutover). Also exports the map: epoch, reloads, and per physical
//! shard the logical shards it owns and its rows.

use prometheus::{IntCounter, IntGauge, IntGaugeVec, Opts, Registry};
use schemas::gtid::GtidPos;
use schemas::topology::{PhysicalShard, Topology};
use std::time::Duration;
use storage::replication::ServerState;
use storage::{moves, topology, Shards};
use tokio_util::sync::CancellationToken;

/// Rows per shard are estimated every this many refreshes.
const ROWS_EVERY: u64 = 15;

/// How long one refresh waits for a server's answer. A dead server's pool
/// retries its connection until `mysql.connect_timeout_ms`: waited for
/// that long, a refresh would hold the next map (a failover's new primary)
/// back from every route of this process.
const ANSWER: Duration = Duration::from_secs(1);

/// `query` within [`ANSWER`]; past it, the shard counts as unavailable.
async fn within<T>(
    shard: usize,
    query: impl std::future::Future<Output = storage::Result<T>>,
) -> storage::Result<T> {
    match tokio::time::timeout(ANSWER, query).await {
        Ok(answer) => answer,
        Err(_) => Err(storage::StoreError::timed_out(shard)),
    }
}

#[derive(Debug, Clone)]
pub struct MapMetrics {
    pub epoch: IntGauge,
    pub reloads: IntCounter,
    pub logical_owned: IntGaugeVec,
    pub rows: IntGaugeVec,
}

impl MapMetrics {
    pub fn register(r: &Registry) -> prometheus::Result<MapMetrics> {
        let m = MapMetrics {
            epoch: IntGauge::new("bagstore_map_epoch", "Epoch of the map this process routes with")?,
            reloads: IntCounter::new(
                "bagstore_map_reloads_total",
                "Map loads (after a write or read found its map stale, or the epoch moved)",
            )?,
            logical_owned: IntGaugeVec::new(
                Opts::new(
                    "bagstore_shard_logical_shards",
                    "Logical shards each physical shard (label: its id) owns, by the map",
                ),
                &["shard"],
            )?,
            rows: IntGaugeVec::new(
                Opts::new(
                    "bagstore_shard_entities",
                    "Entity rows on each physical shard (InnoDB's estimate)",
                ),
                &["shard"],
            )?,
        };
        r.register(Box::new(m.epoch.clone()))?;
        r.register(Box::new(m.reloads.clone()))?;
        r.register(Box::new(m.logical_owned.clone()))?;
        r.register(Box::new(m.rows.clone()))?;
        Ok(m)
    }
}

/// This process's name in `bagstore_processes`: host, pid and a start
/// time, so a restarted process is a new one.
pub fn process_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    format!("{}:{}:{}", host.trim(), std::process::id(), started.as_millis())
}

/// Runs until `stop`: refreshes the map, reports this process, exports the
/// map's series.
pub async fn watch(
    shards: Shards,
    role: String,
    every: Duration,
    metrics: MapMetrics,
    stop: CancellationToken,
) {
    let me = process_id();
    let mut reloads_seen = 0;
    let mut tick: u64 = 0;
    loop {
        if let Err(e) = refresh(&shards, &me, &role, &metrics, tick.is_multiple_of(ROWS_EVERY)).await {
            tracing::warn!(error = %e, "map refresh failed; routing with the map loaded before");
        }
        let reloads = shards.reloads();
        metrics.reloads.inc_by(reloads - reloads_seen);
        reloads_seen = reloads;
        tick += 1;
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.cancelled() => return,
        }
    }
}

async fn refresh(
    shards: &Shards,
    me: &str,
    role: &str,
    metrics: &MapMetrics,
    rows: bool,
) -> storage::Result<()> {
    // A metadata shard that does not answer may have failed over: the
    // reload looks for its primary among its servers, then reads again.
    let meta = topology::META_SHARD;
    let epoch = match within(meta, moves::cluster_epoch(shards.meta())).await {
        Ok(epoch) => epoch,
        Err(e) => {
            tracing::debug!(error = %e, "the metadata shard did not answer; looking for its primary");
            shards.reload().await?;
            moves::cluster_epoch(shards.meta()).await?
        }
    };
    if epoch != shards.epoch() {
        shards.reload().await?;
    }
    let t = shards.topology();
    within(meta, topology::heartbeat(shards.meta(), me, role, t.epoch)).await?;
    metrics.epoch.set(t.epoch as i64);
    for (id, n) in t.counts() {
        if let Some(p) = t.shard(id) {
            metrics.logical_owned.with_label_values(&[&p.id.to_string()]).set(n as i64);
        }
    }
    if rows {
        within(meta, topology::forget_old_processes(shards.meta())).await?;
        for p in &t.shards {
            let id = p.id as usize;
            // A shard that does not answer keeps its last estimate.
            if let Ok(n) = within(id, storage::entities::estimated_rows(id, shards.pool(id))).await {
                metrics.rows.with_label_values(&[&p.id.to_string()]).set(n as i64);
            }
        }
    }
    Ok(())
}

/// The cluster's layout as `bagstore shards list --json` and
/// `GET /v1/shards` give it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ShardsReport {
    pub epoch: u64,
    pub logical_shards: u16,
    pub shards: Vec<ShardReport>,
    /// Moves in flight (empty when none).
    pub moves: Vec<MoveReport>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct ShardReport {
    pub name: String,
    pub id: u32,
    /// Its DSN without the password.
    pub address: String,
    pub epoch: u64,
    /// How many logical shards it owns, and which.
    pub logical: usize,
    pub ranges: String,
    /// Entity rows (InnoDB's estimate; null while the primary does not
    /// answer).
    pub entities_estimate: Option<u64>,
    /// Its servers: the primary (at `address`) first, then its replicas.
    pub servers: Vec<ServerReport>,
}

/// One server of a physical shard, as its own replication status says.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ServerReport {
    pub address: String,
    /// `primary` or `replica`.
    pub role: &'static str,
    /// How far a replica is behind its primary (0 once it holds every
    /// transaction the primary has; null for the primary, or when unknown).
    pub lag_ms: Option<u64>,
    /// `online`, `catching_up` (replicating, behind), `down` (no answer,
    /// or not replicating) or `rejoining` (a former primary on its way
    /// back as a replica).
    pub state: &'static str,
    /// Why a server is not online, when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct MoveReport {
    pub id: u64,
    pub logicals: String,
    pub source: String,
    pub target: String,
    pub phase: moves::Phase,
    pub rows_copied: u64,
    pub started_us: i64,
    pub changed_us: i64,
}

/// How long the report waits for one server's answer.
const SERVER_ANSWER: Duration = Duration::from_secs(2);

/// The servers of physical shard `p`: whether each answers, and how far
/// each replica is behind the primary (by GTID: caught up is 0, else
/// MariaDB's `Seconds_Behind_Master`).
async fn servers_of(shards: &Shards, t: &Topology, p: &PhysicalShard) -> Vec<ServerReport> {
    let id = p.id as usize;
    let replicas: Vec<String> = t.replicas_of(p.id).map(|r| r.address.clone()).collect();
    // The primary first: a replica is compared with what the primary held
    // before the replica was asked, so under steady writes one that keeps
    // up is not reported behind by the commits made while it was asked.
    let (ping, primary_state) = futures::join!(tokio::time::timeout(SERVER_ANSWER, shards.ping(id)), async {
        if replicas.is_empty() {
            Err(String::new())
        } else {
            state_at(shards, id, &p.address, None).await
        }
    },);
    let primary = match ping {
        Ok(Ok(())) => ServerReport {
            address: p.address.clone(),
            role: "primary",
            lag_ms: None,
            state: "online",
            error: None,
        },
        Ok(Err(e)) => down(&p.address, "primary", e.to_string()),
        Err(_) => down(&p.address, "primary", format!("no answer within {} ms", SERVER_ANSWER.as_millis())),
    };
    let primary_pos = primary_state.ok().map(|s| s.current);
    // The replicas at once: a frozen one costs the report SERVER_ANSWER
    // once, not once per server.
    let replica_states =
        futures::future::join_all(replicas.iter().map(|a| state_at(shards, id, a, primary_pos.as_ref())))
            .await;
    let mut out = vec![primary];
    for (address, state) in replicas.into_iter().zip(replica_states) {
        out.push(match state {
            Err(e) => down(&address, "replica", e),
            Ok(s) => replica_report(address, s, primary_pos.as_ref()),
        });
    }
    out
}

/// InnoDB's estimate of a shard's entity rows, if its primary answers in
/// time (a dead one's pool would wait out `connect_timeout_ms`).
async fn estimate(shards: &Shards, shard: usize) -> Option<u64> {
    let ask = storage::entities::estimated_rows(shard, shards.pool(shard));
    tokio::time::timeout(SERVER_ANSWER, ask).await.ok()?.ok()
}

fn down(address: &str, role: &'static str, error: String) -> ServerReport {
    ServerReport { address: address.to_string(), role, lag_ms: None, state: "down", error: Some(error) }
}

fn replica_report(address: String, s: ServerState, primary: Option<&GtidPos>) -> ServerReport {
    let Some(r) = s.replica.filter(|r| r.io_running && r.sql_running) else {
        let error = "not replicating (its replication threads are stopped)".to_string();
        return ServerReport { address, role: "replica", lag_ms: None, state: "down", error: Some(error) };
    };
    let caught_up = primary.is_some_and(|p| s.current.includes(p));
    let lag_ms = if caught_up { Some(0) } else { r.lag_secs.map(|l| l * 1000) };
    let state = if caught_up || lag_ms == Some(0) { "online" } else { "catching_up" };
    ServerReport { address, role: "replica", lag_ms, state, error: r.last_error }
}

/// How long a replica is given to apply what its primary held when asked
/// before it is reported catching up: a replica that keeps up applies a
/// transaction a few milliseconds after its primary commits it.
const SETTLE: Duration = Duration::from_millis(250);

/// A server's replication state, read on a connection of its own; a
/// replica first waits up to SETTLE for `primary` (its primary's position).
async fn state_at(
    shards: &Shards,
    shard: usize,
    address: &str,
    primary: Option<&GtidPos>,
) -> Result<ServerState, String> {
    let work = async {
        let dsn = shards.credentials_for(address).map_err(|e| e.to_string())?;
        let mut conn = storage::dsn::dedicated_connection(&dsn).await.map_err(|e| e.to_string())?;
        if let Some(pos) = primary {
            storage::replication::wait_for(shard, &mut conn, pos, SETTLE).await.map_err(|e| e.to_string())?;
        }
        let state = storage::replication::server_state(shard, &mut conn).await.map_err(|e| e.to_string());
        state
    };
    match tokio::time::timeout(SERVER_ANSWER, work).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer within {} ms", SERVER_ANSWER.as_millis())),
    }
}

/// Builds the report from the map (reloaded first) and the shards.
pub async fn report(shards: &Shards) -> storage::Result<ShardsReport> {
    shards.reload().await?;
    let t = shards.topology();
    let mut out = Vec::new();
    for p in &t.shards {
        let owned = t.owned_by(p.id);
        out.push(ShardReport {
            name: p.name.clone(),
            id: p.id,
            address: p.address.clone(),
            epoch: p.epoch,
            logical: owned.len(),
            ranges: schemas::topology::format_logicals(&owned),
            entities_estimate: estimate(shards, p.id as usize).await,
            servers: servers_of(shards, &t, p).await,
        });
    }
    let name = |id: u32| t.shard(id).map_or_else(|| id.to_string(), |p| p.name.clone());
    let moves = moves::moves_in_flight(shards.meta())
        .await?
        .into_iter()
        .map(|m| MoveReport {
            id: m.id,
            logicals: schemas::topology::format_logicals(&m.logicals),
            source: name(m.source),
            target: name(m.target),
            phase: m.phase,
            rows_copied: m.rows_copied,
            started_us: m.started_us,
            changed_us: m.changed_us,
        })
        .collect();
    Ok(ShardsReport { epoch: t.epoch, logical_shards: t.logical_shards, shards: out, moves })
}
