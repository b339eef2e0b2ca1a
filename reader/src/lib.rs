//! The reader: point and batch reads by id, and queries answered by index
//! lookup → entity fetch → re-filter.
//!
//! In: `GET /v1/entities/{id}`, `POST /v1/entities/get`, `POST /v1/query`,
//! `GET /v1/indexes`. Out: entities as JSON.
//!
//! Layout:
//! - [`http`]: routes, the JSON shapes, and [`ReadError`] → problem+json
//!   (the one place that maps).
//! - [`execute`]: scanning the index in order, merging shards, fetching
//!   entities, re-filtering (`schemas::query` parses and plans queries, and
//!   holds the re-filter and the page tokens).
//! - [`consistency`]: read-your-writes (`consistent_with`, on replicas
//!   too) and freshness.
//! - [`routing`]: which server of a shard a read goes to (the primary, or
//!   a replica within `reader.max_replica_lag_ms`).
//! - [`replicas`]: the replica watch: how old each replica's data may be.
//! - [`locations`]: where entities live, remembered for point reads.
//! - [`metrics`]: the series this crate exports.
//!
//! Invariant R: index rows are only ever candidates. Every returned entity
//! was re-checked against every condition (and the index's `match_on`) on
//! its canonical stored properties, so stale, duplicated or hand-made index
//! rows can cost time but never produce a wrong answer. A replica changes
//! nothing there: the re-filter runs on what was fetched, wherever from,
//! so a replica's answer may be older, never wrong.

/// Runs one read (`$conn` names the connection inside `$read`) on one of
/// `$conns`' ping-free connections; once more, on a new connection, if the
/// reused one turned out dead (see `storage::conns`). A macro rather than a
/// function taking an async closure: such closures, borrowing as these do,
/// cost the HTTP handlers' futures their `Send`.
macro_rules! read_on {
    ($conns:expr, $conn:ident => $read:expr) => {{
        let conns = $conns;
        let mut taken = conns.take().await?;
        loop {
            let $conn = &mut taken.conn;
            let r = $read.await;
            match conns.settle(taken, &r).await? {
                Some(again) => taken = again,
                None => break r?,
            }
        }
    }};
}

pub mod consistency;
pub mod execute;
pub mod http;
pub mod locations;
pub mod metrics;
pub mod replicas;
pub mod routing;

use prometheus::Registry;
use schemas::query::QueryError;
use schemas::{EntityId, Settings};
use service::freshness::Freshness;
use std::collections::HashMap;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use storage::{catalog, IndexMeta, Shards, StoreError};

/// How long index states read from shard 0 are trusted.
const STATE_TTL: Duration = Duration::from_millis(500);

/// How long a measured freshness (`index_lag_ms`, `index_applied_through_us`)
/// is reused: the figures in an answer are at most this old.
const FRESHNESS_TTL: Duration = Duration::from_millis(200);

/// Every registered index by table name, shared by the queries that read it.
pub type Metas = Arc<HashMap<String, IndexMeta>>;

/// Why a read failed, in the reader's terms; `http` turns each kind into
/// its problem document.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The query is malformed or names what does not exist (the caller's).
    #[error(transparent)]
    Query(#[from] QueryError),
    #[error("index {table:?} is {state}; its results may be incomplete")]
    IndexNotReady { table: String, state: String },
    #[error("index {table:?} has not applied these writes yet; retry later")]
    IndexBehind { table: String, pending: Vec<String> },
    #[error("the query did not finish within {ms} ms; narrow it or lower its limit")]
    Timeout { ms: u128 },
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A replica has not applied a move's cutover that the map routed
    /// with has: lag, so the read goes to the shard's primary (never seen
    /// by a caller unless the primary cannot be read either).
    #[error("a replica of shard {shard} has not applied the map's last change to it yet")]
    ReplicaBehind { shard: usize },
    #[error("entity {id} on shard {shard} has a corrupt body")]
    Corrupt {
        id: EntityId,
        shard: usize,
        #[source]
        source: schemas::codec::CodecError,
    },
}

#[derive(Debug, Clone)]
pub struct Reader {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    settings: Settings,
    shards: Shards,
    metrics: metrics::Metrics,
    /// Index definitions and states from the catalog (the source of truth,
    /// so a new index needs no reader restart), refreshed at most every
    /// STATE_TTL.
    states: Mutex<Option<(Instant, Metas)>>,
    /// Per index: the freshness reported with query answers, reused for
    /// FRESHNESS_TTL so a busy reader does not pay three extra statements
    /// per query for it.
    freshness: Mutex<HashMap<String, (Instant, Freshness)>>,
    /// Where entities read before live (`reader.location_cache`).
    locations: locations::Locations,
    /// Read slots (`reader.max_concurrent`).
    admission: Arc<tokio::sync::Semaphore>,
    /// Turns among a shard's usable replicas, so reads spread over them.
    next_replica: AtomicUsize,
}

impl Reader {
    pub fn new(settings: Settings, shards: Shards, registry: &Registry) -> prometheus::Result<Reader> {
        let metrics = metrics::Metrics::register(registry)?;
        let locations = locations::Locations::new(settings.reader.location_cache);
        let admission = Arc::new(tokio::sync::Semaphore::new(settings.reader.max_concurrent));
        Ok(Reader {
            inner: Arc::new(Inner {
                locations,
                settings,
                shards,
                metrics,
                states: Mutex::new(None),
                freshness: Mutex::new(HashMap::new()),
                admission,
                next_replica: AtomicUsize::new(0),
            }),
        })
    }

    /// A read slot, or None when reader.max_concurrent reads are running
    /// (the caller answers 429; a flood is refused, not queued).
    pub fn admit(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.inner.admission.clone().try_acquire_owned().ok()
    }

    pub fn settings(&self) -> &Settings {
        &self.inner.settings
    }

    pub fn shards(&self) -> &Shards {
        &self.inner.shards
    }

    /// Every registered index with its state (cached briefly; shared, so a
    /// query does not copy every definition).
    pub async fn index_metas(&self) -> Result<Metas, StoreError> {
        if let Some((at, states)) = self.inner.states.lock().expect("not poisoned").as_ref() {
            if at.elapsed() < STATE_TTL {
                return Ok(states.clone());
            }
        }
        let metas = catalog::list_index_meta(self.shards()).await?;
        let states: Metas = Arc::new(metas.into_iter().map(|m| (m.spec.table.clone(), m)).collect());
        *self.inner.states.lock().expect("not poisoned") = Some((Instant::now(), states.clone()));
        Ok(states)
    }
}
