//! The cluster's layout: a fixed number of logical shards, the physical
//! shards (MySQL servers) by stable name, and which physical shard owns
//! each logical shard, under an epoch that every change bumps.
//!
//! Pure: `storage::topology` keeps it in the database (the metadata shard
//! holds the map, each physical shard the list of logical shards it owns),
//! and every process routes with the copy it loaded, never trusting it for
//! a write: a transaction proves ownership on the server it writes to.

use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

/// A physical shard's id: stable for its life, never reused. Ids index the
/// connection slots of a process; names are what people and configs use.
pub type PhysicalId = u32;

/// One MySQL server (database) of the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PhysicalShard {
    pub id: PhysicalId,
    pub name: String,
    /// Its DSN without the password: where a process that was not
    /// configured with it (added online) connects, with its own credentials.
    pub address: String,
    /// The map epoch of the last change that moved a logical shard to or
    /// from this shard. A read checks it to know its map is current for
    /// this shard.
    pub epoch: u64,
    /// How many times the shard's primary changed (failovers and
    /// switchovers): a process whose connection to the shard predates the
    /// last change follows `address`; otherwise the server it was
    /// configured with stays its way in (a `dev` restart moves ports, not
    /// primaries).
    pub failovers: u64,
}

/// A replica of a physical shard: a server that replicates from the
/// shard's primary, which reads may use and a failover may promote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Replica {
    pub physical: PhysicalId,
    /// Its DSN without the password, as [`PhysicalShard::address`].
    pub address: String,
}

/// The map: who owns which logical shard, and which servers each physical
/// shard has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    pub logical_shards: u16,
    pub epoch: u64,
    /// Registered physical shards, by id; each one's address is its primary's.
    pub shards: Vec<PhysicalShard>,
    /// `owners[k]`: the physical shard owning logical shard `k`.
    pub owners: Vec<PhysicalId>,
    /// The physical shards' replicas, by physical id.
    pub replicas: Vec<Replica>,
}

/// Moving `logicals` from one physical shard to another.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MovePlan {
    pub logicals: Vec<u16>,
    pub from: PhysicalId,
    pub to: PhysicalId,
}

/// Why a process's configuration does not fit the recorded cluster.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    #[error(
        "the configuration names physical shard {name:?}, which the cluster does not have \
         (registered: {registered}); register it with `bagstore shards add` or fix mysql.shards"
    )]
    UnknownShard { name: String, registered: String },
    #[error(
        "the cluster has physical shard {name:?} (at {address}) but the configuration lacks it; \
         add it to mysql.shards"
    )]
    MissingShard { name: String, address: String },
    #[error(
        "the configuration says mysql.logical_shards = {configured}, the cluster was created with {recorded}; \
         the number of logical shards never changes"
    )]
    LogicalShards { configured: u16, recorded: u16 },
}

impl Topology {
    /// A new cluster: `shards` (id, name, address) in order, logical shard
    /// `k` on the `k mod N`-th of them. That is an even spread, and for a
    /// cluster upgraded from `hash mod N` routing with N dividing L, exactly
    /// the placement it had.
    pub fn even(logical_shards: u16, shards: Vec<PhysicalShard>) -> Topology {
        assert!(!shards.is_empty() && logical_shards > 0);
        let n = shards.len();
        let owners = (0..logical_shards).map(|k| shards[k as usize % n].id).collect();
        Topology { logical_shards, epoch: 1, shards, owners, replicas: Vec::new() }
    }

    pub fn owner(&self, logical: u16) -> PhysicalId {
        self.owners[logical as usize]
    }

    pub fn shard(&self, id: PhysicalId) -> Option<&PhysicalShard> {
        self.shards.iter().find(|s| s.id == id)
    }

    /// The replicas of physical shard `id`.
    pub fn replicas_of(&self, id: PhysicalId) -> impl Iterator<Item = &Replica> {
        self.replicas.iter().filter(move |r| r.physical == id)
    }

    /// The addresses of physical shard `id`'s servers: its primary first,
    /// then its replicas.
    pub fn servers_of(&self, id: PhysicalId) -> Vec<&str> {
        let primary = self.shard(id).map(|p| p.address.as_str());
        primary.into_iter().chain(self.replicas_of(id).map(|r| r.address.as_str())).collect()
    }

    pub fn by_name(&self, name: &str) -> Option<&PhysicalShard> {
        self.shards.iter().find(|s| s.name == name)
    }

