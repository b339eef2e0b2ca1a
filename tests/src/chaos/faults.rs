//! The stack of processes and the faults injected into it.

use super::*;

/// The processes of the stack under test.
pub(super) struct Stack {
    pub(super) writers: Vec<Option<Proc>>,
    pub(super) indexers: Vec<Option<Proc>>,
    pub(super) reader: Proc,
    pub(super) cleaner: Option<Proc>,
    /// The `bagstore shards …` command running in the background.
    pub(super) mover: Option<BackgroundMove>,
    pub(super) moves: MoveLog,
}

/// A `bagstore shards …` command left running while the next faults land.
pub(super) struct BackgroundMove {
    what: String,
    child: tokio::process::Child,
    /// Where its stderr goes.
    log: std::path::PathBuf,
}

/// What the move faults did, for the report.
#[derive(Debug, Default)]
pub(super) struct MoveLog {
    pub(super) started: usize,
    pub(super) killed_mid_copy: usize,
    pub(super) killed_mid_cutover: usize,
    /// The commands' `move N done: …` lines.
    pub(super) done: Vec<String>,
}

impl MoveLog {
    /// `rows/s` and `writes paused N ms` of every finished move.
    pub(super) fn summary(&self) -> String {
        let field = |line: &str, before: &str, after: &str| -> Option<f64> {
            let end = line.find(after)?;
            let start = line[..end].rfind(before)? + before.len();
            line[start..end].trim().parse().ok()
        };
        let rates: Vec<String> =
            self.done.iter().filter_map(|l| field(l, "(", " rows/s")).map(|r| format!("{r:.0}")).collect();
        let mut pauses: Vec<f64> =
            self.done.iter().filter_map(|l| field(l, "writes paused", " ms")).collect();
        pauses.sort_by(f64::total_cmp);
        format!(
            "moves: {} started ({} killed mid-copy, {} killed mid-cutover, each resumed), {} finished by a command; \
             rows/s {:?}; cutover pauses (ms) {:?}",
            self.started,
            self.killed_mid_copy,
            self.killed_mid_cutover,
            self.done.len(),
            rates,
            pauses
        )
    }
}

/// Starts `bagstore shards <args…>` (with the env's config) in the background.
/// Its log (stderr, at info) goes to `shards-<n>.log` in the test's
/// directory, kept with the others when the run fails.
fn spawn_shards_command(env: &TestEnv, args: &[&str], vars: &[(&str, &str)]) -> BackgroundMove {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let log = env.dir.path().join(format!("shards-{}.log", N.fetch_add(1, Ordering::Relaxed)));
    let file = std::fs::File::create(&log).expect("shards command log");
    let mut all = vec!["shards"];
    all.extend_from_slice(args);
    let child = crate::command(crate::bagstore_bin())
        .args(env.args(&all))
        .envs(vars.iter().copied())
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .stderr(file)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn bagstore shards");
    BackgroundMove { what: args.join(" "), child, log }
}

/// Waits for the background move command, keeps its `done` lines; a
/// command that fails is a failure of the run.
pub(super) async fn wait_background_move(stack: &mut Stack, shared: &Shared) {
    let Some(m) = stack.mover.take() else { return };
    match tokio::time::timeout(Duration::from_secs(300), m.child.wait_with_output()).await {
        Ok(Ok(out)) => {
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            stack.moves.done.extend(text.lines().filter(|l| l.contains(" done: ")).map(str::to_string));
            if !out.status.success() {
                // Its error (and progress) is in its log; the end says why.
                let err = std::fs::read_to_string(&m.log).unwrap_or_default();
                let tail: String =
                    err.chars().rev().take(2000).collect::<Vec<_>>().into_iter().rev().collect();
                shared.fail(format!("`bagstore shards {}` failed: {text}\n{tail}", m.what));
            }
        }
        Ok(Err(e)) => shared.fail(format!("`bagstore shards {}`: {e}", m.what)),
        Err(_) => shared.fail(format!("`bagstore shards {}` did not finish within 300 s", m.what)),
    }
}

