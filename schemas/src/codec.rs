//! Body and event encoding: one format byte, then lz4 (size-prepended) of
//! bincode. The format byte lets the encoding change later without rewriting
//! stored rows: a reader dispatches on it.
//!
//! Decoding treats its input as hostile (a Kafka event or a stored body may
//! be corrupt or crafted): every failure is a [`CodecError`], never a panic,
//! an unbounded allocation or a deep recursion. Values nested deeper than
//! [`crate::value::MAX_DEPTH`] and non-finite floats are refused (see
//! `value.rs`), so whatever decodes also re-encodes and decodes to itself.

use bincode::Options;
use serde::{de::DeserializeOwned, Serialize};

use crate::value::Bag;

/// Format 1: lz4_flex block with a little-endian u32 size prefix, holding
/// bincode (varint integers) of the value.
pub const FORMAT_LZ4_BINCODE: u8 = 1;

/// Refuse to inflate anything larger than this: a corrupt or hostile size
/// prefix must not make us allocate gigabytes.
pub const MAX_DECODED_BYTES: usize = 64 << 20;

/// An lz4 block never inflates more than this many times (one extra length
/// byte adds at most 255 output bytes), so a larger declared size is a lie
/// told to make us allocate; it is refused before allocating.
const MAX_LZ4_RATIO: usize = 255;

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("empty blob")]
    Empty,
    #[error("unknown format byte {0}")]
    UnknownFormat(u8),
    #[error("declared size {0} exceeds the {MAX_DECODED_BYTES} byte limit")]
    TooLarge(usize),
    #[error("declared size {declared} cannot come from {compressed} bytes of lz4")]
    Implausible { declared: usize, compressed: usize },
    #[error("lz4 block is corrupt")]
    Lz4(#[source] lz4_flex::block::DecompressError),
    #[error("lz4 block inflates to {actual} bytes, not the declared {declared}")]
    LengthMismatch { declared: usize, actual: usize },
    #[error("bincode payload is corrupt")]
    Bincode(#[source] bincode::Error),
}

fn options() -> impl Options {
    bincode::DefaultOptions::new().with_limit(MAX_DECODED_BYTES as u64)
}

pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    let raw =
        options().serialize(value).expect("bincode cannot fail on in-memory values under the size limit");
    let mut out = Vec::with_capacity(raw.len() / 2 + 8);
    out.push(FORMAT_LZ4_BINCODE);
    out.extend_from_slice(&lz4_flex::compress_prepend_size(&raw));
    out
}

