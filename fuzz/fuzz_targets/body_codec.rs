//! `codec::decode_body` turns any bytes into a bag or a `CodecError`: never
//! a panic, a stack overflow or a runaway allocation. Whatever decodes must
//! survive encode → decode unchanged, and the JSON the reader would answer
//! with must parse back to the same bag (a client can PUT what it GETs).
//!
//! Each input is tried as a whole stored blob, and as a bincode payload in
//! a valid frame so the fuzzer explores the value decoder directly.

#![no_main]

use bagstore_fuzz::framed;
use libfuzzer_sys::fuzz_target;
use schemas::codec::{decode_body, encode_body};
use schemas::value::{bag_from_json, bag_to_json_map};

fn check(blob: &[u8]) {
    let Ok(bag) = decode_body(blob) else { return };
    let again = decode_body(&encode_body(&bag)).expect("a re-encoded body decodes");
    assert_eq!(again, bag, "encode → decode changed a body");
    let json = serde_json::Value::Object(bag_to_json_map(&bag));
    let text = serde_json::to_vec(&json).expect("JSON serializes");
    let parsed: serde_json::Value = serde_json::from_slice(&text).expect("our JSON parses");
    assert_eq!(bag_from_json(&parsed).expect("a decoded body is a storable bag"), bag);
}

fuzz_target!(|data: &[u8]| {
    check(data);
    check(&framed(data));
});
