//! `bagstore shards replicas add|remove`: a physical shard's replicas.
//!
//! Adding one: both servers are checked for what replication without loss
//! needs (`storage::replication::check_server`), the replica gets the
//! shard's data (from the primary's binary log when it still holds every
//! transaction, else from a seed taken with `mariadb-dump --gtid` and
//! loaded outside the replica's own binary log), replicates from the
//! primary until it has caught up, and only then does the primary's every
//! commit wait for a replica's acknowledgement and the map list it. So a
//! shard never waits on a replica that cannot acknowledge yet.
//!
//! Removing the last replica stops the waiting first: a primary left
//! waiting for an acknowledgement that cannot come would take no write.
//!
//! Server-level steps (`read_only`, `CHANGE MASTER`, semi-sync) run as
//! `mysql.admin_user`; the services' account must not be able to.

use anyhow::{bail, ensure, Context};
use failover::servers::{admin, connect, shard_named, source};
use failover::switchover::SWITCHOVER_WAIT;
use schemas::gtid::GtidPos;
use schemas::settings::Dsn;
use schemas::topology::PhysicalShard;
use schemas::Settings;
use std::process::Stdio;
use std::time::Duration;
use storage::dsn::{address_of, place_of, split_database, ServerConnection as MySqlConnection};
use storage::replication::{self, check_server, server_state, Role};
use storage::{locks, topology, Shards};

/// How long `replicas add` waits for a new replica to catch up.
const CATCH_UP: Duration = Duration::from_secs(600);

/// `shards replicas add SHARD DSN`.
pub async fn add(settings: Settings, shard: &str, dsn: Dsn) -> anyhow::Result<()> {
    let settings_async = settings.mysql.allow_async;
    let shards = Shards::connect(&settings.mysql).await?;
    let result = add_to(&shards, &settings, shard, &dsn).await;
    shards.close().await;
    let (p, how) = result?;
    let acks = if settings_async {
        "replicates asynchronously (mysql.allow_async): a failover may lose acknowledged writes"
    } else {
        "now acknowledges a write only once a replica holds it"
    };
    println!(
        "replica {} of shard {shard} added ({}); the primary {} {acks}",
        address_of(&dsn),
        how.says(),
        p.address
    );
    Ok(())
}

