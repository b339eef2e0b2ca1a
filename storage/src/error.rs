//! [`StoreError`]: what went wrong, on which shard, and whether it is worth
//! running again.

use schemas::names::tables;
use schemas::topology::PhysicalId;
use schemas::EntityId;
use sqlx::Row;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("shard {shard} is unavailable or failed a statement")]
    Shard {
        shard: usize,
        #[source]
        source: sqlx::Error,
    },
    #[error("{dsn} is not a valid MySQL URL")]
    BadDsn {
        dsn: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("index {table:?} already exists with another definition; drop it or pick a new table name")]
    SpecChanged { table: String },
    #[error("no index named {table:?}")]
    NoSuchIndex { table: String },
    /// The write's map is stale: this physical shard does not own a logical
    /// shard the write touches (any more). Reload the map and route again.
    #[error("physical shard {shard} does not own logical shard {logical}")]
    NotOwner { shard: usize, logical: u16 },
    /// The write reached a server that is not its shard's primary (a
    /// replica, or a primary a failover fenced): its map is stale.
    #[error("the server of physical shard {shard} is read-only: it is not the shard's primary (any more)")]
    NotPrimary { shard: usize },
    /// None of a shard's known servers takes writes: a failover is under
    /// way (or stuck); the operation may be tried again.
    #[error(
        "no server of physical shard {shard} takes writes ({servers} known): a failover may be under way"
    )]
    NoPrimary { shard: usize, servers: usize },
    /// The shard has replicas and none acknowledges commits now: a write
    /// would wait until one does, so it is refused before it begins
    /// (nothing was written; the writer's gate, see the acks module).
    #[error(
        "physical shard {shard} has replicas but none acknowledges writes now: the write was refused \
         before it began (nothing was written); try again shortly"
    )]
    NoAcknowledgingReplica { shard: usize },
    /// A read found a shard's epoch moved: its map is stale.
    #[error("physical shard {shard} changed ownership since the map was loaded")]
    StaleMap { shard: usize },
    /// An indexer consumer's claim on these partitions is older than the
    /// shard's fence: another consumer has been assigned them since.
    #[error("partitions {partitions:?} of group {group:?} were claimed by another consumer (shard {shard})")]
    Fenced { shard: usize, group: String, partitions: Vec<i32> },
    #[error("{0}")]
    BadTopology(String),
    /// A mover run found its token replaced on the target, or its source
    /// no longer owning what it would journal: it lost the mover lock, and
    /// another run took the move over.
    #[error("another run of the mover took this move over (physical shard {shard} no longer accepts this run's copy or journal)")]
    MoveTakenOver { shard: usize },
    /// The move's phase is no longer the one this run last saw: a run that
    /// lost the mover lock without knowing, while another took the move
    /// over and moved it on (a phase changes only from the one last seen).
    #[error("another run of the mover took move {id} over (its phase is no longer {expected})")]
    MovePhaseMoved { id: u64, expected: &'static str },
    /// A cutover's flip found the primary of its source or target changed
    /// since the cutover began (a failover or switchover recorded in
    /// between): the map is not flipped, and the cutover is recovered
    /// against the primaries the map names now, so a failover and a
    /// cutover never interleave.
    #[error(
        "move {id}: physical shard {shard}'s primary changed during the cutover; the cutover runs again"
    )]
    FailedOverMidCutover { id: u64, shard: PhysicalId },
    /// A write's unique keys kept changing hands between its tries (each
    /// try found another key to reserve, or its reservation taken over):
    /// nothing was written; the write may be tried again.
    #[error("the write's unique keys on shard {shard} kept changing hands; nothing was written, try again")]
    UniqueKeysMoving { shard: usize },
    #[error(transparent)]
    Topology(#[from] schemas::topology::TopologyError),
    #[error("stored index metadata for {table:?} is unreadable")]
    BadMeta {
        table: String,
        #[source]
        source: serde_json::Error,
    },
}

impl StoreError {
    /// The MySQL error number, when the server answered with an error.
    pub fn mysql_number(&self) -> Option<u16> {
        match self {
            StoreError::Shard { source: sqlx::Error::Database(db), .. } => {
                db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().map(|e| e.number())
            }
            _ => None,
        }
    }

    /// The map this operation routed with is out of date: reload it and run
    /// the operation again (on the new owner, or the new primary). A
    /// statement the server refused as read-only (1290) is the same as
    /// [`StoreError::NotPrimary`]: the server turned read-only after the
    /// transaction's ownership check (a switchover's fence), and the
    /// refused transaction wrote nothing.
    pub fn is_stale_map(&self) -> bool {
        matches!(
            self,
            StoreError::NotOwner { .. } | StoreError::NotPrimary { .. } | StoreError::StaleMap { .. }
        ) || self.is_read_only_refusal()
    }