/// Finishes every move: the background command, then `shards resume`,
/// then checks that nothing is in flight.
pub(super) async fn finish_moves(env: &TestEnv, stack: &mut Stack, shared: &Shared) {
    if stack.moves.started == 0 {
        return;
    }
    wait_background_move(stack, shared).await;
    stack.mover = Some(spawn_shards_command(env, &["resume"], &[]));
    wait_background_move(stack, shared).await;
    let meta = env.pool(0).await;
    let (left,): (i64,) =
        sqlx::query_as("SELECT COUNT(*) FROM bagstore_moves WHERE phase NOT IN ('done', 'rolled_back')")
            .fetch_one(&meta)
            .await
            .expect("moves");
    if left > 0 {
        shared.fail(format!("{left} moves still in flight after `shards resume`"));
    }
}

/// A random range of 64 to 256 logical shards.
fn random_range(rng: &mut StdRng) -> String {
    let len = rng.random_range(64..=256u16);
    let start = rng.random_range(0..4096 - len);
    format!("{start}-{}", start + len - 1)
}

/// A range of logical shards around the logical shard of one of the
/// load's keys (written from the start), and a shard that does not own it.
async fn range_with_rows(meta: &sqlx::MySqlPool, rng: &mut StdRng, keys: usize) -> (String, &'static str) {
    let id = u128::from_str_radix(&entity_id(rng.random_range(0..keys)), 16).expect("hex id");
    let logical = schemas::logical_of(&id.to_be_bytes(), 4096);
    let (owner,): (u32,) = sqlx::query_as("SELECT physical FROM bagstore_map WHERE logical = ?")
        .bind(logical)
        .fetch_one(meta)
        .await
        .expect("the map has every logical shard");
    let others: Vec<&'static str> = ["s0", "s1", "s2"]
        .into_iter()
        .enumerate()
        .filter(|(i, _)| *i as u32 != owner)
        .map(|(_, n)| n)
        .collect();
    let len = rng.random_range(64..=256u16);
    let start = logical.saturating_sub(rng.random_range(0..len)).min(4096 - len);
    (format!("{start}-{}", start + len - 1), others[rng.random_range(0..others.len())])
}

