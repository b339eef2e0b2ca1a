//! What a command asks the mover to do, as moves: logical shards to a
//! named shard, or a rebalance over some shards; each cut to at most
//! `mover.logicals_per_move` logical shards.

use schemas::topology::{MovePlan, PhysicalId};

use crate::{MoveError, Mover, Result};

impl Mover {
    /// The moves that take `logicals` to the shard named `to`: one per
    /// physical shard that owns some of them now (those `to` owns already
    /// need none).
    pub fn plan_move(&self, logicals: &[u16], to: &str) -> Result<Vec<MovePlan>> {
        let t = self.shards().topology();
        let target =
            t.by_name(to).ok_or_else(|| MoveError::Invalid(format!("no physical shard is named {to:?}")))?;
        let mut by_source: std::collections::BTreeMap<PhysicalId, Vec<u16>> = Default::default();
        for k in logicals {
            if *k >= t.logical_shards {
                return Err(MoveError::Invalid(format!(
                    "logical shard {k} does not exist (the cluster has {})",
                    t.logical_shards
                )));
            }
            let owner = t.owner(*k);
            if owner != target.id {
                by_source.entry(owner).or_default().push(*k);
            }
        }
        let plans = by_source.into_iter().map(|(from, logicals)| MovePlan { logicals, from, to: target.id });
        Ok(self.chunked(plans.collect()))
    }

    /// `plans` split into moves of at most `mover.logicals_per_move`.
    fn chunked(&self, plans: Vec<MovePlan>) -> Vec<MovePlan> {
        let size = self.settings().logicals_per_move.max(1);
        plans
            .into_iter()
            .flat_map(|p| {
                p.logicals
                    .chunks(size)
                    .map(|c| MovePlan { logicals: c.to_vec(), from: p.from, to: p.to })
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// The moves that leave each shard named in `names` an even share and
    /// the others none.
    pub fn plan_rebalance(&self, names: &[String]) -> Result<Vec<MovePlan>> {
        let t = self.shards().topology();
        let mut ids = Vec::new();
        for n in names {
            let p = t
                .by_name(n)
                .ok_or_else(|| MoveError::Invalid(format!("no physical shard is named {n:?}")))?;
            ids.push(p.id);
        }
        if ids.is_empty() {
            return Err(MoveError::Invalid(
                "a rebalance needs at least one physical shard to hold the data".into(),
            ));
        }
        Ok(self.chunked(t.rebalance_plan(&ids)))
    }
}
