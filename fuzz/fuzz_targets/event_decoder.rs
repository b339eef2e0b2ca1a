//! `ChangeEvent::decode` turns any bytes into an event or a `CodecError`
//! (the indexer dead-letters those): never a panic, a stack overflow or a
//! runaway allocation. A decoded event re-encodes to itself, and deriving
//! its index keys (what the indexer does next) cannot panic either.
//!
//! Each input is tried as a whole Kafka payload, and as a bincode payload in
//! a valid frame so the fuzzer explores the event decoder directly.

#![no_main]

use bagstore_fuzz::{derive_keys, framed};
use libfuzzer_sys::fuzz_target;
use schemas::ChangeEvent;

fn check(blob: &[u8]) {
    let Ok(event) = ChangeEvent::decode(blob) else { return };
    let again = ChangeEvent::decode(&event.encode()).expect("a re-encoded event decodes");
    assert_eq!(again, event, "encode → decode changed an event");
    for bag in [&event.before, &event.after].into_iter().flatten() {
        derive_keys(bag);
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    check(&framed(data));
});
