//! A query body (any bytes; the reader parses JSON first) either becomes a
//! query or a `QueryError` (which the reader answers with a 400), never a
//! panic. A parsed query respects the limits, and planning it against a set
//! of indexes, and re-filtering sample entities with the reader's own
//! re-filter (`Plan::admits`, Invariant R's check), cannot panic.

#![no_main]

use bagstore_fuzz::{bags, specs};
use libfuzzer_sys::fuzz_target;
use schemas::query::{parse, plan};
use schemas::settings::ReaderSettings;

fuzz_target!(|data: &[u8]| {
    let Ok(doc) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    let settings = ReaderSettings::default();
    let Ok(q) = parse(doc, &settings) else { return };
    assert!((1..=settings.max_limit).contains(&q.limit));
    assert!(q.consistent_with.len() <= settings.max_in);
    for c in q.conditions.values() {
        assert!(c.values().len() <= settings.max_in);
    }
    // All indexes, then each one alone (so every index gets planned).
    let all = specs();
    for candidates in std::iter::once(all).chain(all.chunks(1)) {
        match plan(&q, candidates, &settings) {
            Ok(p) => {
                assert!(p.prefixes.len() <= settings.max_in);
                assert!(p.prefix_len <= p.spec.properties.len());
                assert!(p.range.is_none() || p.prefix_len < p.spec.properties.len());
                for key in &p.prefixes {
                    assert_eq!(key.len(), p.prefix_len);
                }
                for bag in bags() {
                    // An entity the re-filter admits is in the index (it has
                    // keys) only with a key this scan covers: the key a
                    // page counts it under.
                    if p.admits(&q, bag) && !p.spec.keys(bag).is_empty() {
                        assert!(p.canonical_key(bag).is_some(), "admitted but not covered: {bag:?}");
                    }
                }
            }
            Err(_) => {}
        }
    }
});
