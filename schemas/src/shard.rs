//! The one routing function. Every process, every version, every machine must
//! agree on it, so it is a fixed hash (xxh3-64 with seed 0) of canonical
//! bytes, never Rust's randomized `DefaultHasher`.
//!
//! Changing the shard count remaps keys; resharding is out of scope.

/// Which of `shards` shards owns `bytes` (an entity id, or the canonical
/// bytes of an index's `shard_on` value, see [`crate::index::KeyValue::canonical_bytes`]).
pub fn shard_of(bytes: &[u8], shards: usize) -> usize {
    assert!(shards > 0, "shard_of needs at least one shard");
    (xxhash_rust::xxh3::xxh3_64(bytes) % shards as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::id::EntityId;

    /// Committed vectors: if one of these changes, every stored entity and
    /// index row would be looked for on the wrong shard. Never edit them.
    /// Columns: input, xxh3-64, shard of 2, of 3, of 16.
    #[test]
    fn shard_of_matches_the_committed_vectors() {
        let id = EntityId::parse("71f0c4d2291844cca2df6f486e96e37c").unwrap();
        let user = EntityId::parse("f48b0440ca0c4f66991c4d5f6a078eaf").unwrap();
        let vectors: &[(&[u8], u64, [usize; 3])] = &[
            (b"", 0x2d06800538d394c2, [0, 1, 2]),
            (b"a", 0xe6c632b61e964e1f, [1, 1, 15]),
            (b"bagstore", 0x472e17956383aae3, [1, 1, 3]),
            (b"http://friendfeed.com/", 0x12f6836e1e1db669, [1, 2, 9]),
            (id.as_bytes(), 0x7f1c9b6f31654504, [0, 2, 4]),
            (user.as_bytes(), 0x8441d1440f54f129, [1, 0, 9]),
            (&42i64.to_be_bytes(), 0x2e4fe982b68910ac, [0, 2, 12]),
        ];
        for (bytes, hash, shards) in vectors {
            assert_eq!(xxhash_rust::xxh3::xxh3_64(bytes), *hash, "hash of {bytes:?}");
            assert_eq!([shard_of(bytes, 2), shard_of(bytes, 3), shard_of(bytes, 16)], *shards, "{bytes:?}");
        }
    }

    #[test]
    fn one_shard_takes_everything() {
        assert_eq!(shard_of(b"anything", 1), 0);
    }
}