pub(crate) async fn add_to(
    shards: &Shards,
    settings: &Settings,
    name: &str,
    dsn: &Dsn,
) -> anyhow::Result<(PhysicalShard, How)> {
    let p = shard_named(shards, name)?;
    let primary = shards.credentials_for(&p.address)?;
    let db = |d: &Dsn| split_database(d).map(|(db, _)| db);
    ensure!(
        db(dsn).is_some() && db(dsn) == db(&primary),
        "the replica's DSN must name the shard's database `{}`",
        db(&primary).unwrap_or_default()
    );
    ensure!(place_of(dsn.expose()) != place_of(&p.address), "{} is the shard's primary", address_of(dsn));
    let id = p.id as usize;
    let mut p_service = connect(&primary, "the primary").await?;
    // The replica's database comes with its seed: its server, without it.
    let (_, server) = split_database(dsn).context("the replica's DSN names no database")?;
    let mut r_service = connect(&server, "the replica").await?;
    let mut p_admin = connect(&admin(settings, &primary), "the primary as mysql.admin_user").await?;
    let mut r_admin = connect(&admin(settings, &server), "the replica as mysql.admin_user").await?;
    // Held until `p_admin` goes: a switchover under way keeps the primary
    // read-only, and this may open a read-only primary below.
    ensure!(
        locks::take_switchover_lock(id, &mut p_admin, SWITCHOVER_WAIT).await?,
        "shard {name} has been changing primaries (a switchover, or the failover coordinator) for {} s: \
         try again later",
        SWITCHOVER_WAIT.as_secs()
    );
    refuse_unless_ready(id, &mut p_service, Role::Primary, "the primary").await?;
    // Everything a replica needs but `read_only`, which is set below: a
    // server found wanting is refused before anything on it changes.
    refuse_unless_ready(id, &mut r_service, Role::Primary, "the replica").await?;
    let (ps, rs) = (server_state(id, &mut p_admin).await?, server_state(id, &mut r_admin).await?);
    ensure!(
        ps.server_id != rs.server_id,
        "the replica's server_id ({}) is the primary's: every server of a shard needs its own",
        rs.server_id
    );
    let source = source(settings, &p.address)?;
    let already =
        rs.replica.as_ref().is_some_and(|r| r.master_port == source.port && r.master_host == source.host);
    let how = if already {
        How::Replicating
    } else if !rs.current.is_empty() {
        // A server with a history of its own rejoins (a former primary,
        // its unacknowledged tail truncated by its recovery) only if the
        // primary holds every transaction it holds: anything more is an
        // errant transaction no one acknowledged, never to be served.
        ensure!(
            ps.current.includes(&rs.current),
            "{} holds transactions the primary does not ({} against the primary's {}): errant, never \
             acknowledged; re-seed it (an empty server) rather than let it rejoin",
            address_of(dsn),
            rs.current,
            ps.current
        );
        replication::replicate_from(id, &mut r_admin, &source, None).await?;
        How::Rejoined
    } else {
        let from = seed(id, settings, &primary, &server, &mut p_admin, &mut r_admin).await?;
        replication::replicate_from(id, &mut r_admin, &source, from.as_ref()).await?;
        if from.is_some() {
            How::Seeded
        } else {
            How::FromLog
        }
    };
    refuse_unless_ready(id, &mut r_service, Role::Replica, "the replica").await?;
    let target = server_state(id, &mut p_admin).await?.current;
    ensure!(
        replication::wait_for(id, &mut r_admin, &target, CATCH_UP).await?,
        "the replica did not catch up with the primary ({target}) within {} s: see SHOW SLAVE STATUS on it",
        CATCH_UP.as_secs()
    );
    replication::require_acks(id, &mut p_admin, !settings.mysql.allow_async).await?;
    // A primary a failover left alone stays read-only until now (the
    // metadata shard's among them: the map is written next).
    if server_state(id, &mut p_admin).await?.read_only {
        replication::set_read_only(id, &mut p_admin, false).await?;
    }
    topology::add_replica(shards.meta(), p.id, &address_of(dsn)).await?;
    Ok((p, how))
}

/// How a replica got the shard's data.
pub(crate) enum How {
    /// It replicated from the primary already.
    Replicating,
    /// A server with a history the primary holds, replicating again.
    Rejoined,
    /// A copy taken with `mariadb-dump`.
    Seeded,
    /// The primary's binary log, from the start.
    FromLog,
}

impl How {
    fn says(&self) -> &'static str {
        match self {
            How::Replicating => "it replicated already",
            How::Rejoined => "rejoined: it holds nothing the primary lacks",
            How::Seeded => "seeded from a copy",
            How::FromLog => "from the primary's binary log",
        }
    }
}

/// `shards replicas remove SHARD ADDRESS`.
pub async fn remove(settings: Settings, shard: &str, address: &str) -> anyhow::Result<()> {
    let shards = Shards::connect(&settings.mysql).await?;
    let result = remove_from(&shards, &settings, shard, address).await;
    shards.close().await;
    let stopped = result?;
    println!(
        "replica {address} of shard {shard} removed{}",
        if stopped {
            "; it no longer replicates"
        } else {
            " from the map (it did not answer: stop its replication by hand)"
        }
    );
    Ok(())
}

