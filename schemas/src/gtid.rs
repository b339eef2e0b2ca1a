//! MariaDB global transaction ids and positions, as replication reports
//! them (`@@gtid_current_pos`, `Gtid_IO_Pos`): `domain-server-sequence`,
//! one per replication domain, comma-separated (`0-1-42,1-3-7`).
//!
//! A position says, per domain, the last transaction a server holds; in
//! one domain sequence numbers only grow (GTID strict mode refuses
//! anything else), so "holds at least what the other holds" is a
//! comparison of sequence numbers domain by domain. Failover picks the
//! replica whose position includes every other's.

use std::collections::BTreeMap;
use std::fmt;

/// One transaction's id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Gtid {
    pub domain: u32,
    pub server: u32,
    pub seq: u64,
}

/// A position: per domain, the last transaction held.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GtidPos {
    by_domain: BTreeMap<u32, Gtid>,
}

/// A position MariaDB would not have written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text:?} is not a GTID position (domain-server-sequence, comma-separated)")]
pub struct BadGtid {
    pub text: String,
}

impl GtidPos {
    /// Parses `0-1-42,1-3-7`; the empty string is the empty position.
    pub fn parse(text: &str) -> Result<GtidPos, BadGtid> {
        let bad = || BadGtid { text: text.to_string() };
        let mut by_domain = BTreeMap::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let mut it = part.split('-');
            let (Some(d), Some(s), Some(q), None) = (it.next(), it.next(), it.next(), it.next()) else {
                return Err(bad());
            };
            let g = Gtid {
                domain: d.parse().map_err(|_| bad())?,
                server: s.parse().map_err(|_| bad())?,
                seq: q.parse().map_err(|_| bad())?,
            };
            if by_domain.insert(g.domain, g).is_some() {
                return Err(bad());
            }
        }
        Ok(GtidPos { by_domain })
    }

    pub fn is_empty(&self) -> bool {
        self.by_domain.is_empty()
    }

    /// Whether this position holds everything `other` holds: in every
    /// domain of `other`, a sequence number at least as high.
    pub fn includes(&self, other: &GtidPos) -> bool {
        other.by_domain.iter().all(|(d, g)| self.by_domain.get(d).is_some_and(|mine| mine.seq >= g.seq))
    }

    /// [`GtidPos::includes`], and where a domain's sequence numbers are
    /// equal, the very transaction (the same server id): a server whose
    /// history forked (a former primary's tail no replica acknowledged,
    /// not yet truncated) can hold another transaction under the number
    /// its shard's new primary gave one of its own.
    pub fn holds(&self, other: &GtidPos) -> bool {
        other.by_domain.iter().all(|(d, g)| {
            self.by_domain
                .get(d)
                .is_some_and(|mine| mine.seq > g.seq || (mine.seq == g.seq && mine.server == g.server))
        })
    }

    /// Transactions `other` holds beyond this position, summed over the
    /// domains (0 when this one includes it): how far behind this is.
    pub fn behind(&self, other: &GtidPos) -> u64 {
        other
            .by_domain
            .iter()
            .map(|(d, g)| g.seq.saturating_sub(self.by_domain.get(d).map_or(0, |m| m.seq)))
            .sum()
    }
}

impl fmt::Display for GtidPos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for g in self.by_domain.values() {
            if !first {
                f.write_str(",")?;
            }
            first = false;
            write!(f, "{}-{}-{}", g.domain, g.server, g.seq)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_parse_and_print_back() {
        for text in ["", "0-1-42", "0-1-42,1-3-7"] {
            assert_eq!(GtidPos::parse(text).unwrap().to_string(), text);
        }
        assert_eq!(GtidPos::parse(" 1-3-7 , 0-1-42").unwrap().to_string(), "0-1-42,1-3-7");
        for bad in ["0-1", "0-1-2-3", "a-1-2", "0-1-2,0-2-3", "0--2"] {
            assert!(GtidPos::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn a_position_includes_another_by_sequence_in_every_domain() {
        let p = |t: &str| GtidPos::parse(t).unwrap();
        assert!(p("0-1-42").includes(&p("0-2-41")), "the server id does not order");
        assert!(!p("0-1-41").includes(&p("0-1-42")));
        assert!(p("0-1-42,1-3-7").includes(&p("0-1-42")));
        assert!(!p("0-1-42").includes(&p("0-1-42,1-3-7")), "a domain it lacks");
        assert!(p("0-1-1").includes(&p("")));
        assert_eq!(p("0-1-40").behind(&p("0-2-42,1-1-3")), 5);
        assert_eq!(p("0-1-50").behind(&p("0-2-42")), 0);
    }

    #[test]
    fn holding_a_position_at_its_own_number_takes_the_same_transaction() {
        let p = |t: &str| GtidPos::parse(t).unwrap();
        assert!(p("0-1-42").holds(&p("0-1-42")));
        assert!(p("0-1-43").holds(&p("0-2-42")), "a later number follows it");
        assert!(!p("0-1-42").holds(&p("0-2-42")), "another transaction under the same number");
        assert!(!p("0-1-41").holds(&p("0-1-42")));
        assert!(!p("0-1-42").holds(&p("0-1-42,1-3-7")), "a domain it lacks");
        assert!(p("0-1-42,1-3-7").holds(&p("0-1-42")));
    }
}
