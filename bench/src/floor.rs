//! The floors of a write in bagstore's design (issue 20, target 1): the
//! rows the design has to write per entity, written by a plain client with
//! none of bagstore's own statements (no ownership check, no locking read,
//! no relay reading the events back), and once more with the write's two
//! reads (issue 35). What a floor costs MariaDB beyond raw is what the
//! design costs; what bagstore costs beyond it is what its implementation
//! adds.
//!
//! - [`Floor::Capture`]: the entity row, and its index row written in
//!   multi-row inserts of up to [`BATCH`] rows by a background task, as an
//!   indexer does. This is all a design that captured changes from the
//!   binary log (no outbox) would still write; and a binlog reader per
//!   server (`mariadb-binlog --read-from-remote-server --stop-never`, the
//!   replication protocol Debezium uses) streams the binary log meanwhile,
//!   so the server's side of the capture (its dump thread) is counted.
//! - [`Floor::Outbox`]: the same, and the change event inserted into an
//!   outbox in the entity's transaction, deleted afterwards in ranges of
//!   [`BATCH`] (the cheapest delete: no read of the events).
//! - [`Floor::Reads`]: the outbox floor, and the two reads that open each
//!   of bagstore's write transactions, by bagstore's own functions: the
//!   proof that the shard owns the written logical shards
//!   (`storage::topology::check_owned`, DESIGN §3 and §11) and the locking
//!   read of the entity rows (`storage::entities::lock_entities`, §4).
//!   What bagstore costs beyond this floor is its implementation: group
//!   commit's batching, the relay reading the events back, the indexer.
//!
//! The index rows are bagstore's (`storage::ddl::index_table` of the main
//! index's spec), on the shard of their `user_id`, as bagstore places them.

use schemas::event::{ChangeEvent, Op};
use schemas::index::{IndexProperty, IndexSpec, PropType};
use schemas::EntityId;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

use crate::{
    body_of, entity, entity_id, hex16, shard_of_hex, user_id, Native, BATCH, RAW_HEAD, RAW_ROW, SHARDS, USERS,
};

const TABLE: &str = "floor_index";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Floor {
    Capture,
    Outbox,
    Reads,
}

impl Floor {
    /// Whether the floor reads its events back from the binary log (and
    /// so runs [`BinlogReaders`] while it writes).
    pub fn streams_binlog(self) -> bool {
        matches!(self, Floor::Capture)
    }

    /// Whether the floor writes (and later deletes) outbox rows.
    fn has_outbox(self) -> bool {
        matches!(self, Floor::Outbox | Floor::Reads)
    }
}

/// One index row: `(user_id, published, entity_id, logical)`.
type IndexRow = ([u8; 16], i64, [u8; 16], u16);

/// The background writers of a floor's deferred rows (index rows, outbox
/// deletes), and how many rows they have yet to write.
pub struct Deferred {
    index: Vec<mpsc::UnboundedSender<IndexRow>>,
    /// Index rows sent and not yet inserted, plus outbox rows inserted and
    /// not yet deleted.
    pending: Arc<AtomicI64>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

/// Creates the floor's tables in every server's `bench_native`, the
/// ownership table owning every logical shard.
pub async fn create_tables(native: &Native) -> anyhow::Result<()> {
    let spec = IndexSpec {
        table: TABLE.into(),
        properties: vec![
            IndexProperty { name: "user_id".into(), ty: PropType::Uuid, max_len: None },
            IndexProperty { name: "published".into(), ty: PropType::Int, max_len: None },
        ],
        shard_on: None,
        match_on: Default::default(),
        unique: false,
    };
    for pool in &native.pools {
        sqlx::query(&storage::ddl::index_table(&spec)).execute(pool).await?;
        sqlx::query(&storage::ddl::outbox()).execute(pool).await?;
        sqlx::query(&storage::ddl::owned()).execute(pool).await?;
        let logicals = schemas::shard::DEFAULT_LOGICAL_SHARDS;
        let own = format!(
            "INSERT IGNORE INTO bagstore_owned (logical) VALUES {}",
            vec!["(?)"; logicals as usize].join(", ")
        );
        let mut q = sqlx::query(&own);
        for logical in 0..logicals {
            q = q.bind(logical);
        }
        q.execute(pool).await?;
    }
    Ok(())
}

impl Deferred {
    /// Starts the index row writers (one per shard) and, for the floors
    /// with an outbox, the outbox deleters.
    pub fn start(native: Arc<Native>, floor: Floor) -> Deferred {
        let pending = Arc::new(AtomicI64::new(0));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut index = Vec::new();
        let mut tasks = Vec::new();
        for shard in 0..SHARDS {
            let (tx, rx) = mpsc::unbounded_channel();
            index.push(tx);
            tasks.push(tokio::spawn(write_index_rows(native.clone(), shard, rx, pending.clone())));
            if floor.has_outbox() {
                tasks.push(tokio::spawn(delete_outbox(native.clone(), shard, pending.clone(), stop.clone())));
            }
        }
        Deferred { index, pending, stop, tasks }
    }