async fn remove_from(
    shards: &Shards,
    settings: &Settings,
    name: &str,
    address: &str,
) -> anyhow::Result<bool> {
    let p = shard_named(shards, name)?;
    let t = shards.topology();
    let Some(r) = t.replicas_of(p.id).find(|r| place_of(&r.address) == place_of(address)) else {
        let known: Vec<&str> = t.replicas_of(p.id).map(|r| r.address.as_str()).collect();
        bail!("shard {name} has no replica at {address} (its replicas: {known:?})");
    };
    let r_address = r.address.clone();
    let id = p.id as usize;
    if t.replicas_of(p.id).count() == 1 {
        // The last one: the primary stops waiting for acknowledgements
        // before its replica stops giving them.
        let primary = admin(settings, &shards.credentials_for(&p.address)?);
        let mut conn = connect(&primary, "the primary as mysql.admin_user").await?;
        replication::require_acks(id, &mut conn, false).await?;
    }
    topology::remove_replica(shards.meta(), p.id, &r_address).await?;
    let replica = admin(settings, &shards.credentials_for(&r_address)?);
    let Ok(mut conn) = connect(&replica, "the replica").await else { return Ok(false) };
    replication::stop_replicating(id, &mut conn).await?;
    Ok(true)
}

/// What `migrate` checks of every shard with replicas: each server is
/// what replication without loss needs (as `replicas add` checks), and
/// every server of a shard has its own `server_id`. Refuses, naming every
/// problem, when one is not; a replica that does not answer is only
/// reported (it is not serving, and `shards list` shows it down).
pub async fn check_cluster(shards: &Shards) -> anyhow::Result<()> {
    let t = shards.topology();
    let mut wrong = Vec::new();
    for p in &t.shards {
        let servers: Vec<(&str, Role)> = std::iter::once((p.address.as_str(), Role::Primary))
            .chain(t.replicas_of(p.id).map(|r| (r.address.as_str(), Role::Replica)))
            .collect();
        if servers.len() == 1 {
            continue; // No replicas: nothing replication needs.
        }
        let mut ids: Vec<(u32, &str)> = Vec::new();
        for (address, role) in servers {
            let dsn = shards.credentials_for(address)?;
            let Ok(mut conn) = connect(&dsn, address).await else {
                eprintln!("warning: {address} (shard {}) did not answer; not checked", p.name);
                continue;
            };
            let id = p.id as usize;
            wrong.extend(
                check_server(id, &mut conn, role).await?.into_iter().map(|w| format!("{address}: {w}")),
            );
            let server_id = server_state(id, &mut conn).await?.server_id;
            if let Some((_, other)) = ids.iter().find(|(s, _)| *s == server_id) {
                wrong.push(format!("{address}: server_id {server_id} is also {other}'s"));
            }
            ids.push((server_id, address));
        }
    }
    ensure!(
        wrong.is_empty(),
        "the replicated shards are not ready for replication without loss:\n  - {}",
        wrong.join("\n  - ")
    );
    Ok(())
}

async fn refuse_unless_ready(
    shard: usize,
    conn: &mut MySqlConnection,
    role: Role,
    what: &str,
) -> anyhow::Result<()> {
    let wrong = check_server(shard, conn, role).await?;
    ensure!(
        wrong.is_empty(),
        "{what} is not ready for replication without loss:\n  - {}",
        wrong.join("\n  - ")
    );
    Ok(())
}

/// Gives the replica the shard's data: nothing to do when the primary's
/// binary log holds its whole history (the replica replays it from the
/// start: None); otherwise a consistent copy of the shard's database taken
/// with `mariadb-dump --single-transaction --gtid`, loaded with the
/// replica's binary log off, and the position it was taken at.
async fn seed(
    shard: usize,
    settings: &Settings,
    primary: &Dsn,
    replica: &Dsn,
    p_admin: &mut MySqlConnection,
    r_admin: &mut MySqlConnection,
) -> anyhow::Result<Option<GtidPos>> {
    let db = split_database(primary).map(|(db, _)| db).unwrap_or_default();
    let tables = replication::tables_in(shard, r_admin, &db).await?;
    ensure!(tables == 0, "the replica holds tables in `{db}` already: give it an empty server");
    if replication::history_complete(shard, p_admin).await? {
        return Ok(None);
    }
    let file = std::env::temp_dir().join(format!("bagstore-seed-{}-{db}.sql", std::process::id()));
    let seeded = async {
        let from = dump(&admin(settings, primary), &db, &file).await?;
        load(&admin(settings, replica), &file).await?;
        Ok(Some(from))
    }
    .await;
    let _ = std::fs::remove_file(&file);
    seeded
}

