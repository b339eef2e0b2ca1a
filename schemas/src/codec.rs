//! Body and event encoding: one format byte, then lz4 (size-prepended) of
//! bincode. The format byte lets the encoding change later without rewriting
//! stored rows: a reader dispatches on it.

use bincode::Options;
use serde::{de::DeserializeOwned, Serialize};

use crate::value::Bag;

/// Format 1: lz4_flex block with a little-endian u32 size prefix, holding
/// bincode (varint integers) of the value.
pub const FORMAT_LZ4_BINCODE: u8 = 1;

/// Refuse to inflate anything larger than this: a corrupt or hostile size
/// prefix must not make us allocate gigabytes.
pub const MAX_DECODED_BYTES: usize = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("empty blob")]
    Empty,
    #[error("unknown format byte {0}")]
    UnknownFormat(u8),
    #[error("declared size {0} exceeds the {MAX_DECODED_BYTES} byte limit")]
    TooLarge(usize),
    #[error("lz4 block is corrupt")]
    Lz4(#[source] lz4_flex::block::DecompressError),
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
    let raw = lz4_flex::decompress_size_prepended(rest).map_err(CodecError::Lz4)?;
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
    use crate::value::{bag_from_json, Value};

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
}