    /// Waits until every deferred row is written, then stops the tasks.
    pub async fn finish(self) -> anyhow::Result<()> {
        let since = Instant::now();
        while self.pending.load(Ordering::SeqCst) > 0 {
            anyhow::ensure!(
                since.elapsed() < Duration::from_secs(600),
                "the floor's deferred rows did not drain"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.stop.store(true, Ordering::SeqCst);
        drop(self.index);
        for t in self.tasks {
            t.await??;
        }
        Ok(())
    }
}

/// One `mariadb-binlog` per server, streaming its binary log from the
/// current position into files in `dir` until stopped.
pub struct BinlogReaders {
    children: Vec<std::process::Child>,
    files: Vec<std::path::PathBuf>,
}

impl BinlogReaders {
    /// `cores`: where the readers run (`taskset -c`), off the servers' core.
    pub async fn start(
        native: &Native,
        ports: &[u16],
        dir: &std::path::Path,
        cores: &str,
    ) -> anyhow::Result<BinlogReaders> {
        let mut children = Vec::new();
        let mut files = Vec::new();
        for (i, (pool, port)) in native.pools.iter().zip(ports).enumerate() {
            let row = sqlx::query("SHOW MASTER STATUS").fetch_one(pool).await?;
            let file: String = sqlx::Row::try_get(&row, "File")?;
            let pos: u64 = sqlx::Row::try_get(&row, "Position")?;
            let prefix = dir.join(format!("captured-{i}-"));
            files.push(dir.join(format!("captured-{i}-{file}")));
            let child = bagstore_tests::std_command("taskset")
                .args(["-c", cores, "mariadb-binlog", "--no-defaults"])
                .args([
                    "--read-from-remote-server",
                    "--raw",
                    "--stop-never",
                    "--host=127.0.0.1",
                    "--user=root",
                ])
                .arg(format!("--port={port}"))
                .arg(format!("--stop-never-slave-server-id={}", 1000 + i))
                .arg(format!("--start-position={pos}"))
                .arg(format!("--result-file={}", prefix.display()))
                .arg(&file)
                .stdout(std::process::Stdio::null())
                .spawn()
                .map_err(|e| anyhow::anyhow!("starting taskset mariadb-binlog: {e}"))?;
            children.push(child);
        }
        Ok(BinlogReaders { children, files })
    }

    /// Stops the readers; fails if one of them streamed nothing (so the
    /// floor cannot count a capture that did not run).
    pub fn stop(mut self) -> anyhow::Result<u64> {
        for c in &mut self.children {
            anyhow::ensure!(c.try_wait()?.is_none(), "a binlog reader exited during the phase");
            c.kill()?;
            c.wait()?;
        }
        let mut bytes = 0;
        for f in &self.files {
            let len = std::fs::metadata(f).map(|m| m.len()).unwrap_or(0);
            anyhow::ensure!(len > 4, "the binlog reader wrote nothing to {}", f.display());
            bytes += len;
        }
        Ok(bytes)
    }
}

/// Writes entities `items` as the floor does: the entity rows (one
/// statement per shard, or one transaction with the outbox rows, opened by
/// bagstore's two reads for [`Floor::Reads`]), then hands their index rows
/// to the background writers.
pub async fn write(
    native: Arc<Native>,
    deferred: &Deferred,
    floor: Floor,
    items: Vec<u64>,
) -> anyhow::Result<()> {
    let mut per: Vec<Vec<u64>> = vec![Vec::new(); SHARDS];
    for i in &items {
        per[shard_of_hex(&entity_id(*i))].push(*i);
    }
    let jobs = per.into_iter().enumerate().filter(|(_, v)| !v.is_empty()).map(|(shard, rows)| {
        let native = native.clone();
        let pending = deferred.pending.clone();
        async move {
            let ids: Vec<[u8; 16]> = rows.iter().map(|i| hex16(&entity_id(*i))).collect();
            let bodies: Vec<Vec<u8>> = rows.iter().map(|i| body_of(*i)).collect();
            let sql = format!("{RAW_HEAD} {}", vec![RAW_ROW; rows.len()].join(", "));
            let mut q = sqlx::query(&sql);
            for (id, body) in ids.iter().zip(&bodies) {
                let logical = schemas::logical_of(id, schemas::shard::DEFAULT_LOGICAL_SHARDS);
                q = q.bind(id.to_vec()).bind(logical).bind(&body[..]);
            }
            let mut taken = native.conns[shard].take().await?;
            match floor {
                Floor::Capture => {
                    q.execute(&mut taken.conn).await?;
                }
                Floor::Outbox | Floor::Reads => {
                    let events: Vec<Vec<u8>> = rows.iter().map(|i| event(*i, shard)).collect();
                    let outbox = format!(
                        "INSERT INTO outbox (entity_id, version, committed, event) VALUES {}",
                        vec!["(?, 1, NOW(6), ?)"; rows.len()].join(", ")
                    );
                    let mut o = sqlx::query(&outbox);
                    for (id, e) in ids.iter().zip(&events) {
                        o = o.bind(id.to_vec()).bind(&e[..]);
                    }
                    sqlx::query("BEGIN").execute(&mut taken.conn).await?;
                    if floor == Floor::Reads {
                        let logicals: Vec<u16> = ids
                            .iter()
                            .map(|id| schemas::logical_of(id, schemas::shard::DEFAULT_LOGICAL_SHARDS))
                            .collect();
                        let ids: Vec<EntityId> = ids.iter().map(|id| EntityId(*id)).collect();
                        storage::topology::check_owned(shard, &mut taken.conn, &logicals).await?;
                        storage::entities::lock_entities(shard, &mut taken.conn, &ids).await?;
                    }
                    q.execute(&mut taken.conn).await?;
                    o.execute(&mut taken.conn).await?;
                    sqlx::query("COMMIT").execute(&mut taken.conn).await?;
                    pending.fetch_add(rows.len() as i64, Ordering::SeqCst);
                }
            }
            native.conns[shard].give_back(taken);
            anyhow::Ok(())
        }
    });
    for r in futures::future::join_all(jobs).await {
        r?;
    }
    for i in items {
        let user = hex16(&user_id(i as usize % USERS));
        let published = entity(i)["published"].as_i64().unwrap_or(0);
        let logical = schemas::logical_of(&user, schemas::shard::DEFAULT_LOGICAL_SHARDS);
        deferred.pending.fetch_add(1, Ordering::SeqCst);
        let _ = deferred.index[shard_of_hex(&user_id(i as usize % USERS))].send((
            user,
            published,
            hex16(&entity_id(i)),
            logical,
        ));
    }
    Ok(())
}

/// Entity `i`'s change event as bagstore's writer would put it in the
/// outbox for its first version.
fn event(i: u64, shard: usize) -> Vec<u8> {
    let bag = schemas::value::bag_from_json(&entity(i)).expect("a bag");
    ChangeEvent {
        id: EntityId(hex16(&entity_id(i))),
        version: 1,
        op: Op::Put,
        committed_at_us: schemas::clock::now_micros(),
        shard: shard as u32,
        before: None,
        after: Some(bag),
        added_id: None,
    }
    .encode()
}

/// Inserts the index rows that arrive, up to [`BATCH`] per statement.
async fn write_index_rows(
    native: Arc<Native>,
    shard: usize,
    mut rx: mpsc::UnboundedReceiver<IndexRow>,
    pending: Arc<AtomicI64>,
) -> anyhow::Result<()> {
    while let Some(first) = rx.recv().await {
        let mut rows = vec![first];
        while rows.len() < BATCH {
            match rx.try_recv() {
                Ok(r) => rows.push(r),
                Err(_) => break,
            }
        }
        let sql = format!(
            "INSERT INTO {TABLE} (user_id, published, entity_id, version, logical) VALUES {}",
            vec!["(?, ?, ?, 1, ?)"; rows.len()].join(", ")
        );
        let mut q = sqlx::query(&sql);
        for (user, published, id, logical) in &rows {
            q = q.bind(user.to_vec()).bind(*published).bind(id.to_vec()).bind(*logical);
        }
        native.execute(shard, q).await?;
        pending.fetch_sub(rows.len() as i64, Ordering::SeqCst);
    }
    Ok(())
}

/// Deletes the outbox's oldest rows in ranges of [`BATCH`] while any wait.
async fn delete_outbox(
    native: Arc<Native>,
    shard: usize,
    pending: Arc<AtomicI64>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> anyhow::Result<()> {
    while !stop.load(Ordering::SeqCst) {
        let mut taken = native.conns[shard].take().await?;
        let done = sqlx::query(&format!("DELETE FROM outbox ORDER BY seq LIMIT {BATCH}"))
            .execute(&mut taken.conn)
            .await?
            .rows_affected();
        native.conns[shard].give_back(taken);
        pending.fetch_sub(done as i64, Ordering::SeqCst);
        if done == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    Ok(())
}

/// One `link` index row: (link, entity id, logical shard).
type LinkRow = (String, [u8; 16], u16);

/// Binds `rows` to a multi-row insert of `(link, entity_id, …, logical)`.
fn bind_links<'q>(mut q: crate::MyQuery<'q>, rows: &'q [LinkRow]) -> crate::MyQuery<'q> {
    for (link, id, logical) in rows {
        q = q.bind(link.as_bytes()).bind(id.to_vec()).bind(*logical);
    }
    q
}

/// Rows per statement in [`load_index_rows`], the backfill's own batch.
const LOAD_BATCH: usize = 1000;

/// Writes the `link` index rows of entities `0..n` (the rows bagstore's
/// backfill of `index_link` writes, placed on the shard of their link) into
/// a new table with bagstore's index DDL, as bagstore's backfill writes
/// them: multi-row `INSERT … ON DUPLICATE KEY UPDATE` of [`LOAD_BATCH`]
/// rows, autocommitted, from `clients` clients. Returns the seconds the
/// writing took (the rows are computed before the clock starts).
pub async fn load_index_rows(native: Arc<Native>, n: u64, clients: usize) -> anyhow::Result<f64> {
    let table = "floor_link_live";
    let spec = IndexSpec {
        table: table.into(),
        properties: vec![IndexProperty { name: "link".into(), ty: PropType::String, max_len: Some(200) }],
        shard_on: None,
        match_on: Default::default(),
        unique: false,
    };
    for pool in &native.pools {
        sqlx::query(&format!("DROP TABLE IF EXISTS {table}")).execute(pool).await?;
        sqlx::query(&storage::ddl::index_table(&spec)).execute(pool).await?;
    }
    let mut per: Vec<Vec<LinkRow>> = vec![Vec::new(); SHARDS];
    for i in 0..n {
        let link = entity(i)["link"].as_str().unwrap_or_default().to_string();
        let logical = schemas::logical_of(link.as_bytes(), schemas::shard::DEFAULT_LOGICAL_SHARDS);
        per[logical as usize % SHARDS].push((link, hex16(&entity_id(i)), logical));
    }
    let sql = |rows: usize| {
        format!(
            "INSERT INTO {table} (link, entity_id, version, logical) VALUES {} \
             ON DUPLICATE KEY UPDATE version = IF(VALUES(version) > version, VALUES(version), version)",
            vec!["(?, ?, 1, ?)"; rows].join(", "),
        )
    };
    let started = Instant::now();
    let chunks: Vec<(usize, Vec<LinkRow>)> = per
        .into_iter()
        .enumerate()
        .flat_map(|(shard, rows)| rows.chunks(LOAD_BATCH).map(|c| (shard, c.to_vec())).collect::<Vec<_>>())
        .collect();
    let queue = Arc::new(std::sync::Mutex::new(chunks.into_iter()));
    let jobs = (0..clients).map(|_| {
        let (native, queue) = (native.clone(), queue.clone());
        async move {
            loop {
                let next = queue.lock().unwrap().next();
                let Some((shard, chunk)) = next else { return anyhow::Ok(()) };
                let text = sql(chunk.len());
                native.execute(shard, bind_links(sqlx::query(&text), &chunk)).await?;
            }
        }
    });
    for r in futures::future::join_all(jobs).await {
        r?;
    }
    let secs = started.elapsed().as_secs_f64();
    let mut loaded = 0;
    for pool in &native.pools {
        let (rows,): (i64,) =
            sqlx::query_as(&format!("SELECT COUNT(*) FROM {table}")).fetch_one(pool).await?;
        loaded += rows as u64;
        sqlx::query(&format!("DROP TABLE {table}")).execute(pool).await?;
    }
    anyhow::ensure!(loaded == n, "{table} holds {loaded} rows, not {n}");
    Ok(secs)
}