pub fn decode<T: DeserializeOwned>(blob: &[u8]) -> Result<T, CodecError> {
    let (&format, rest) = blob.split_first().ok_or(CodecError::Empty)?;
    if format != FORMAT_LZ4_BINCODE {
        return Err(CodecError::UnknownFormat(format));
    }
    let declared = rest
        .get(..4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .ok_or(CodecError::Lz4(lz4_flex::block::DecompressError::ExpectedAnotherByte))?;
    if declared > MAX_DECODED_BYTES {
        return Err(CodecError::TooLarge(declared));
    }
    let compressed = rest.len() - 4;
    if declared > compressed.saturating_mul(MAX_LZ4_RATIO) {
        return Err(CodecError::Implausible { declared, compressed });
    }
    let raw = lz4_flex::decompress_size_prepended(rest).map_err(CodecError::Lz4)?;
    // Our encoder always declares the exact size; anything else is damage.
    if raw.len() != declared {
        return Err(CodecError::LengthMismatch { declared, actual: raw.len() });
    }
    options().deserialize(&raw).map_err(CodecError::Bincode)
}

pub fn encode_body(bag: &Bag) -> Vec<u8> {
    encode(bag)
}

pub fn decode_body(blob: &[u8]) -> Result<Bag, CodecError> {
    decode(blob)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{ChangeEvent, Op};
    use crate::id::{hex, EntityId};
    use crate::value::{bag_from_json, Value, MAX_DEPTH};

    #[test]
    fn bodies_round_trip() {
        let bag = bag_from_json(&serde_json::json!({
            "title": "We just launched a new backend system for FriendFeed!",
            "n": 3, "f": -0.25, "tags": ["a", "b"], "o": {"x": null}
        }))
        .unwrap();
        let blob = encode_body(&bag);
        assert_eq!(blob[0], FORMAT_LZ4_BINCODE);
        assert_eq!(decode_body(&blob).unwrap(), bag);
    }

    #[test]
    fn corrupt_blobs_are_errors_not_panics() {
        let blob = encode_body(&Bag::from([("k".into(), Value::Int(1))]));
        assert!(matches!(decode_body(&[]), Err(CodecError::Empty)));
        assert!(matches!(decode_body(&[9, 0]), Err(CodecError::UnknownFormat(9))));
        assert!(matches!(decode_body(&[1, 0xff, 0xff, 0xff, 0x7f]), Err(CodecError::TooLarge(_))));
        for cut in 1..blob.len() {
            assert!(decode_body(&blob[..cut]).is_err());
        }
    }

    fn sample() -> Bag {
        bag_from_json(&serde_json::json!({
            "title": "We just launched a new backend system for FriendFeed!",
            "n": -3, "f": 0.25, "ok": true, "none": null,
            "tags": ["a", 7, [false, {"deep": []}]],
            "o": {"x": {"y": 1e100}}
        }))
        .unwrap()
    }

    fn unhex(s: &str) -> Vec<u8> {
        crate::id::unhex(s).expect("hex")
    }

    /// The bincode of [`sample`], as the derived `Deserialize` era wrote it
    /// (`Serialize` is still derived). The stored format must never drift:
    /// rows written years ago must decode.
    const SAMPLE_BINCODE: &str = concat!(
        "07016603000000000000d03f016e0205046e6f6e6500016f0601017806010179037dc39425ad49b254026f6b0101",
        "04746167730503040161020e05020100060104646565700500057469746c6504355765206a757374206c61756e",
        "636865642061206e6577206261636b656e642073797374656d20666f7220467269656e644665656421",
    );
    /// A whole stored body (format byte + lz4) of [`sample`] from that era.
    const SAMPLE_BLOB: &str = concat!(
        "01840000005107016603000100f06bd03f016e0205046e6f6e6500016f0601017806010179037dc39425ad49b2",
        "54026f6b010104746167730503040161020e05020100060104646565700500057469746c6504355765206a757374",
        "206c61756e636865642061206e6577206261636b656e642073797374656d20666f7220467269656e644665656421",
    );

    #[test]
    fn the_stored_format_is_unchanged() {
        assert_eq!(hex(&options().serialize(&sample()).unwrap()), SAMPLE_BINCODE);
        assert_eq!(decode_body(&unhex(SAMPLE_BLOB)).unwrap(), sample());
        assert_eq!(decode_body(&encode_body(&sample())).unwrap(), sample());
    }

    /// `levels` arrays and objects around `null`, built without `from_json`
    /// (which refuses too deep) and without recursion.
    fn nested(levels: usize) -> Value {
        let mut v = Value::Null;
        for i in 0..levels {
            v = if i % 3 == 2 { Value::Object(Bag::from([("k".into(), v)])) } else { Value::Array(vec![v]) };
        }
        v
    }

    fn event_with(after: Bag) -> ChangeEvent {
        ChangeEvent {
            id: EntityId([7; 16]),
            version: 2,
            op: Op::Put,
            committed_at_us: 1_700_000_000_000_000,
            shard: 0,
            before: Some(Bag::from([("k".into(), Value::Int(1))])),
            after: Some(after),
            added_id: None,
        }
    }

    #[test]
    fn values_nested_to_the_limit_round_trip_and_one_level_more_is_an_error() {
        let at_limit = Bag::from([("a".into(), Value::Int(1)), ("deep".into(), nested(MAX_DEPTH))]);
        assert_eq!(decode_body(&encode_body(&at_limit)).unwrap(), at_limit);
        let e = event_with(at_limit);
        assert_eq!(ChangeEvent::decode(&e.encode()).unwrap(), e);

        let too_deep = Bag::from([("deep".into(), nested(MAX_DEPTH + 1))]);
        let err = decode_body(&encode_body(&too_deep)).unwrap_err();
        assert!(matches!(err, CodecError::Bincode(_)), "{err:?}");
        assert!(format!("{:#}", anyhow::Error::new(err)).contains("nest deeper than 128 levels"));
        assert!(ChangeEvent::decode(&event_with(too_deep).encode()).is_err());
    }

    /// A bag `{"k": …}` whose value nests `levels` times, in raw bincode:
    /// each array level is tag 5 + length 1, each object level tag 6 +
    /// one member with an empty name.
    fn hostile_bincode(levels: usize, objects: bool) -> Vec<u8> {
        let per_level: &[u8] = if objects { &[6, 1, 0] } else { &[5, 1] };
        let mut raw = vec![1, 1, b'k'];
        for _ in 0..levels {
            raw.extend_from_slice(per_level);
        }
        raw.push(0);
        raw
    }

    #[test]
    fn a_hostile_blob_nested_millions_of_levels_is_an_error_not_a_stack_overflow() {
        for objects in [false, true] {
            let raw = hostile_bincode(3_000_000, objects);
            let mut blob = vec![FORMAT_LZ4_BINCODE];
            blob.extend_from_slice(&lz4_flex::compress_prepend_size(&raw));
            assert!(blob.len() < 64 * 1024, "tiny on the wire: {} bytes", blob.len());
            assert!(matches!(decode_body(&blob), Err(CodecError::Bincode(_))));
            // The same nesting inside an event's `after`, which comes next
            // to last: replace its `Some(empty map)` (bytes 1, 0), keeping
            // the `added_id` `None` (0) after it.
            let mut ev = options().serialize(&event_with(Bag::new())).unwrap();
            assert_eq!(ev[ev.len() - 3..], [1, 0, 0]);
            ev.truncate(ev.len() - 2);
            ev.extend_from_slice(&raw);
            ev.push(0);
            let mut blob = vec![FORMAT_LZ4_BINCODE];
            blob.extend_from_slice(&lz4_flex::compress_prepend_size(&ev));
            assert!(matches!(ChangeEvent::decode(&blob), Err(CodecError::Bincode(_))));
        }
        // The same construction at the limit is a valid body: the test
        // above really builds nesting, not garbage.
        let mut blob = vec![FORMAT_LZ4_BINCODE];
        blob.extend_from_slice(&lz4_flex::compress_prepend_size(&hostile_bincode(MAX_DEPTH, true)));
        assert!(decode_body(&blob).is_ok());
    }

    #[test]
    fn non_finite_floats_are_refused() {
        for f in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let bag = Bag::from([("f".into(), Value::Array(vec![Value::Float(f)]))]);
            assert!(matches!(decode_body(&encode_body(&bag)), Err(CodecError::Bincode(_))));
        }
    }

    #[test]
    fn size_prefixes_that_lie_are_refused_before_allocating() {
        // 1 MiB declared from 3 bytes of lz4.
        let blob = [FORMAT_LZ4_BINCODE, 0, 0, 0x10, 0, 0x10, 0x41, 0];
        assert!(matches!(decode_body(&blob), Err(CodecError::Implausible { declared: 0x10_0000, .. })));
        // A declared size larger than what the block holds.
        let mut blob = encode_body(&sample());
        let declared = u32::from_le_bytes([blob[1], blob[2], blob[3], blob[4]]) + 1;
        blob[1..5].copy_from_slice(&declared.to_le_bytes());
        assert!(matches!(decode_body(&blob), Err(CodecError::LengthMismatch { .. })));
    }
}
