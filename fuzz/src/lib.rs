//! What the fuzz targets share: a valid frame around raw bincode, and a few
//! index specs and bags to run the indexer's and reader's logic against.
//!
//! Targets (`fuzz_targets/`):
//! - `body_codec`: `codec::decode_body`, and encode → decode round trips.
//! - `event_decoder`: `ChangeEvent::decode`, round trips, and the index keys
//!   the indexer derives from a decoded event.
//! - `query_parser`: JSON → `schemas::query::parse` → `plan` → `Plan::admits`.

use schemas::codec::FORMAT_LZ4_BINCODE;
use schemas::{Bag, IndexSpec, Settings};
use std::sync::OnceLock;

/// `raw` as the payload of a well-formed blob (format byte, lz4 with size
/// prefix), so the fuzzer reaches the value decoder without having to learn
/// lz4 first.
pub fn framed(raw: &[u8]) -> Vec<u8> {
    let mut blob = vec![FORMAT_LZ4_BINCODE];
    blob.extend_from_slice(&lz4_flex::compress_prepend_size(raw));
    blob
}

const CONFIG: &str = r#"
[[indexes]]
table = "index_user_id"
properties = [{ name = "user_id", type = "uuid" }]

[[indexes]]
table = "index_user_published"
properties = [{ name = "user_id", type = "uuid" }, { name = "published", type = "int" }]
shard_on = "user_id"

[[indexes]]
table = "index_name"
properties = [{ name = "first_name", type = "string", max_len = 8 }, { name = "last_name", type = "string" }]
shard_on = "last_name"

[[indexes]]
table = "index_score"
properties = [{ name = "score", type = "float" }, { name = "ok", type = "bool" }]
match_on = { kind = "player" }

[[indexes]]
table = "index_tag"
properties = [{ name = "tags", type = "string", max_len = 64 }]
"#;

/// Every index type, a compound, a partial and a multi-valued index, in
/// the stable order the reader passes them to the planner.
pub fn specs() -> &'static [IndexSpec] {
    static SPECS: OnceLock<Vec<IndexSpec>> = OnceLock::new();
    SPECS.get_or_init(|| {
        let mut specs = Settings::from_toml_and_env(CONFIG, Vec::new()).expect("valid config").indexes;
        specs.sort_by(|a, b| a.table.cmp(&b.table));
        specs
    })
}

/// Entities a query's conditions are re-checked against.
pub fn bags() -> &'static [Bag] {
    static BAGS: OnceLock<Vec<Bag>> = OnceLock::new();
    BAGS.get_or_init(|| {
        [
            serde_json::json!({}),
            serde_json::json!({"user_id": "f48b0440ca0c4f66991c4d5f6a078eaf", "published": 7,
                               "title": "hello", "tags": ["a", "b", 3, null]}),
            serde_json::json!({"first_name": "Ada", "last_name": "Lovelace", "score": -0.5, "ok": true,
                               "kind": "player", "o": {"x": [1, 2.5]}}),
            serde_json::json!({"user_id": null, "published": 1.5, "tags": "solo", "score": 3}),
        ]
        .iter()
        .map(|j| schemas::value::bag_from_json(j).expect("sample bag"))
        .collect()
    })
}

/// Runs what the indexer does with a bag from an event: partial-index
/// check, key derivation and shard routing for every spec.
pub fn derive_keys(bag: &Bag) {
    for spec in specs() {
        let keys = spec.keys(bag);
        assert!(keys.len() <= schemas::index::MAX_KEYS_PER_ENTITY);
        assert!(keys.is_empty() || spec.matches_partial(bag));
        for k in &keys {
            assert_eq!(k.len(), spec.properties.len());
            assert!(spec.logical_of_key(k, 16) < 16);
        }
    }
}