    /// The logical shards `id` owns, in order.
    pub fn owned_by(&self, id: PhysicalId) -> Vec<u16> {
        (0..self.logical_shards).filter(|k| self.owners[*k as usize] == id).collect()
    }

    /// How many logical shards each registered shard owns (0 included).
    pub fn counts(&self) -> BTreeMap<PhysicalId, usize> {
        let mut out: BTreeMap<PhysicalId, usize> = self.shards.iter().map(|s| (s.id, 0)).collect();
        for o in &self.owners {
            *out.entry(*o).or_default() += 1;
        }
        out
    }

    /// The moves that leave every shard in `targets` an even share (the
    /// first `L mod N` by id get one more) and the others none: from each
    /// shard holding more than its share, its highest logical shards go to
    /// the shards holding less, lowest id first. Few moves, each of a
    /// contiguous-as-possible set, and the same plan for the same map.
    pub fn rebalance_plan(&self, targets: &[PhysicalId]) -> Vec<MovePlan> {
        let targets: BTreeSet<PhysicalId> = targets.iter().copied().collect();
        assert!(!targets.is_empty(), "rebalancing needs a target shard");
        let n = targets.len();
        let base = self.logical_shards as usize / n;
        let extra = self.logical_shards as usize % n;
        let want: BTreeMap<PhysicalId, usize> =
            targets.iter().enumerate().map(|(i, id)| (*id, base + usize::from(i < extra))).collect();
        let mut held: BTreeMap<PhysicalId, Vec<u16>> = BTreeMap::new();
        for k in 0..self.logical_shards {
            held.entry(self.owner(k)).or_default().push(k);
        }
        // What each shard gives up: everything beyond its share (all of it
        // for a shard that is not a target), highest logical shards first.
        let mut surplus: Vec<(PhysicalId, u16)> = Vec::new();
        for (id, ks) in &held {
            let keep = want.get(id).copied().unwrap_or(0);
            surplus.extend(ks.iter().skip(keep).map(|k| (*id, *k)));
        }
        let mut moves: BTreeMap<(PhysicalId, PhysicalId), Vec<u16>> = BTreeMap::new();
        let mut surplus = surplus.into_iter();
        for (to, w) in &want {
            let have = held.get(to).map_or(0, Vec::len);
            for _ in have..*w {
                let (from, k) = surplus.next().expect("surplus and deficit balance");
                moves.entry((from, *to)).or_default().push(k);
            }
        }
        moves.into_iter().map(|((from, to), logicals)| MovePlan { logicals, from, to }).collect()
    }

    /// Checks a process's configuration against this topology: it must name
    /// exactly the registered shards, and give the same number of logical
    /// shards if it gives one.
    pub fn check_config(
        &self,
        configured: &BTreeSet<String>,
        logical_shards: Option<u16>,
    ) -> Result<(), TopologyError> {
        if let Some(configured) = logical_shards.filter(|l| *l != self.logical_shards) {
            return Err(TopologyError::LogicalShards { configured, recorded: self.logical_shards });
        }
        let registered: Vec<&str> = self.shards.iter().map(|s| s.name.as_str()).collect();
        if let Some(name) = configured.iter().find(|n| !registered.contains(&n.as_str())) {
            return Err(TopologyError::UnknownShard {
                name: name.clone(),
                registered: registered.join(", "),
            });
        }
        if let Some(s) = self.shards.iter().find(|s| !configured.contains(&s.name)) {
            return Err(TopologyError::MissingShard { name: s.name.clone(), address: s.address.clone() });
        }
        Ok(())
    }
}

/// Logical shards as compact text: sorted, runs as `A-B`, comma-separated
/// (`0-9,20,22-30`). [`parse_logicals`] reads it back.
pub fn format_logicals(logicals: &[u16]) -> String {
    let mut ks = logicals.to_vec();
    ks.sort_unstable();
    ks.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < ks.len() {
        let mut j = i;
        while j + 1 < ks.len() && ks[j + 1] == ks[j] + 1 {
            j += 1;
        }
        parts.push(if i == j { ks[i].to_string() } else { format!("{}-{}", ks[i], ks[j]) });
        i = j + 1;
    }
    parts.join(",")
}

/// Parses comma-separated ranges (`A-B` or `A`, inclusive) into sorted,
/// distinct logical shards below `l`; the empty string is none.
pub fn parse_logicals(text: &str, l: u16) -> Result<Vec<u16>, String> {
    let mut out = BTreeSet::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        out.extend(parse_logical_range(part, l)?);
    }
    Ok(out.into_iter().collect())
}

