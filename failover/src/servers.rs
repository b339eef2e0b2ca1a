//! Reaching a shard's servers as the operator's account does: the DSNs
//! of `mysql.admin_user`, the replication source, one server's connection
//! and position.

use anyhow::{bail, ensure, Context};
use schemas::gtid::GtidPos;
use schemas::settings::Dsn;
use schemas::topology::{PhysicalShard, Topology};
use schemas::Settings;
use storage::dsn::{address_of, dedicated_connection, ServerConnection};
use storage::replication::{server_state, Source};
use storage::topology::META_SHARD;
use storage::Shards;

/// The physical shard called `name` in the map.
pub fn shard_named(shards: &Shards, name: &str) -> anyhow::Result<PhysicalShard> {
    let t = shards.topology();
    match t.shards.iter().find(|p| p.name == name) {
        Some(p) => Ok(p.clone()),
        None => {
            let names: Vec<&str> = t.shards.iter().map(|p| p.name.as_str()).collect();
            bail!("no physical shard is named {name} (the shards: {})", names.join(", "))
        }
    }
}

/// A connection of its own to `dsn`; the error names `what`.
pub async fn connect(dsn: &Dsn, what: &str) -> anyhow::Result<ServerConnection> {
    dedicated_connection(dsn).await.with_context(|| format!("connecting to {what} ({})", dsn.redacted()))
}

/// `dsn` as `mysql.admin_user` (unchanged when that is empty).
pub fn admin(settings: &Settings, dsn: &Dsn) -> Dsn {
    let m = &settings.mysql;
    if m.admin_user.is_empty() {
        return dsn.clone();
    }
    let userinfo = if m.admin_password.0.is_empty() {
        format!("mysql://{}@x", encode(&m.admin_user))
    } else {
        format!("mysql://{}:{}@x", encode(&m.admin_user), encode(&m.admin_password.0))
    };
    Dsn(storage::dsn::with_credentials_of(&address_of(dsn), &userinfo))
}

/// Percent-encodes what a DSN's user info cannot hold as it is.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The server at `address` as a replication source, reached as
/// `mysql.replication_user`.
pub fn source(settings: &Settings, address: &str) -> anyhow::Result<Source> {
    let m = &settings.mysql;
    ensure!(!m.replication_user.is_empty(), "set mysql.replication_user: the account replicas replicate as");
    let opts = storage::dsn::connect_options(&Dsn(address.to_string()))?;
    Ok(Source {
        host: opts.get_host().to_string(),
        port: opts.get_port(),
        user: m.replication_user.clone(),
        password: m.replication_password.0.clone(),
    })
}

/// The metadata shard's primary's address in `t`.
pub fn meta_primary(t: &Topology) -> anyhow::Result<String> {
    let p = t.shard(META_SHARD as u32).context("the map has no metadata shard")?;
    Ok(p.address.clone())
}

/// One server of a shard, as the admin account reaches it, with what it
/// held when reached.
#[derive(Debug)]
pub struct Server {
    pub address: String,
    pub conn: ServerConnection,
    pub current: GtidPos,
}

/// Reaches the server at `address` (of physical shard `shard`) as the
/// admin account.
pub async fn reach(
    shards: &Shards,
    settings: &Settings,
    shard: usize,
    address: &str,
) -> anyhow::Result<Server> {
    let dsn: Dsn = admin(settings, &shards.credentials_for(address)?);
    let mut conn = connect(&dsn, address).await?;
    let current = server_state(shard, &mut conn).await?.current;
    Ok(Server { address: address.to_string(), conn, current })
}
