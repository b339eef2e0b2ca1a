//! Which server of a shard a read goes to: its primary, or one of its
//! replicas (`reader.read_from`).
//!
//! With `read_from = "replicas"`, the first statement an attempt of a read
//! sends to a shard picks one of the shard's replicas whose data is at
//! most `reader.max_replica_lag_ms` old (as the replica watch last measured
//! it, see [`crate::replicas`]), in turn, and the attempt keeps it for
//! every later statement there: a write token checked on a server holds
//! for everything read from it afterwards, as a server only gains
//! transactions. With no replica usable, the read goes to the primary.
//!
//! A replica may make an answer older, never wrong, and never older than a
//! write token allows:
//! - a statement that fails on a replica runs again on the primary;
//! - a replica whose shard epoch is *older* than the map's has not applied
//!   a move's cutover yet: that is lag, and the read goes to the primary.
//!   Only an epoch *newer* than the map's says the map is stale, and only
//!   then is it reloaded (a lagging replica never makes a reader reload
//!   the map in a loop);
//! - write tokens: see the `consistency` module.

use schemas::settings::ReadFrom;
use sqlx::mysql::MySqlPool;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use storage::conns::Conns;
use storage::shards::{Replica, Routing};
use storage::StoreError;

use crate::{ReadError, Reader};

/// The server of one shard that a read reads.
#[derive(Debug, Clone)]
pub enum Target {
    Primary,
    Replica(Arc<Replica>),
}

impl Target {
    pub fn is_replica(&self) -> bool {
        matches!(self, Target::Replica(_))
    }

    /// The hot-path connections to this server of `shard`.
    pub fn conns<'a>(&'a self, reader: &'a Reader, shard: usize) -> &'a Conns {
        match self {
            Target::Primary => reader.shards().conns(shard),
            Target::Replica(r) => r.conns(),
        }
    }

    /// The pool of this server of `shard`.
    pub fn pool<'a>(&'a self, reader: &'a Reader, shard: usize) -> &'a MySqlPool {
        match self {
            Target::Primary => reader.shards().pool(shard),
            Target::Replica(r) => r.pool(),
        }
    }
}

/// Why a read meant for a replica went to the primary: the `reason` of
/// `bagstore_reader_replica_fallbacks_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// No replica of the shard is up and within the lag bound (or it has none).
    NoReplica,
    /// A statement failed on the replica.
    Failed,
    /// The replica has not applied a move's cutover that the map has.
    BehindCutover,
    /// A write token's write had not reached the replica within the wait.
    WriteToken,
}

impl Fallback {
    fn reason(self) -> &'static str {
        match self {
            Fallback::NoReplica => "no_replica",
            Fallback::Failed => "failed",
            Fallback::BehindCutover => "behind_cutover",
            Fallback::WriteToken => "write_token",
        }
    }

    /// Why `e`, from a statement on a replica, sends the read to the
    /// primary; None when the primary would not answer better: the map
    /// is stale (reloaded, and the read run again), or the error is not
    /// the server's.
    pub fn after(e: &ReadError) -> Option<Fallback> {
        match e {
            ReadError::ReplicaBehind { .. } => Some(Fallback::BehindCutover),
            ReadError::Store(s) if s.is_stale_map() => None,
            ReadError::Store(_) => Some(Fallback::Failed),
            _ => None,
        }
    }
}

/// Whether `seen`, the epoch a read found on `target` of `shard`, is the
/// one `map` (the map the read was routed with) gives the shard. Older on
/// a replica: the replica lags ([`ReadError::ReplicaBehind`]); any other
/// difference: the map is stale ([`StoreError::StaleMap`]). Never compared
/// with the current map: one reloaded since the read was routed would
/// vouch for a shard the read should not have asked.
pub fn check_epoch(map: &Routing, shard: usize, seen: Option<u64>, target: &Target) -> Result<(), ReadError> {
    let want = map.epoch_of(shard);
    match seen {
        Some(e) if e < want && target.is_replica() => Err(ReadError::ReplicaBehind { shard }),
        Some(e) if e != want => Err(StoreError::StaleMap { shard }.into()),
        _ => Ok(()),
    }
}

