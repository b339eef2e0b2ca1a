//! Entity ids: 16 bytes, accepted as 32 hex digits or a dashed UUID, always
//! written back as 32 lowercase hex digits.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The 16-byte key of an entity (`BINARY(16)` in every table).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct EntityId(pub [u8; 16]);

/// Why a string is not an entity id (or a uuid-typed property value).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{input:?} is not a valid id: expected 32 hex digits or a dashed UUID")]
pub struct BadId {
    pub input: String,
}

impl EntityId {
    /// A fresh random (version 4) id.
    pub fn random() -> Self {
        EntityId(*uuid::Uuid::new_v4().as_bytes())
    }

    /// Parses 32 hex digits (any case) or the dashed 8-4-4-4-12 form.
    pub fn parse(s: &str) -> Result<Self, BadId> {
        let ok = match s.len() {
            32 => s.bytes().all(|b| b.is_ascii_hexdigit()),
            36 => s.bytes().enumerate().all(|(i, b)| match i {
                8 | 13 | 18 | 23 => b == b'-',
                _ => b.is_ascii_hexdigit(),
            }),
            _ => false,
        };
        if !ok {
            return Err(BadId { input: s.chars().take(64).collect() });
        }
        uuid::Uuid::try_parse(s).map(|u| EntityId(*u.as_bytes())).map_err(|_| BadId { input: s.to_string() })
    }

    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        <[u8; 16]>::try_from(bytes).ok().map(EntityId)
    }

    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// 32 lowercase hex digits, the only form bagstore ever returns.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

/// Lowercase hex of `bytes`, two digits a byte, in one allocation (the
/// reader writes an id per item and a page token per page).
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    out
}

/// The bytes of a hex string (either case), or `None` if it is not one:
/// the one hex decoder (page tokens, test and bench ids).
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    fn digit(c: u8) -> Option<u8> {
        (c as char).to_digit(16).map(|d| d as u8)
    }
    let b = s.as_bytes();
    if !b.len().is_multiple_of(2) {
        return None;
    }
    b.chunks(2).map(|p| Some(digit(p[0])? << 4 | digit(p[1])?)).collect()
}

impl fmt::Display for EntityId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for EntityId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EntityId({})", self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_and_dashed_forms_name_the_same_id() {
        let a = EntityId::parse("71f0c4d2291844cca2df6f486e96e37c").unwrap();
        let b = EntityId::parse("71F0C4D2-2918-44CC-A2DF-6F486E96E37C").unwrap();
        assert_eq!(a, b);
        assert_eq!(b.to_string(), "71f0c4d2291844cca2df6f486e96e37c");
    }

    #[test]
    fn unhex_reads_what_hex_writes_and_nothing_else() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(unhex(&hex(&bytes)), Some(bytes));
        assert_eq!(unhex("0aFf"), Some(vec![0x0a, 0xff]));
        for bad in ["0", "0g", "zz", "+1"] {
            assert_eq!(unhex(bad), None, "{bad}");
        }
    }

    #[test]
    fn hex_writes_every_byte_as_two_lowercase_digits() {
        let all: Vec<u8> = (0..=255).collect();
        let want: String = all.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex(&all), want);
        let id = EntityId::parse("00ff10a09b3c4d5e6f708192a3b4c5d6").unwrap();
        assert_eq!(id.to_hex(), uuid::Uuid::from_bytes(id.0).simple().to_string());
    }

    #[test]
    fn malformed_ids_are_rejected() {
        for bad in [
            "",
            "71f0c4d2",
            "71f0c4d2291844cca2df6f486e96e37g",
            "{71f0c4d2-2918-44cc-a2df-6f486e96e37c}",
            "71f0c4d2-291844cc-a2df-6f486e96e37c0",
            "urn:uuid:71f0c4d2-2918-44cc-a2df-6f486e96e37c",
        ] {
            assert!(EntityId::parse(bad).is_err(), "{bad} accepted");
        }
    }
}
