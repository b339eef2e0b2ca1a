//! The model every bagstore component agrees on. It performs no I/O: no
//! database, network, HTTP or async runtime (its dependency tree shows it),
//! so it can be unit-tested, property-tested and fuzzed on its own.
//!
//! In: configuration text, JSON property bags, stored blobs, query
//! documents. Out: typed settings, encoded bodies and change events, index
//! keys, shard numbers, query plans and the re-filter's verdict.
//!
//! Layout:
//! - [`id`]: 16-byte entity ids and their text forms; the hex codec.
//! - [`idempotency`]: `Idempotency-Key` hashes and the ids keyed creates get.
//! - [`value`]: property values and bags (JSON in, JSON out), equality and order.
//! - [`patch`]: partial updates: RFC 7396 merge patches and `$`-operators.
//! - [`codec`]: format byte + lz4 + bincode for bodies and events.
//! - [`event`]: the change event the outbox holds and Kafka carries.
//! - [`expiry`]: an entity's expiry time (TTL) from its expiry property.
//! - [`index`]: index specs, typed keys, multi-valued and partial indexes,
//!   index states.
//! - [`filter`]: conditions on property values.
//! - [`query`]: query documents, planning, the re-filter that enforces
//!   Invariant R, page tokens.
//! - [`shard`]: `logical_of`, the one routing function (key → logical shard).
//! - [`topology`]: the map of logical shards to physical shards; moves.
//! - [`gtid`]: MariaDB GTID positions, compared as failover compares replicas.
//! - [`names`]: the identifier rule that keeps SQL text safe; reserved names.
//! - [`settings`]: typed `Settings` from TOML + `BAGSTORE_…` variables.
//! - [`clock`]: the wall clock in microseconds.

pub mod changes;
pub mod clock;
pub mod codec;
pub mod event;
pub mod expiry;
pub mod filter;
pub mod gtid;
pub mod id;
pub mod idempotency;
pub mod index;
pub mod names;
pub mod patch;
pub mod query;
pub mod settings;
pub mod shard;
pub mod topology;
pub mod value;

pub use event::{ChangeEvent, Op};
pub use id::EntityId;
pub use index::{IndexKey, IndexSpec, KeyValue};
pub use settings::Settings;
pub use shard::logical_of;
pub use value::{Bag, Value};
