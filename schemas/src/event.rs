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
    /// The entity row's `added_id` (its clustered key on its shard, fixed
    /// for the life of the id), when the writer knew it: index rows carry
    /// it so a query reads the entity by its clustered key. A hint, checked
    /// on every use. Last, so events from before it existed still decode.
    pub added_id: Option<u64>,
}

/// The layout of events written before `added_id` existed (they may still
/// be in the topic, the outbox or a dead-letter queue when a new version
/// starts).
#[derive(Deserialize)]
struct ChangeEventV1 {
    id: EntityId,
    version: u64,
    op: Op,
    committed_at_us: i64,
    shard: u32,
    before: Option<Bag>,
    after: Option<Bag>,
}

impl ChangeEvent {
    pub fn encode(&self) -> Vec<u8> {
        codec::encode(self)
    }

    /// Decodes the current layout, else the one before `added_id`.
    pub fn decode(blob: &[u8]) -> Result<ChangeEvent, CodecError> {
        codec::decode(blob).or_else(|e| match codec::decode::<ChangeEventV1>(blob) {
            Ok(v1) => Ok(ChangeEvent {
                id: v1.id,
                version: v1.version,
                op: v1.op,
                committed_at_us: v1.committed_at_us,
                shard: v1.shard,
                before: v1.before,
                after: v1.after,
                added_id: None,
            }),
            Err(_) => Err(e),
        })
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
            added_id: Some(41),
        };
        assert_eq!(ChangeEvent::decode(&e.encode()).unwrap(), e);
        assert!(ChangeEvent::decode(b"\x01garbage").is_err());
    }

    /// The layout before `added_id`, as such events were encoded.
    #[derive(Serialize)]
    struct OldEvent<'a> {
        id: EntityId,
        version: u64,
        op: Op,
        committed_at_us: i64,
        shard: u32,
        before: Option<&'a Bag>,
        after: Option<&'a Bag>,
    }

    #[test]
    fn events_from_before_the_location_decode_without_it() {
        let bag = Bag::from([("n".into(), Value::Int(3))]);
        let id = EntityId::random();
        let old = OldEvent {
            id,
            version: 2,
            op: Op::Put,
            committed_at_us: 9,
            shard: 1,
            before: None,
            after: Some(&bag),
        };
        let e = ChangeEvent::decode(&codec::encode(&old)).unwrap();
        assert_eq!((e.id, e.version, e.shard, e.added_id), (id, 2, 1, None));
        assert_eq!(e.after, Some(bag));
    }
}