/// The client tools' connection arguments for `dsn` and its password (as
/// `MYSQL_PWD`, out of the process list).
fn client_args(dsn: &Dsn) -> anyhow::Result<(Vec<String>, String)> {
    let o = storage::dsn::connect_options(dsn)?;
    let args = vec![
        format!("--host={}", o.get_host()),
        format!("--port={}", o.get_port()),
        format!("--user={}", o.get_username()),
    ];
    Ok((args, password_of(dsn.expose())))
}

/// The password in a DSN's user info, decoded (empty when none).
fn password_of(dsn: &str) -> String {
    let Some(rest) = dsn.split_once("://").map(|(_, r)| r) else { return String::new() };
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    let Some((userinfo, _)) = authority.rsplit_once('@') else { return String::new() };
    let Some((_, password)) = userinfo.split_once(':') else { return String::new() };
    let bytes = password.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Ok(b) = u8::from_str_radix(&password[i + 1..i + 3], 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn dump(primary: &Dsn, db: &str, file: &std::path::Path) -> anyhow::Result<GtidPos> {
    let (args, password) = client_args(primary)?;
    let out = std::fs::File::create(file)?;
    let status = tokio::process::Command::new("mariadb-dump")
        .args(&args)
        .args([
            "--single-transaction",
            "--gtid",
            "--master-data=2",
            "--hex-blob",
            "--triggers",
            "--databases",
            db,
        ])
        .env("MYSQL_PWD", password)
        .stdout(out)
        .stderr(Stdio::inherit())
        .status()
        .await
        .context("running mariadb-dump (Debian: apt-get install mariadb-client)")?;
    ensure!(status.success(), "mariadb-dump of the primary failed ({status})");
    let text = String::from_utf8_lossy(&std::fs::read(file)?).into_owned();
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("-- SET GLOBAL gtid_slave_pos='"))
        .context("the seed names no GTID position (mariadb-dump --gtid --master-data)")?;
    Ok(GtidPos::parse(line.trim_end_matches("';"))?)
}

async fn load(replica: &Dsn, file: &std::path::Path) -> anyhow::Result<()> {
    let (args, password) = client_args(replica)?;
    let status = tokio::process::Command::new("mariadb")
        .args(&args)
        .arg("--init-command=SET SESSION sql_log_bin = 0")
        .env("MYSQL_PWD", password)
        .stdin(std::fs::File::open(file)?)
        .stderr(Stdio::inherit())
        .status()
        .await
        .context("running the mariadb client (Debian: apt-get install mariadb-client)")?;
    ensure!(status.success(), "loading the seed into the replica failed ({status})");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_password_of_a_dsn_is_decoded_for_the_client_tools() {
        assert_eq!(password_of("mysql://u:p%40ss@h:3306/db"), "p@ss");
        assert_eq!(password_of("mysql://u@h/db"), "");
        assert_eq!(password_of("mysql://h/db"), "");
    }

    #[test]
    fn the_admin_account_replaces_the_dsns() {
        let mut s = Settings::default();
        let dsn = Dsn("mysql://bagstore:svc@127.0.0.1:3306/db".into());
        assert_eq!(admin(&s, &dsn).expose(), dsn.expose());
        s.mysql.admin_user = "root".into();
        assert_eq!(admin(&s, &dsn).expose(), "mysql://root@127.0.0.1:3306/db");
        s.mysql.admin_password = schemas::settings::Secret("a b".into());
        assert_eq!(admin(&s, &dsn).expose(), "mysql://root:a%20b@127.0.0.1:3306/db");
    }
}