    /// 1290 for `read_only` (the number covers other options too).
    fn is_read_only_refusal(&self) -> bool {
        let StoreError::Shard { source: sqlx::Error::Database(db), .. } = self else { return false };
        self.mysql_number() == Some(1290) && db.message().contains("read-only")
    }

    /// Deadlocks, lock wait timeouts and a lost race to insert the same new
    /// id: the transaction was rolled back and may simply be run again.
    pub fn is_retryable_conflict(&self) -> bool {
        matches!(self.mysql_number(), Some(1213 | 1205 | 1062))
    }

    /// Shard `shard` did not answer within a caller's own deadline (as a
    /// pool that found no connection in time: transient).
    pub fn timed_out(shard: usize) -> StoreError {
        StoreError::Shard { shard, source: sqlx::Error::PoolTimedOut }
    }

    /// A failure that may pass if the operation is tried again later: a
    /// dead or refused connection, no connection free in time, a lock wait
    /// or deadlock, a stale map, the server shutting down or out of
    /// connections, a statement to re-prepare after DDL (1615: a move
    /// creating or dropping its journal triggers), a journal trigger that
    /// could not run ([`StoreError::is_journal_trigger_failure`]). Anything
    /// else (a statement refused, a corrupt row) is ours and does not pass
    /// by retrying.
    pub fn is_transient(&self) -> bool {
        self.is_dead_connection()
            || self.is_retryable_conflict()
            || self.is_stale_map()
            || matches!(
                self,
                StoreError::Shard { source: sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed, .. }
            )
            || matches!(self.mysql_number(), Some(1040 | 1203 | 1615 | 2002 | 2003))
            || self.is_journal_trigger_failure()
            || matches!(
                self,
                StoreError::NoPrimary { .. }
                    | StoreError::NoAcknowledgingReplica { .. }
                    | StoreError::UniqueKeysMoving { .. }
            )
    }

    /// A move's journal trigger could not run, so the
    /// write that fired it failed as a whole: no write commits without its
    /// journal entry, and run again it passes. MariaDB answers so after a
    /// connection was killed while it opened a journaled table and loaded
    /// its triggers: other connections are then handed the half-loaded
    /// triggers, and their writes to that table fail naming the journal's
    /// tables (1146, "Table '…bagstore_journal' doesn't exist") or the
    /// trigger (1064, "… has an error in its body") until the table is
    /// opened afresh (at the latest when the move's cleanup drops the
    /// triggers). The chaos suite's killed connections met it mid-move.
    pub fn is_journal_trigger_failure(&self) -> bool {
        let StoreError::Shard { source: sqlx::Error::Database(db), .. } = self else { return false };
        let message = db.message();
        match self.mysql_number() {
            Some(1146) => {
                [tables::JOURNAL, tables::MOVING].iter().any(|t| message.contains(&format!(".{t}'")))
            }
            Some(1064) => message.contains("has an error in its body"),
            _ => false,
        }
    }

    /// The connection is gone, not the statement refused: I/O and protocol
    /// errors, and the server's "connection was killed" (1927), "server
    /// shutdown in progress" (1053) and lost-connection (2006, 2013).
    pub fn is_dead_connection(&self) -> bool {
        matches!(
            self,
            StoreError::Shard {
                source: sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::Tls(_),
                ..
            }
        ) || matches!(self.mysql_number(), Some(1927 | 1053 | 2006 | 2013))
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Attaches the shard number to a sqlx error.
pub trait OnShard<T> {
    fn on(self, shard: usize) -> Result<T>;
}

impl<T> OnShard<T> for std::result::Result<T, sqlx::Error> {
    fn on(self, shard: usize) -> Result<T> {
        self.map_err(|source| StoreError::Shard { shard, source })
    }
}

/// Reads a `BINARY(16)` id column. Every id column is `BINARY(16) NOT
/// NULL`, so a wrong length cannot come from our own writes; it reads as
/// the all-zero id rather than failing a whole scan.
pub(crate) fn id_column(shard: usize, r: &sqlx::mysql::MySqlRow, col: &str) -> Result<EntityId> {
    let bytes: Vec<u8> = r.try_get(col).on(shard)?;
    Ok(EntityId::from_slice(&bytes).unwrap_or(EntityId([0; 16])))
}
