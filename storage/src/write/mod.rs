//! The write transaction: the one way an entity row changes, whoever asks
//! (the writer's HTTP routes and Kafka ingest, the cleaner's expiry).
//!
//! One InnoDB transaction on the entity's shard: prove the shard owns the
//! ids' logical shards, lock the rows, check each precondition, write
//! version+1, insert the change events into the outbox, commit. Nothing
//! reaches the database for a write that fails validation or its
//! precondition, except, for a guarded write (an idempotency key), the
//! record of that refusal, so a retry gets it.
//!
//! In: [`Item`]s (an id, a [`Change`], a [`Precondition`]) for one shard,
//! and the [`WriteContext`] the caller owns (the shards, the [`Rules`] from
//! the settings, per-shard caches). Out: each item's [`Outcome`] or
//! [`WriteError`], and what the caller counts ([`Committed::kinds`]); no
//! metrics are kept here, and nothing is woken: the caller knows who
//! waits for a commit (its relays).
//!
//! Layout:
//! - this file: the types every caller shares, and the context.
//! - `decide`: the pure decision per item, and per transaction (items in
//!   order, each seeing the ones before it).
//! - `refusal`: how a guarded write records its refusal, and replays it.
//! - [`transaction`]: the transaction and its retries (deadlocks, a dead
//!   connection at `BEGIN`).
//! - [`batch`]: many items split by the shard that owns each, one
//!   transaction per shard, again on the owner after a stale map; the look
//!   at a keyed batch's keys before it.

pub mod batch;
mod decide;
mod keys;
mod refusal;
pub mod transaction;

use schemas::expiry::BadExpiry;
use schemas::patch::{Patch, PatchClash};
use schemas::{Bag, EntityId, Settings};
use std::sync::Arc;
use tokio::sync::OnceCell;

use crate::acks::AckGate;
use crate::shards::MAX_PHYSICAL;
use crate::unique::UniqueCatalog;
use crate::{Shards, StoreError};

pub use batch::{commit_all, keys_reused, ShardCommit};
pub use transaction::commit;

/// Optional conditions on the current version (`If-Match`, `If-None-Match: *`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Precondition {
    pub if_version: Option<u64>,
    pub if_absent: bool,
    /// `If-Match: *`: the entity must exist (any version).
    pub if_exists: bool,
    /// `Idempotency-Key`: a retry within the window gets the first answer.
    pub guard: Option<Guard>,
}

/// An `Idempotency-Key` on a write: its hash and the request's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Guard {
    pub key: [u8; 16],
    pub request: [u8; 16],
}

/// A committed write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    pub id: EntityId,
    pub version: u64,
    /// No live entity had this id before.
    pub created: bool,
    /// A retry under an idempotency key: the first answer, nothing written.
    pub replayed: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("expected version {expected}, but the entity is at {}", actual.map_or("(absent)".to_string(), |v| v.to_string()))]
    VersionConflict { expected: u64, actual: Option<u64> },
    #[error("the entity already exists at version {current}")]
    AlreadyExists { current: u64 },
    #[error("no entity with this id")]
    NotFound,
    /// A patch that cannot apply to what is stored (nothing is written).
    #[error(transparent)]
    PatchClash(#[from] PatchClash),
    /// The `Idempotency-Key` was used within the window for another request.
    #[error("this Idempotency-Key was used for a different request")]
    KeyReused,
    /// A patch whose result would be larger than an entity may be.
    #[error("the patched entity would take {bytes} bytes of JSON, over the {max} byte limit")]
    TooLarge { bytes: usize, max: usize },
    /// The entity's expiry property is not a number of Unix seconds.
    #[error(transparent)]
    BadExpiry(#[from] BadExpiry),
    /// An expiry (the cleaner's delete) found the entity not expired:
    /// rewritten since it was found, or already deleted.
    #[error("the entity is not expired")]
    NotExpired,
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The commit did not answer within `writer.commit_timeout_ms`: it may
    /// still commit (a commit waiting for a replica's acknowledgement is
    /// never killed). A retry with the same `Idempotency-Key` learns what
    /// happened.
    #[error("the write's commit has not answered within {waited_ms} ms and may still commit: retry with the same Idempotency-Key to learn its outcome")]
    OutcomeUnknown { waited_ms: u64 },
    /// The transaction this item shared with others (a batch, or a group
    /// commit) failed on its shard; the error is shared by those items.
    /// The write would give its entity a key of a unique index that
    /// another live entity holds (nothing was written).
    #[error("index {index:?} already has this key, held by entity {}", existing_id.to_hex())]
    UniqueViolation { index: String, existing_id: EntityId },
    #[error("the shared transaction on shard {shard} failed")]
    ShardFailed {
        shard: usize,
        #[source]
        source: Arc<StoreError>,
    },
}

impl WriteError {
    /// The shard the write went to did not own it (the map was stale): the
    /// write may go again to the owner the reloaded map names.
    pub fn is_stale_map(&self) -> bool {
        match self {
            WriteError::Store(e) => e.is_stale_map(),
            WriteError::ShardFailed { source, .. } => source.is_stale_map(),
            _ => false,
        }
    }

    /// A failure that may pass if the write is tried again later (see
    /// [`StoreError::is_transient`]); a refusal never does.
    pub fn is_transient(&self) -> bool {
        match self {
            WriteError::Store(e) => e.is_transient(),
            WriteError::ShardFailed { source, .. } => source.is_transient(),
            _ => false,
        }
    }
}

/// What one write does to the entity.
#[derive(Debug, Clone)]
pub enum Change {
    Put(Bag),
    Delete,
    /// Applied to the row as locked; `upsert` creates a missing entity
    /// from an empty bag (otherwise a missing one is not found).
    Patch {
        patch: Arc<Patch>,
        upsert: bool,
    },
    /// The cleaner's delete of an expired entity: a delete if the entity
    /// as locked is expired, else nothing ([`WriteError::NotExpired`]).
    Expire,
}

impl Change {
    /// What kind of write this is: the `kind` label callers count
    /// committed writes by.
    pub fn kind(&self) -> &'static str {
        match self {
            Change::Put(_) => "put",
            Change::Delete => "delete",
            Change::Patch { .. } => "patch",
            Change::Expire => "expire",
        }
    }
}

