//! `Idempotency-Key`: what a key and a request hash to, and the entity id a
//! keyed `POST /v1/entities` without an id gets (derived from the key, so
//! a retry lands on the same entity and the same shard, where the key's
//! record is).

use crate::EntityId;
use xxhash_rust::xxh3::xxh3_128;

/// Longest accepted key.
pub const MAX_KEY_BYTES: usize = 255;

/// The key's checks: 1 to [`MAX_KEY_BYTES`] visible ASCII characters.
pub fn check_key(key: &str) -> Result<(), String> {
    if key.is_empty() || key.len() > MAX_KEY_BYTES || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!("Idempotency-Key must be 1 to {MAX_KEY_BYTES} visible ASCII characters"));
    }
    Ok(())
}

fn hash(domain: &str, parts: &[&[u8]]) -> [u8; 16] {
    let mut bytes = Vec::with_capacity(64);
    bytes.extend_from_slice(domain.as_bytes());
    for p in parts {
        // Length-prefixed, so no two different part lists share bytes.
        bytes.extend_from_slice(&(p.len() as u64).to_be_bytes());
        bytes.extend_from_slice(p);
    }
    xxh3_128(&bytes).to_be_bytes()
}

/// The stored form of a key.
pub fn key_hash(key: &str) -> [u8; 16] {
    hash("bagstore idempotency key", &[key.as_bytes()])
}

/// The stored form of a batch's key for its item at `index`: each item is
/// guarded on its own shard, in its own transaction.
pub fn item_key_hash(key: &str, index: usize) -> [u8; 16] {
    hash("bagstore idempotency key of a batch item", &[key.as_bytes(), &(index as u64).to_be_bytes()])
}

/// The id a keyed batch's item without an id gets.
pub fn item_entity_id(key: &str, index: usize) -> EntityId {
    EntityId(hash("bagstore entity id of a batch item", &[key.as_bytes(), &(index as u64).to_be_bytes()]))
}

/// What identifies a request under one key: the route and the body (its
/// canonical JSON), so the same key with another body is told apart.
pub fn request_hash(route: &str, body: &[u8]) -> [u8; 16] {
    hash("bagstore idempotent request", &[route.as_bytes(), body])
}

/// The id a keyed create without an id gets.
pub fn entity_id_for(key: &str) -> EntityId {
    EntityId(hash("bagstore entity id of key", &[key.as_bytes()]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_requests_and_ids_are_stable_and_distinct() {
        assert_eq!(key_hash("k1"), key_hash("k1"));
        assert_ne!(key_hash("k1"), key_hash("k2"));
        assert_eq!(entity_id_for("k1"), entity_id_for("k1"));
        assert_ne!(entity_id_for("k1").0, key_hash("k1"), "the id is not the stored key");
        assert_ne!(request_hash("POST", b"{}"), request_hash("POST", b"{ }"));
        assert_ne!(request_hash("a", b"bc"), request_hash("ab", b"c"));
        assert_ne!(item_key_hash("k1", 0), item_key_hash("k1", 1));
        assert_ne!(item_key_hash("k1", 0), key_hash("k1"), "a batch item's key is not a single write's");
        assert_ne!(item_entity_id("k1", 0), entity_id_for("k1"));
        assert_eq!(item_entity_id("k1", 3), item_entity_id("k1", 3));
        assert!(check_key("order-42").is_ok());
        for bad in ["", "with space", "tab\t", &"x".repeat(256), "é"] {
            assert!(check_key(bad).is_err(), "{bad:?}");
        }
    }
}
