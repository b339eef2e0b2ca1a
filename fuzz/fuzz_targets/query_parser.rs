//! A query body (any bytes; the reader parses JSON first) either becomes a
//! query or a 4xx problem, never a panic. A parsed query respects the
//! limits, and planning it against a set of indexes, and re-filtering
//! sample entities with its conditions (Invariant R's check), cannot panic.

#![no_main]

use bagstore_fuzz::{bags, specs};
use libfuzzer_sys::fuzz_target;
use reader::query::{parse, plan};
use schemas::filter::bag_matches;
use schemas::settings::ReaderSettings;

fuzz_target!(|data: &[u8]| {
    let Ok(doc) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    let settings = ReaderSettings::default();
    let q = match parse(doc, &settings) {
        Ok(q) => q,
        Err(p) => {
            assert!(p.status.is_client_error(), "parse answered {}", p.status);
            return;
        }
    };
    assert!((1..=settings.max_limit).contains(&q.limit));
    assert!(q.consistent_with.len() <= settings.max_in);
    for c in q.conditions.values() {
        assert!(c.values().len() <= settings.max_in);
    }
    for bag in bags() {
        bag_matches(bag, q.conditions.iter().map(|(k, c)| (k.as_str(), c)));
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
                    for prop in &p.spec.properties {
                        if let Some(c) = q.conditions.get(&prop.name) {
                            c.matches_typed(prop, bag.get(&prop.name));
                        }
                    }
                }
            }
            Err(e) => assert!(e.status.is_client_error(), "plan answered {}", e.status),
        }
    }
});