/// Parses `A-B` or `A` (inclusive) into logical shards below `l`.
pub fn parse_logical_range(text: &str, l: u16) -> Result<Vec<u16>, String> {
    let (a, b) = text.split_once('-').unwrap_or((text, text));
    let parse = |s: &str| s.trim().parse::<u16>().map_err(|_| format!("{s:?} is not a logical shard number"));
    let (a, b) = (parse(a)?, parse(b)?);
    if a > b || b >= l {
        return Err(format!("logical shards {text} are not a range within 0-{}", l - 1));
    }
    Ok((a..=b).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shards(n: u32) -> Vec<PhysicalShard> {
        (0..n)
            .map(|id| PhysicalShard {
                id,
                name: format!("s{id}"),
                address: format!("mysql://h{id}/db"),
                epoch: 1,
                failovers: 0,
            })
            .collect()
    }

    #[test]
    fn logical_shard_lists_round_trip_as_ranges() {
        let ks = vec![0, 1, 2, 3, 7, 9, 10, 4095];
        assert_eq!(format_logicals(&ks), "0-3,7,9-10,4095");
        assert_eq!(parse_logicals("0-3,7,9-10,4095", 4096).unwrap(), ks);
        assert_eq!(parse_logicals("", 4096).unwrap(), Vec::<u16>::new());
        assert_eq!(format_logicals(&[]), "");
        assert!(parse_logicals("5-2", 4096).is_err());
        assert!(parse_logicals("4096", 4096).is_err());
        assert!(parse_logicals("x", 4096).is_err());
    }

    #[test]
    fn a_new_cluster_spreads_logical_shards_evenly() {
        let t = Topology::even(4096, shards(2));
        assert_eq!(t.counts(), BTreeMap::from([(0, 2048), (1, 2048)]));
        assert_eq!((t.owner(0), t.owner(1), t.owner(4095)), (0, 1, 1));
        let t = Topology::even(10, shards(3));
        assert_eq!(t.owned_by(0), vec![0, 3, 6, 9]);
    }

    #[test]
    fn rebalancing_onto_a_new_shard_moves_only_its_share() {
        let mut t = Topology::even(4096, shards(2));
        t.shards.push(PhysicalShard {
            id: 2,
            name: "s2".into(),
            address: "x".into(),
            epoch: 1,
            failovers: 0,
        });
        let plan = t.rebalance_plan(&[0, 1, 2]);
        let moved: usize = plan.iter().map(|m| m.logicals.len()).sum();
        assert_eq!(moved, 1365, "a third, no more: {plan:?}");
        assert!(plan.iter().all(|m| m.to == 2));
        for m in &plan {
            for k in &m.logicals {
                t.owners[*k as usize] = m.to;
            }
        }
        assert_eq!(t.counts(), BTreeMap::from([(0, 1366), (1, 1365), (2, 1365)]));
        assert!(t.rebalance_plan(&[0, 1, 2]).is_empty(), "balanced: nothing to do");
        // Draining shard 0: everything it holds goes to the others.
        let drain = t.rebalance_plan(&[1, 2]);
        assert!(drain.iter().all(|m| m.from == 0));
        assert_eq!(drain.iter().map(|m| m.logicals.len()).sum::<usize>(), 1366);
    }

    #[test]
    fn a_configuration_must_name_exactly_the_registered_shards() {
        let t = Topology::even(4096, shards(2));
        let names = |ns: &[&str]| ns.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
        assert_eq!(t.check_config(&names(&["s1", "s0"]), None), Ok(()));
        assert_eq!(t.check_config(&names(&["s0", "s1"]), Some(4096)), Ok(()));
        assert!(matches!(t.check_config(&names(&["s0"]), None), Err(TopologyError::MissingShard { .. })));
        assert!(matches!(
            t.check_config(&names(&["s0", "s1", "s9"]), None),
            Err(TopologyError::UnknownShard { .. })
        ));
        assert!(matches!(
            t.check_config(&names(&["s0", "s1"]), Some(1024)),
            Err(TopologyError::LogicalShards { configured: 1024, recorded: 4096 })
        ));
    }

    #[test]
    fn logical_ranges_parse_inclusively() {
        assert_eq!(parse_logical_range("3-5", 4096), Ok(vec![3, 4, 5]));
        assert_eq!(parse_logical_range("7", 4096), Ok(vec![7]));
        assert!(parse_logical_range("5-3", 4096).is_err());
        assert!(parse_logical_range("0-4096", 4096).is_err());
        assert!(parse_logical_range("x", 4096).is_err());
    }
}
