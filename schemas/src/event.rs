//! The change event: what the writer puts in the outbox and the relay
//! publishes to Kafka (key = entity id, so one entity's events share a
//! partition and stay in version order).

use serde::{Deserialize, Serialize};

use crate::codec::{self, CodecError};
use crate::id::EntityId;
use crate::value::Bag;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    Put,
    Delete,
}

/// One committed write. `before` and `after` carry the whole property bags
/// so the indexer can remove the old rows, wherever they live, without
/// reading the entity back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChangeEvent {
    pub id: EntityId,
    pub version: u64,
    pub op: Op,
    /// Commit time, microseconds since the Unix epoch.
    pub committed_at_us: i64,
    /// The shard whose outbox held the event.
    pub shard: u32,
    /// `None` when the entity did not exist (or was deleted) before.
    pub before: Option<Bag>,
    /// `None` for a delete.
    pub after: Option<Bag>,
}

impl ChangeEvent {
    pub fn encode(&self) -> Vec<u8> {
        codec::encode(self)
    }

    pub fn decode(blob: &[u8]) -> Result<ChangeEvent, CodecError> {
        codec::decode(blob)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::Value;

    #[test]
    fn events_round_trip() {
        let e = ChangeEvent {
            id: EntityId::random(),
            version: 7,
            op: Op::Put,
            committed_at_us: 1_700_000_000_123_456,
            shard: 1,
            before: None,
            after: Some(Bag::from([("title".into(), Value::String("x".into()))])),
        };
        assert_eq!(ChangeEvent::decode(&e.encode()).unwrap(), e);
        assert!(ChangeEvent::decode(b"\x01garbage").is_err());
    }
}
