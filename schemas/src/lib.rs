//! What every bagstore service agrees on.
//!
//! In: configuration files and environment, JSON property bags, stored
//! blobs. Out: typed settings, encoded bodies and change events, index keys,
//! shard numbers, and the SQL that reads and writes them.
//!
//! Layout:
//! - [`id`]: 16-byte entity ids and their text forms.
//! - [`value`]: property values and bags (JSON in, JSON out).
//! - [`codec`]: format byte + lz4 + bincode for bodies and events.
//! - [`event`]: the change event the outbox holds and Kafka carries.
//! - [`index`]: index specs, typed keys, multi-valued and partial indexes.
//! - [`filter`]: conditions and the re-filter that enforces Invariant R.
//! - [`shard`]: `shard_of`, the one routing function.
//! - [`names`]: the identifier rule that keeps SQL text safe.
//! - [`settings`]: typed `Settings` from TOML + `BAGSTORE_…` variables.
//! - [`ddl`] and [`store`]: table definitions and every SQL statement.
//! - [`conns`]: ping-free connections for the hot paths.
//! - [`kafka`]: shared client configuration, topics, consumer-group lag.
//! - [`web`]: problem+json, bounded bodies, `/metrics`, graceful serving.
//!
//! The model modules (`id` … `settings`) stay free of tokio, HTTP and SQL.

pub mod codec;
pub mod conns;
pub mod ddl;
pub mod event;
pub mod filter;
pub mod id;
pub mod index;
pub mod kafka;
pub mod names;
pub mod settings;
pub mod shard;
pub mod store;
pub mod value;
pub mod web;

pub use event::{ChangeEvent, Op};
pub use id::EntityId;
pub use index::{IndexKey, IndexSpec, KeyValue};
pub use settings::Settings;
pub use shard::shard_of;
pub use value::{Bag, Value};
