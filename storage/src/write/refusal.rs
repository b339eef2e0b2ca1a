//! A guarded write's refusal, as its idempotency record keeps it.

use schemas::expiry::BadExpiry;
use schemas::patch::PatchClash;

use super::WriteError;

/// A refusal as a guarded write records it: a retry under the same key is
/// refused the same way, whatever the entity became meanwhile (a Kafka
/// ingest command redelivered after a crash must not apply where it was
/// refused, nor answer differently).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub(super) enum Refusal {
    VersionConflict { expected: u64, actual: Option<u64> },
    AlreadyExists { current: u64 },
    NotFound,
    PatchClash { property: String, reason: String },
    TooLarge { bytes: usize, max: usize },
    BadExpiry { property: String, found: String },
    UniqueViolation { index: String, existing_id: String },
}

impl Refusal {
    /// The record of `e`; None for what is not a refusal of this write
    /// (storage failures, a reused key, an expiry's "not expired").
    pub(super) fn record(e: &WriteError) -> Option<String> {
        let r = match e {
            WriteError::VersionConflict { expected, actual } => {
                Refusal::VersionConflict { expected: *expected, actual: *actual }
            }
            WriteError::AlreadyExists { current } => Refusal::AlreadyExists { current: *current },
            WriteError::NotFound => Refusal::NotFound,
            WriteError::PatchClash(c) => {
                Refusal::PatchClash { property: c.property.clone(), reason: c.reason.clone() }
            }
            WriteError::TooLarge { bytes, max } => Refusal::TooLarge { bytes: *bytes, max: *max },
            WriteError::BadExpiry(b) => {
                Refusal::BadExpiry { property: b.property.clone(), found: b.found.clone() }
            }
            WriteError::UniqueViolation { index, existing_id } => {
                Refusal::UniqueViolation { index: index.clone(), existing_id: existing_id.to_hex() }
            }
            _ => return None,
        };
        serde_json::to_string(&r).ok()
    }

    /// The refusal a record holds (None if it does not parse: then the
    /// write is decided again).
    pub(super) fn replay(recorded: &str) -> Option<WriteError> {
        Some(match serde_json::from_str(recorded).ok()? {
            Refusal::VersionConflict { expected, actual } => WriteError::VersionConflict { expected, actual },
            Refusal::AlreadyExists { current } => WriteError::AlreadyExists { current },
            Refusal::NotFound => WriteError::NotFound,
            Refusal::PatchClash { property, reason } => {
                WriteError::PatchClash(PatchClash { property, reason })
            }
            Refusal::TooLarge { bytes, max } => WriteError::TooLarge { bytes, max },
            Refusal::BadExpiry { property, found } => WriteError::BadExpiry(BadExpiry { property, found }),
            Refusal::UniqueViolation { index, existing_id } => WriteError::UniqueViolation {
                index,
                existing_id: schemas::EntityId::parse(&existing_id).ok()?,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refusal_replays_as_it_was_recorded_and_other_errors_are_not_recorded() {
        let refusals = [
            WriteError::VersionConflict { expected: 3, actual: None },
            WriteError::AlreadyExists { current: 7 },
            WriteError::NotFound,
            WriteError::PatchClash(PatchClash { property: "n".into(), reason: "not a number".into() }),
            WriteError::TooLarge { bytes: 10, max: 5 },
            WriteError::BadExpiry(BadExpiry { property: "expires_at".into(), found: "\"soon\"".into() }),
            WriteError::UniqueViolation {
                index: "index_email".into(),
                existing_id: schemas::EntityId([9; 16]),
            },
        ];
        for e in refusals {
            let record = Refusal::record(&e).unwrap_or_else(|| panic!("{e:?} is not recorded"));
            let again = Refusal::replay(&record).expect("a record replays");
            assert_eq!(format!("{again:?}"), format!("{e:?}"));
        }
        for e in [WriteError::KeyReused, WriteError::NotExpired] {
            assert!(Refusal::record(&e).is_none(), "{e:?} was recorded");
        }
        // A record this version cannot read is decided again, not replayed.
        assert!(Refusal::replay(r#"{"kind": "from-the-future"}"#).is_none());
    }
}