/// Where one attempt of a read reads each shard: picked at its first
/// statement there, then kept (or moved to the primary, never back).
#[derive(Debug)]
pub struct Route<'r> {
    reader: &'r Reader,
    /// Replicas may be read (`reader.read_from = "replicas"`).
    replicas: bool,
    /// Reads are counted in `bagstore_reader_routed_total` (not so for the
    /// checks of a write token against the primaries).
    counted: bool,
    picks: Mutex<HashMap<usize, Target>>,
}

impl<'r> Route<'r> {
    /// A read's route, as `reader.read_from` says.
    pub fn new(reader: &'r Reader) -> Route<'r> {
        let replicas = reader.settings().reader.read_from == ReadFrom::Replicas;
        Route { reader, replicas, counted: true, picks: Mutex::default() }
    }

    /// The primaries only, counted nowhere: what write tokens are checked
    /// against while a replica is behind them.
    pub fn primaries(reader: &'r Reader) -> Route<'r> {
        Route { reader, replicas: false, counted: false, picks: Mutex::default() }
    }

    pub fn uses_replicas(&self) -> bool {
        self.replicas
    }

    /// The server to read `shard` on.
    pub fn target(&self, shard: usize) -> Target {
        let mut picks = self.picks.lock().expect("not poisoned");
        if let Some(t) = picks.get(&shard) {
            return t.clone();
        }
        let t = if self.replicas { self.reader.pick(shard) } else { Target::Primary };
        let label = match (&t, self.replicas) {
            (Target::Replica(_), _) => "replica",
            (Target::Primary, true) => "primary_fallback",
            (Target::Primary, false) => "primary",
        };
        if self.counted {
            self.reader.inner.metrics.routed.with_label_values(&[label]).inc();
        }
        picks.insert(shard, t.clone());
        t
    }

    /// Whether this attempt reads `shard` on a replica (picking none).
    pub fn on_replica(&self, shard: usize) -> bool {
        self.picks.lock().expect("not poisoned").get(&shard).is_some_and(Target::is_replica)
    }

    /// Sends the rest of this attempt's reads of `shard` to the primary.
    pub fn demote(&self, shard: usize, why: Fallback) {
        self.picks.lock().expect("not poisoned").insert(shard, Target::Primary);
        self.count_fallback(why);
    }

    /// Counts one read meant for a replica that went to the primary.
    pub fn count_fallback(&self, why: Fallback) {
        let m = &self.reader.inner.metrics;
        m.fallbacks.with_label_values(&[why.reason()]).inc();
        if self.counted {
            m.routed.with_label_values(&["primary_fallback"]).inc();
        }
    }
}

impl Reader {
    /// A new attempt's route (see [`Route`]).
    pub fn route(&self) -> Route<'_> {
        Route::new(self)
    }

    /// The longest a replica's data may lag for reads to use it.
    pub(crate) fn max_replica_lag(&self) -> Duration {
        Duration::from_millis(self.settings().reader.max_replica_lag_ms)
    }

    /// One of `shard`'s replicas that is up and within the lag bound, in
    /// turn; the primary when there is none.
    fn pick(&self, shard: usize) -> Target {
        let (now, max) = (Instant::now(), self.max_replica_lag());
        let replicas = self.shards().replicas(shard);
        let usable: Vec<&Arc<Replica>> =
            replicas.iter().filter(|r| r.staleness(now).is_some_and(|lag| lag <= max)).collect();
        if usable.is_empty() {
            self.inner.metrics.fallbacks.with_label_values(&[Fallback::NoReplica.reason()]).inc();
            return Target::Primary;
        }
        let turn = self.inner.next_replica.fetch_add(1, Ordering::Relaxed);
        Target::Replica(usable[turn % usable.len()].clone())
    }
}