/// One write of a transaction: which entity, what to do to it, and on
/// what condition.
#[derive(Debug, Clone)]
pub struct Item {
    pub id: EntityId,
    pub change: Change,
    pub pre: Precondition,
}

/// A transaction that committed: each item's answer, and what it wrote.
#[derive(Debug)]
pub struct Committed {
    /// Each item's answer, in item order: its outcome, or why it wrote
    /// nothing (its precondition failed, or it is a replay's refusal).
    pub results: Vec<Result<Outcome, WriteError>>,
    /// The [`Change::kind`] of each write committed (a replayed or
    /// refused item wrote nothing and has none).
    pub kinds: Vec<&'static str>,
    /// Idempotency records were committed (a guarded write wrote, or its
    /// refusal was recorded).
    pub recorded: bool,
}

/// What the settings say about every write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rules {
    /// The largest JSON a patched entity may take (`writer.max_body_bytes`:
    /// a put's body was held to it as it was read).
    pub max_bytes: usize,
    /// `expiry.property`: the property holding an entity's expiry time.
    pub expiry: Option<String>,
    /// How long an `Idempotency-Key`'s first answer is replayed, µs.
    pub idempotency_window_us: i64,
    /// How long a write's reservation of a unique key is its own, µs.
    pub unique_reservation_us: i64,
    /// `writer.drill_exit_after_reserve`.
    pub drill_exit_after_reserve: bool,
}

impl Rules {
    pub fn from_settings(s: &Settings) -> Rules {
        Rules {
            max_bytes: s.writer.max_body_bytes,
            expiry: s.expiry.property.clone(),
            idempotency_window_us: (s.writer.idempotency_window_secs as i64).saturating_mul(1_000_000),
            unique_reservation_us: (s.writer.unique_reservation_ms as i64).saturating_mul(1_000),
            drill_exit_after_reserve: s.writer.drill_exit_after_reserve,
        }
    }
}

/// What every write transaction of a process needs, owned by the caller
/// (one per writer, one per cleaner): the shards, the rules, and what is
/// asked of each shard once and kept.
#[derive(Debug)]
pub struct WriteContext {
    shards: Shards,
    rules: Rules,
    /// Shards that refuse writes for want of an acknowledging replica.
    acks: Arc<AckGate>,
    /// The unique indexes whose keys writes reserve (`crate::unique`).
    unique: Arc<UniqueCatalog>,
    /// By physical id, asked once: whether a multi-row insert's new rows are
    /// numbered consecutively (see [`crate::entities::autoinc_is_consecutive`]).
    consecutive: Vec<OnceCell<bool>>,
}

impl WriteContext {
    pub fn new(shards: Shards, rules: Rules) -> WriteContext {
        let consecutive = (0..MAX_PHYSICAL).map(|_| OnceCell::new()).collect();
        WriteContext { shards, rules, consecutive, acks: Arc::default(), unique: Arc::default() }
    }

    /// The gate the writer's watch sets (`crate::acks`).
    pub fn acks(&self) -> &Arc<AckGate> {
        &self.acks
    }

    pub fn shards(&self) -> &Shards {
        &self.shards
    }

    /// The unique indexes writes keep (their owner reloads it).
    pub fn unique(&self) -> &Arc<UniqueCatalog> {
        &self.unique
    }

    pub fn rules(&self) -> &Rules {
        &self.rules
    }
}

/// Each of the `n` items' results from one transaction they shared: their
/// own when it committed, else its error (shared when there are several).
pub fn per_item(
    shard: usize,
    result: Result<Vec<Result<Outcome, WriteError>>, StoreError>,
    n: usize,
) -> Vec<Result<Outcome, WriteError>> {
    match result {
        Ok(results) => results,
        Err(e) if n == 1 => vec![Err(WriteError::Store(e))],
        Err(e) => {
            let source = Arc::new(e);
            (0..n).map(|_| Err(WriteError::ShardFailed { shard, source: source.clone() })).collect()
        }
    }
}