/// Polls the metadata shard until `ready` holds (up to 60 s).
async fn until_move(meta: &sqlx::MySqlPool, sql: &str) -> bool {
    for _ in 0..1200 {
        let row: Option<(u64,)> = sqlx::query_as(sql).fetch_optional(meta).await.unwrap_or(None);
        if row.is_some() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// A cleaner's settings: sweeping every 200 ms; with replicas, also the
/// accounts its failover coordinator needs and a failover after 1 s
/// without an answer.
pub(super) fn cleaner_env(replicated: bool) -> Vec<(&'static str, &'static str)> {
    let mut env = vec![("BAGSTORE_CLEANER__INTERVAL_MS", "200")];
    if replicated {
        env.extend(crate::replicated::ADMIN_ENV);
        env.push(("BAGSTORE_MYSQL__FAILOVER_AFTER_MS", "1000"));
    }
    env
}

/// Root sessions on each physical shard's primary (the `KILL` and `LOCK
/// TABLES` of the faults), and the run's own servers when it has them.
pub(super) struct Servers {
    pub(super) admin: Vec<sqlx::MySqlPool>,
    pub(super) cluster: Option<crate::replicated::Cluster>,
    /// Per failover: the shard, ms from the kill to the map naming the new
    /// primary, and to the dead server taken back as a replica.
    pub(super) failovers: Vec<(usize, u128, u128)>,
}

impl Servers {
    pub(super) async fn connect(env: &TestEnv, cluster: Option<crate::replicated::Cluster>) -> Servers {
        let mut servers = Servers { admin: Vec::new(), cluster, failovers: Vec::new() };
        servers.reconnect(env).await;
        servers
    }

    /// Root sessions on the primaries `env` names now.
    async fn reconnect(&mut self, env: &TestEnv) {
        let mut admin = Vec::new();
        for dsn in &env.dsns {
            let (root, _) = dsn.rsplit_once('/').expect("a DSN with a database");
            // Private servers: root, not the services' account.
            let root = root.replace(&format!("{}@", devstack::replication::SERVICE_USER), "root@");
            admin.push(sqlx::MySqlPool::connect(&format!("{root}/")).await.expect("admin session"));
        }
        for old in std::mem::replace(&mut self.admin, admin) {
            old.close().await;
        }
    }

    /// Each failover's timings, for the report.
    pub(super) fn summary(&self) -> String {
        let mut maps: Vec<u128> = self.failovers.iter().map(|f| f.1).collect();
        let mut backs: Vec<u128> = self.failovers.iter().map(|f| f.2).collect();
        maps.sort();
        backs.sort();
        let each: Vec<String> = self
            .failovers
            .iter()
            .map(|(s, m, b)| format!("s{s}: new primary {m} ms, writes back {b} ms"))
            .collect();
        format!(
            "failovers: {} ({}); ms from the kill to the new primary in the map: median {:?}, max {:?}; to writes \
             taken again (the dead server back as the replica that acknowledges them): median {:?}, max {:?}",
            self.failovers.len(),
            each.join("; "),
            maps.get(maps.len() / 2),
            maps.last(),
            backs.get(backs.len() / 2),
            backs.last()
        )
    }
}

/// New entities created while a stalled indexer is about to be killed.
const BURST: usize = 40;

/// Waits until the outboxes are empty and no index group has events left
/// to apply (the writing clients are paused), for at most 15 s: a quiet
/// start for the stalled `IndexerKill`. Lag that stays (a group still
/// rebalancing) only makes that fault's batch less certain to hold the
/// burst; it goes on anyway.
async fn until_indexers_idle(env: &TestEnv) {
    let since = Instant::now();
    while since.elapsed() < Duration::from_secs(15) && !env.caught_up(&STANDARD_TABLES).await {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Partitions each live indexer reports owning, per index group.
pub(super) async fn assignments(indexers: &[Option<Proc>]) -> HashMap<&'static str, Vec<f64>> {
    let mut per_index: HashMap<&str, Vec<f64>> = HashMap::new();
    for p in indexers.iter().flatten() {
        let m = p.api().metrics().await;
        for t in STANDARD_TABLES {
            per_index.entry(t).or_default().push(metric_sum(
                &m,
                "bagstore_indexer_assigned_partitions",
                &[("index", t)],
            ));
        }
    }
    per_index
}

/// How the index groups are spread over the live indexers.
#[derive(Debug, PartialEq)]
pub(super) enum Spread {
    /// Every partition owned once, every live indexer owning part of each
    /// group: a new member has really joined (a sum alone could be met by
    /// the survivor before the newcomer's lease has even been read).
    Settled,
    /// Every partition owned and every live indexer owning some, but some
    /// partitions claimed twice. Momentarily normal (the processes are
    /// asked one after the other); lasting, a failure.
    Overlap,
    Unsettled,
}

pub(super) fn spread(per_index: &HashMap<&str, Vec<f64>>) -> Spread {
    let mut overlap = false;
    for t in STANDARD_TABLES {
        let owned = &per_index[t];
        let sum = owned.iter().sum::<f64>();
        if sum < PARTITIONS as f64 || owned.contains(&0.0) {
            return Spread::Unsettled;
        }
        overlap |= sum > PARTITIONS as f64;
    }
    if overlap {
        Spread::Overlap
    } else {
        Spread::Settled
    }
}

/// How long an overlap must last before the wait takes it as the group's
/// state: a lease's length (6 s), the members' next reads of the lease
/// list, and an indexer noticing a newer claim on its partitions (within a
/// second while idle), with room to spare.
pub(super) const OVERLAP_FOR: Duration = Duration::from_secs(20);

/// Waits until the groups are [`Spread::Settled`]: at once for a member
/// restarted under its name, within the dead member's lease (6 s) and a
/// read of the list otherwise. On timeout the message says which group was
/// stuck, and how.
///
/// An overlap that lasts [`OVERLAP_FOR`] (an indexer holding partitions
/// the leases gave to another, e.g. `"index_user_id": [2.0, 4.0]`; see
/// `service::claims`) is returned, and the caller counts it as a
/// failure; the run goes on to its report.
pub(super) async fn until_group_owns_everything(env: &TestEnv, indexers: &[Option<Proc>]) -> Option<String> {
    let deadline = Duration::from_secs(150);
    let until = Instant::now() + deadline;
    let mut overlap_since: Option<Instant> = None;
    loop {
        check_broker(env).await;
        let now = assignments(indexers).await;
        match spread(&now) {
            Spread::Settled => return None,
            Spread::Overlap => {
                if overlap_since.get_or_insert_with(Instant::now).elapsed() >= OVERLAP_FOR {
                    return Some(format!("partitions claimed twice for {OVERLAP_FOR:?}: {now:?}"));
                }
            }
            Spread::Unsettled => overlap_since = None,
        }
        if Instant::now() >= until {
            panic!(
                "timed out after {deadline:?} waiting for every index group to be spread over the \
                 live indexers, each partition owned; partitions per indexer: {now:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Checks that a tansu broker has not broken on its own (see
/// `Tansu::check`): a crash is recorded, and fails the run at the end; the
/// broker is started again so that the run reaches its report. A no-op on
/// the mock cluster.
pub(super) async fn check_broker(env: &TestEnv) {
    if let Some(t) = env.kafka.tansu() {
        if let Some(why) = t.check().await.expect("tansu restarts") {
            eprintln!("chaos: FAILURE: the broker crashed on its own: {why}");
        }
    }
}

/// The connection ids of this test's databases on `dsn`'s server.
pub(super) async fn stack_connections(pool: &sqlx::MySqlPool, databases: &[String]) -> Vec<u64> {
    let mut ids = Vec::new();
    for db in databases {
        let rows: Vec<(u64,)> = sqlx::query_as(
            "SELECT CAST(ID AS UNSIGNED) FROM information_schema.PROCESSLIST WHERE DB = ? AND ID <> CONNECTION_ID()",
        )
        .bind(db)
        .fetch_all(pool)
        .await
        .unwrap_or_default();
        ids.extend(rows.into_iter().map(|r| r.0));
    }
    ids
}

/// Starts the next move fault (see [`Fault::Move`]); the command keeps
/// running in the background.
async fn inject_move(
    env: &TestEnv,
    stack: &mut Stack,
    shared: &Shared,
    rng: &mut StdRng,
    keys: usize,
) -> String {
    wait_background_move(stack, shared).await;
    let n = stack.moves.started;
    stack.moves.started += 1;
    let names = ["s0", "s1", "s2"];
    let mut to = names[rng.random_range(0..names.len())];
    let mut range = random_range(rng);
    let meta = env.pool(0).await;
    if n % 4 == 1 || n % 4 == 2 {
        // The killed moves must have rows to copy and a cutover to reach:
        // a range around the logical shard of one of the load's entities,
        // to a shard that does not own it.
        (range, to) = range_with_rows(&meta, rng, keys).await;
    }
    let newest =
        "SELECT id FROM bagstore_moves WHERE phase = 'copy' AND rows_copied > 0 ORDER BY id DESC LIMIT 1";
    let in_cutover = "SELECT id FROM bagstore_moves WHERE phase = 'cutover' ORDER BY id DESC LIMIT 1";
    let (what, detail) = match n % 4 {
        0 => (vec!["rebalance"], "a rebalance over s0, s1, s2 started".to_string()),
        1 => {
            let mut m = spawn_shards_command(
                env,
                &["move", "--logical", &range, "--to", to],
                &[("BAGSTORE_MOVER__RATE", "300"), ("BAGSTORE_MOVER__BATCH", "50")],
            );
            let copying = until_move(&meta, newest).await;
            m.child.kill().await.ok();
            stack.moves.killed_mid_copy += usize::from(copying);
            (vec!["resume"], format!("a move of {range} to {to} killed -9 mid-copy ({copying}); resuming"))
        }
        2 => {
            let mut m = spawn_shards_command(
                env,
                &["move", "--logical", &range, "--to", to],
                &[("BAGSTORE_MOVER__DRILL_HOLD_MS", "1500")],
            );
            let cutting = until_move(&meta, in_cutover).await;
            // Somewhere in the fence or between the release and the flip.
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..3000))).await;
            m.child.kill().await.ok();
            stack.moves.killed_mid_cutover += usize::from(cutting);
            (vec!["resume"], format!("a move of {range} to {to} killed -9 mid-cutover ({cutting}); resuming"))
        }
        _ => (vec!["move", "--logical", &range, "--to", to], format!("a move of {range} to {to} started")),
    };
    stack.mover = Some(spawn_shards_command(env, &what, &[]));
    detail
}

/// Indexer `i` of the stack, all indexes. Its member name is its slot's,
/// so a killed indexer started again comes back as the same member, as a
/// restarted container in its pod does.
pub(super) async fn indexer(env: &TestEnv, i: usize) -> Proc {
    let member = format!("indexer-{i}");
    env.spawn_env(&["indexer"], &[("BAGSTORE_INDEXER__MEMBER", member.as_str())]).await
}

/// Injects `fault`, heals it, and says what it did.
pub(super) async fn inject(
    fault: Fault,
    env: &mut TestEnv,
    stack: &mut Stack,
    shared: &Shared,
    rng: &mut StdRng,
    servers: &mut Servers,
    keys: usize,
) -> String {
    let admin = &servers.admin;
    match fault {
        Fault::IndexerKill => {
            let i = rng.random_range(0..stack.indexers.len());
            let p = stack.indexers[i].take().expect("indexer alive between faults");
            let pid = p.pid();
            // Mostly the indexer dies while its index writes on one
            // shard are stalled behind a table lock: the kill then lands
            // mid-batch, after the events were read and before MySQL
            // committed them, the moment offsets must not have been stored.
            // The writing clients pause until the indexers are idle, and a
            // burst of new entities (never written again) follows the lock:
            // the stalled batch then holds events whose loss no later write
            // would repair, so an indexer that committed their offsets
            // before their rows leaves rows missing for good (before the
            // burst, later writes of the same ids often hid the loss).
            let stall = rng.random_bool(0.7).then(|| rng.random_range(0..admin.len()));
            let mut lock = None;
            let mut burst = 0;
            if let Some(shard) = stall {
                shared.paused.store(true, Ordering::Relaxed);
                until_indexers_idle(env).await;
                let db = env.dsns[shard].rsplit('/').next().unwrap().to_string();
                let mut conn = admin[shard].acquire().await.expect("admin connection");
                let tables: Vec<String> =
                    STANDARD_TABLES.iter().map(|t| format!("`{db}`.`{t}` WRITE")).collect();
                sqlx::query(&format!("LOCK TABLES {}", tables.join(", ")))
                    .execute(&mut *conn)
                    .await
                    .expect("lock");
                burst = load::burst_of_creates(shared, rng, BURST).await;
                tokio::time::sleep(Duration::from_millis(rng.random_range(800..1500))).await;
                lock = Some(conn);
            }
            p.kill9().await;
            if let Some(mut conn) = lock {
                sqlx::query("UNLOCK TABLES").execute(&mut *conn).await.expect("unlock");
            }
            shared.paused.store(false, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(rng.random_range(100..1000))).await;
            stack.indexers[i] = Some(indexer(env, i).await);
            let t = Instant::now();
            let overlap = until_group_owns_everything(env, &stack.indexers).await;
            let during = stall.map_or(String::new(), |s| {
                format!(" while its writes on shard {s} were stalled by LOCK TABLES (a burst of {burst} creates acknowledged meanwhile)")
            });
            let rebalanced = match overlap {
                None => format!(
                    "partitions spread over the live indexers again in {} ms",
                    t.elapsed().as_millis()
                ),
                Some(o) => {
                    shared.counters.overlaps.fetch_add(1, Ordering::Relaxed);
                    shared.fail(format!("after indexer {i} was restarted, {o}"));
                    format!("FAILURE, {o}")
                }
            };
            format!("indexer {i} (pid {pid}) killed{during}; restarted; {rebalanced}")
        }
        Fault::WriterKill => {
            let i = rng.random_range(0..stack.writers.len());
            shared.writers.write().unwrap()[i] = None;
            let p = stack.writers[i].take().expect("writer alive between faults");
            let pid = p.pid();
            p.kill9().await;
            // The survivor must lead the relay of every shard.
            let other = stack.writers[1 - i].as_ref().expect("the other writer").api();
            let t = Instant::now();
            eventually(
                "the surviving writer to lead every shard's relay",
                Duration::from_secs(30),
                || async {
                    let m = other.metrics().await;
                    (metric_sum(&m, "bagstore_writer_relay_leader", &[]) == env.dsns.len() as f64)
                        .then_some(())
                },
            )
            .await;
            let moved = t.elapsed().as_millis();
            let p = env.spawn(&["writer"]).await;
            shared.writers.write().unwrap()[i] = Some(p.url.clone());
            stack.writers[i] = Some(p);
            format!("writer {i} (pid {pid}) killed; relay leadership moved in {moved} ms; restarted")
        }
        Fault::BrokerOutage => {
            let hold = rng.random_range(1000..3000);
            env.kafka.broker_down(1).expect("broker down");
            tokio::time::sleep(Duration::from_millis(hold)).await;
            env.kafka.broker_up(1).expect("broker up");
            format!("mock broker down for {hold} ms")
        }
        Fault::BrokerKill => {
            let tansu = env.kafka.tansu().expect("a tansu broker");
            let hold = rng.random_range(300..2000);
            tansu.kill9();
            tokio::time::sleep(Duration::from_millis(hold)).await;
            let t = Instant::now();
            tansu.restart().await.expect("tansu restarts");
            format!("tansu killed -9, down {hold} ms, restarted in {} ms", t.elapsed().as_millis())
        }
        Fault::MysqlKill => {
            let shard = rng.random_range(0..admin.len());
            let dbs: Vec<String> =
                env.dsns.iter().map(|d| d.rsplit('/').next().unwrap().to_string()).collect();
            let mut ids = stack_connections(&admin[shard], &dbs).await;
            ids.shuffle(rng);
            let mut killed = 0;
            for id in ids.iter().take(3) {
                if sqlx::query(&format!("KILL {id}")).execute(&admin[shard]).await.is_ok() {
                    killed += 1;
                }
            }
            format!("KILL of {killed} of {} connections on shard {shard}", ids.len())
        }
        Fault::Move => inject_move(env, stack, shared, rng, keys).await,
        Fault::Failover => inject_failover(env, shared, rng, servers).await,
    }
}

/// Each physical shard's primary as the newest map among the metadata
/// shard's live servers names it (read directly, so the timings are the
/// coordinator's, not a command's); `None` while none answers.
async fn primaries(env: &TestEnv, cluster: &crate::replicated::Cluster) -> Option<Vec<String>> {
    let mut newest: Option<(u64, Vec<String>)> = None;
    for m in cluster.shards[0].iter().filter(|m| m.server.is_some()) {
        let dsn = format!("mysql://root@127.0.0.1:{}/{}_s0", m.port, env.name);
        let Ok(mut conn) = <sqlx::MySqlConnection as sqlx::Connection>::connect(&dsn).await else { continue };
        let epoch = sqlx::query_as::<_, (u64,)>("SELECT epoch FROM bagstore_cluster WHERE id = 1")
            .fetch_one(&mut conn);
        let Ok((epoch,)) = epoch.await else { continue };
        let rows = sqlx::query_as::<_, (String,)>("SELECT address FROM bagstore_physical ORDER BY id")
            .fetch_all(&mut conn);
        let Ok(rows) = rows.await else { continue };
        if newest.as_ref().is_none_or(|(e, _)| epoch > *e) {
            newest = Some((epoch, rows.into_iter().map(|r| r.0).collect()));
        }
    }
    newest.map(|(_, addresses)| addresses)
}

/// Whether `shards list` shows `address` as an online replica of shard
/// number `shard`.
async fn online_replica(env: &TestEnv, shard: usize, address: &str) -> bool {
    let (ok, out, _) = env.run(&env.args(&["shards", "list", "--json"]), &[]).await;
    let Ok(doc) = serde_json::from_str::<Value>(&out) else { return false };
    let name = format!("s{shard}");
    ok && doc["shards"].as_array().into_iter().flatten().filter(|s| s["name"] == name.as_str()).any(|s| {
        s["servers"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|r| r["address"] == address && r["role"] == "replica" && r["state"] == "online")
    })
}

/// See [`Fault::Failover`]: one shard's primary killed with `kill -9`
/// (any shard, the metadata shard's included); nothing is run by hand.
/// The coordinator of the (restarted) cleaner fails it over; the run then
/// follows the map to the new primary, restarts the dead server where it
/// was, as a replica, and waits for the coordinator to take it back (until
/// then the new primary, alone, refuses writes).
async fn inject_failover(
    env: &mut TestEnv,
    shared: &Shared,
    rng: &mut StdRng,
    servers: &mut Servers,
) -> String {
    let cluster = servers.cluster.as_mut().expect("failovers run on the run's own servers");
    let shard = rng.random_range(0..cluster.shards.len());
    let before =
        eventually("the map to answer", Duration::from_secs(30), || primaries(&*env, &*cluster)).await;
    let old = before[shard].clone();
    let victim = cluster.member_at(shard, &old).expect("the primary is a member");
    let pid = cluster.kill_9(shard, victim);
    let killed = Instant::now();
    let after =
        eventually("the coordinator to fail the killed primary over", Duration::from_secs(60), || async {
            primaries(&*env, &*cluster).await.filter(|now| now[shard] != old)
        })
        .await;
    let to_map = killed.elapsed().as_millis();
    cluster.refresh(env, &after);
    *shared.primaries.write().unwrap() = env.dsns.clone();
    // Down a while longer, as a server being looked at would be.
    tokio::time::sleep(Duration::from_millis(rng.random_range(0..1500))).await;
    // A server whose recovery cannot take its unacknowledged tail back
    // does not start; it is re-seeded, as an operator would.
    let reseeded = match cluster.restart_as_replica(shard, victim).await {
        Ok(()) => false,
        Err(refusal) if crate::replicated::cannot_truncate(&refusal) => {
            cluster.reseed(env, shard, victim).await;
            true
        }
        Err(refusal) => panic!("restarting the dead primary as a replica: {refusal:#}"),
    };
    eventually("the coordinator to take the dead server back", Duration::from_secs(60), || async {
        online_replica(&*env, shard, &old).await.then_some(())
    })
    .await;
    let back = killed.elapsed().as_millis();
    servers.reconnect(env).await;
    servers.failovers.push((shard, to_map, back));
    let how = if reseeded {
        "refused to start (its recovery could not truncate the unacknowledged tail), re-seeded as a replica"
    } else {
        "restarted as a replica and taken back"
    };
    format!(
        "s{shard}'s primary {old} (pid {pid}) killed -9; the map named {} after {to_map} ms; {how} \
         (writes taken again) after {back} ms",
        after[shard]
    )
}
