//! Identifiers that end up in SQL text. Table and column names cannot be
//! bound parameters, so they come only from validated configuration: this
//! check is what keeps SQL injection out of the DDL and the index statements.

/// Tables bagstore owns on every shard; an index may not take these names.
pub const RESERVED_TABLES: &[&str] = &["entities", "outbox", "bagstore_indexes"];
/// Columns every index table has besides its property columns.
pub const RESERVED_COLUMNS: &[&str] = &["entity_id", "version"];

/// `[a-z][a-z0-9_]{0,63}`: at most 64 characters, MySQL's identifier limit.
pub fn is_valid_identifier(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b.len() <= 64
        && b[0].is_ascii_lowercase()
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_follow_the_documented_pattern() {
        assert!(is_valid_identifier("index_user_id"));
        assert!(is_valid_identifier(&"a".repeat(64)));
        for bad in ["", "Index", "1abc", "a-b", "a b", "a`b", "a;drop", &"a".repeat(65)] {
            assert!(!is_valid_identifier(bad), "{bad:?} accepted");
        }
    }
}
