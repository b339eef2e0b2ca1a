//! `Idempotency-Key` records (table `bagstore_idempotency`, see
//! [`crate::ddl::idempotency`]): read with a lock inside the write
//! transaction they guard, written in it, purged once older than the window.

use schemas::EntityId;
use sqlx::mysql::MySqlConnection;
use sqlx::{MySqlPool, Row};
use std::collections::HashMap;

use crate::error::{id_column, OnShard, Result};
use crate::rows::Rows;

/// What a guarded write answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub request_hash: [u8; 16],
    pub entity_id: EntityId,
    pub version: u64,
    pub created: bool,
    /// The refusal the guarded write got (the writer's JSON), so a retry
    /// is refused the same way; None when it wrote.
    pub refusal: Option<String>,
    pub recorded_us: i64,
}

/// The records of `keys` (16-byte key hashes), locked until the
/// transaction ends, so two retries of one key serialize.
pub async fn lock_records(
    shard: usize,
    conn: &mut MySqlConnection,
    keys: &[[u8; 16]],
) -> Result<HashMap<[u8; 16], Record>> {
    select_records(shard, conn, keys, " FOR UPDATE").await
}

/// The records of `keys`, unlocked: a look before a write that spans
/// shards (a keyed batch), which its transactions check again.
pub async fn read_records(
    shard: usize,
    pool: &MySqlPool,
    keys: &[[u8; 16]],
) -> Result<HashMap<[u8; 16], Record>> {
    let mut conn = pool.acquire().await.on(shard)?;
    select_records(shard, &mut conn, keys, "").await
}

async fn select_records(
    shard: usize,
    conn: &mut MySqlConnection,
    keys: &[[u8; 16]],
    lock: &str,
) -> Result<HashMap<[u8; 16], Record>> {
    let mut out = HashMap::new();
    let select = Rows::new(
        // The key named, as `entities::BY_ID` says why: a locking read of a
        // small table would scan it.
        "SELECT key_hash, request_hash, entity_id, version, created, refusal, recorded_us FROM bagstore_idempotency \
         FORCE INDEX (PRIMARY) WHERE key_hash IN (",
        "?",
        format!("){lock}"),
    );
    for st in select.statements(keys) {
        let q = st.bind(sqlx::query(&st.sql), |q, k| q.bind(&k[..]));
        for r in q.fetch_all(&mut *conn).await.on(shard)? {
            let key: Vec<u8> = r.try_get("key_hash").on(shard)?;
            let request: Vec<u8> = r.try_get("request_hash").on(shard)?;
            let (Ok(key), Ok(request_hash)) = (<[u8; 16]>::try_from(key), <[u8; 16]>::try_from(request))
            else {
                continue;
            };
            out.insert(
                key,
                Record {
                    request_hash,
                    entity_id: id_column(shard, &r, "entity_id")?,
                    version: r.try_get("version").on(shard)?,
                    created: r.try_get("created").on(shard)?,
                    refusal: r.try_get("refusal").on(shard)?,
                    recorded_us: r.try_get("recorded_us").on(shard)?,
                },
            );
        }
    }
    Ok(out)
}

/// Writes records, replacing any of the same key (expired ones, which the
/// caller holds locked): `(key hash, logical shard, record)`.
pub async fn put_records(
    shard: usize,
    conn: &mut MySqlConnection,
    records: &[([u8; 16], u16, Record)],
) -> Result<()> {
    write_records(
        shard,
        conn,
        records,
        " ON DUPLICATE KEY UPDATE logical = VALUES(logical), request_hash = VALUES(request_hash), \
         entity_id = VALUES(entity_id), version = VALUES(version), created = VALUES(created), \
         refusal = VALUES(refusal), recorded_us = VALUES(recorded_us)",
    )
    .await
}

/// Inserts records of keys that had none: a record of the same key that
/// another transaction wrote meanwhile fails this one (1062, a retryable
/// conflict), so a guarded write can never apply twice.
pub async fn insert_records(
    shard: usize,
    conn: &mut MySqlConnection,
    records: &[([u8; 16], u16, Record)],
) -> Result<()> {
    write_records(shard, conn, records, "").await
}

async fn write_records(
    shard: usize,
    conn: &mut MySqlConnection,
    records: &[([u8; 16], u16, Record)],
    on_duplicate: &str,
) -> Result<()> {
    let write = record_rows(on_duplicate);
    for st in write.statements(records) {
        let q = st.bind(sqlx::query(&st.sql), |q, (key, logical, r)| bind_record(q, key, *logical, r));
        q.execute(&mut *conn).await.on(shard)?;
    }
    Ok(())
}

/// `INSERT INTO bagstore_idempotency` of whole records, bound by
/// [`bind_record`], ending with `tail`.
pub(crate) fn record_rows(tail: &str) -> Rows {
    Rows::new(
        "INSERT INTO bagstore_idempotency \
         (key_hash, logical, request_hash, entity_id, version, created, refusal, recorded_us) VALUES ",
        "(?, ?, ?, ?, ?, ?, ?, ?)",
        tail,
    )
}

/// Binds one record's eight columns, in the order `(key_hash, logical,
/// request_hash, entity_id, version, created, refusal, recorded_us)`.
pub(crate) fn bind_record<'q>(
    q: sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments>,
    key: &'q [u8; 16],
    logical: u16,
    r: &'q Record,
) -> sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments> {
    q.bind(&key[..])
        .bind(logical)
        .bind(&r.request_hash[..])
        .bind(&r.entity_id.0[..])
        .bind(r.version)
        .bind(r.created)
        .bind(r.refusal.as_deref())
        .bind(r.recorded_us)
}

/// Deletes up to `limit` records recorded before `before_us`; how many.
pub async fn purge(shard: usize, pool: &MySqlPool, before_us: i64, limit: u64) -> Result<u64> {
    let done = sqlx::query("DELETE FROM bagstore_idempotency WHERE recorded_us < ? LIMIT ?")
        .bind(before_us)
        .bind(limit)
        .execute(pool)
        .await
        .on(shard)?;
    Ok(done.rows_affected())
}
