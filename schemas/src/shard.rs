//! The one routing function: which *logical* shard owns a key. Every
//! process, every version, every machine must agree on it, so it is a fixed
//! hash (xxh3-64 with seed 0) of canonical bytes, never Rust's randomized
//! `DefaultHasher`, modulo the cluster's fixed number of logical shards.
//!
//! A key's logical shard never changes. Which physical shard (MySQL server)
//! holds a logical shard is the cluster's map ([`crate::topology`]), kept in
//! the database and changed only by moving whole logical shards.

/// Logical shards of a new cluster: many more than there will ever be
/// servers (Uber Schemaless and Pinterest use 4096), so capacity grows by
/// moving whole logical shards, each a small slice (1/4096) of the data,
/// with a short cutover; a power of two so that any power-of-two server
/// count gets an exactly even share.
pub const DEFAULT_LOGICAL_SHARDS: u16 = 4096;

/// Which of `logical_shards` logical shards owns `bytes` (an entity id, or
/// the canonical bytes of an index's `shard_on` value: the index module
/// routes its keys through here).
pub fn logical_of(bytes: &[u8], logical_shards: u16) -> u16 {
    assert!(logical_shards > 0, "logical_of needs at least one logical shard");
    (xxhash_rust::xxh3::xxh3_64(bytes) % u64::from(logical_shards)) as u16
}

/// The physical shard, by position `0..n` in the configuration, holding
/// `bytes` in a cluster made with `n` shards and the default number of
/// logical shards, before any move ([`crate::topology::Topology::even`]
/// gives logical shard k to position k mod n). For tests and benchmarks that
/// place or look up rows by hand; services route with the map.
pub fn initial_position_of(bytes: &[u8], n: usize) -> usize {
    logical_of(bytes, DEFAULT_LOGICAL_SHARDS) as usize % n
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::id::EntityId;

    /// Committed vectors: if one of these changes, every stored entity and
    /// index row would be looked for in the wrong logical shard. Never edit
    /// them. Columns: input, xxh3-64, logical shard of 4096, of 3072, of 16.
    #[test]
    fn logical_of_matches_the_committed_vectors() {
        let id = EntityId::parse("71f0c4d2291844cca2df6f486e96e37c").unwrap();
        let user = EntityId::parse("f48b0440ca0c4f66991c4d5f6a078eaf").unwrap();
        let vectors: &[(&[u8], u64, [u16; 3])] = &[
            (b"", 0x2d06800538d394c2, [1218, 2242, 2]),
            (b"a", 0xe6c632b61e964e1f, [3615, 1567, 15]),
            (b"bagstore", 0x472e17956383aae3, [2787, 739, 3]),
            (b"http://friendfeed.com/", 0x12f6836e1e1db669, [1641, 617, 9]),
            (id.as_bytes(), 0x7f1c9b6f31654504, [1284, 260, 4]),
            (user.as_bytes(), 0x8441d1440f54f129, [297, 297, 9]),
            (&42i64.to_be_bytes(), 0x2e4fe982b68910ac, [172, 1196, 12]),
        ];
        for (bytes, hash, logical) in vectors {
            assert_eq!(xxhash_rust::xxh3::xxh3_64(bytes), *hash, "hash of {bytes:?}");
            let got = [logical_of(bytes, 4096), logical_of(bytes, 3072), logical_of(bytes, 16)];
            assert_eq!(got, *logical, "{bytes:?}");
        }
    }

    /// Why an upgrade keeps every row where it is: with N physical shards
    /// and N dividing L, logical shard k on physical shard k mod N puts a
    /// key exactly where the old `hash mod N` routing did.
    #[test]
    fn k_mod_n_reproduces_hash_mod_n_when_n_divides_l() {
        for bytes in [&b"a"[..], b"bagstore", b"", &[7u8; 16]] {
            let h = xxhash_rust::xxh3::xxh3_64(bytes);
            for n in [1u64, 2, 4, 8] {
                assert_eq!(u64::from(logical_of(bytes, 4096)) % n, h % n);
            }
            assert_eq!(u64::from(logical_of(bytes, 3072)) % 3, h % 3);
        }
    }
}
