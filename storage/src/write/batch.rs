//! Many items at once: each goes to the shard that owns it by the current
//! map, and each shard's items commit in one transaction, all shards at
//! once. Items whose shard turned out not to own them (a stale map) go
//! again to the owner the reloaded map names, for as long as the caller's
//! [`StaleMapRetry`] allows.

use schemas::clock::now_micros;
use schemas::EntityId;
use std::collections::{BTreeMap, HashMap};

use super::{commit, per_item, Change, Committed, Guard, Item, Outcome, WriteContext, WriteError};
use crate::unique::{key_id, UniqueSpec};
use crate::{idempotency, StaleMapRetry, StoreError};

/// One shard's part of a batch, committed or not.
#[derive(Debug)]
pub struct ShardCommit {
    pub shard: usize,
    /// Its items, by place in the batch, in the order they ran.
    pub items: Vec<usize>,
    /// Its transaction: what the caller counts when it committed.
    pub result: Result<Committed, StoreError>,
}

impl ShardCommit {
    /// Each item's place in the batch and its answer: its own when the
    /// transaction committed, else the transaction's error (shared).
    pub fn answers(self) -> impl Iterator<Item = (usize, Result<Outcome, WriteError>)> {
        let n = self.items.len();
        self.items.into_iter().zip(per_item(self.shard, self.result.map(|c| c.results), n))
    }
}

/// Commits the items `todo` (places in `items`): those on one shard in one
/// transaction, the shards at once; one [`ShardCommit`] per shard written,
/// in shard order.
async fn commit_by_shard(ctx: &WriteContext, items: &[Item], todo: &[usize]) -> Vec<ShardCommit> {
    // One map for the split, so every item finds its shard's list.
    let map = ctx.shards().routing();
    let mut per_shard: Vec<Vec<usize>> = vec![Vec::new(); map.slots_len()];
    for &i in todo {
        per_shard[map.of_id(&items[i].id)].push(i);
    }
    // Lock rows in id order in every batch, so two batches touching the
    // same ids cannot deadlock; the sort is stable, so repeated ids keep
    // their order within the batch.
    for idx in &mut per_shard {
        idx.sort_by_key(|&i| items[i].id);
    }
    let done = ctx
        .shards()
        .each_with(&per_shard, |shard, _, idx| async move {
            let batch: Vec<Item> = idx.iter().map(|&i| items[i].clone()).collect();
            commit(ctx, shard, &batch).await
        })
        .await;
    done.into_iter()
        .map(|(shard, result)| ShardCommit { shard, items: std::mem::take(&mut per_shard[shard]), result })
        .collect()
}

/// Commits `items` (see `commit_by_shard`), and again those that found
/// their map stale, until none does or `stale` gives up (they then answer
/// the stale map). Answers in input order. `each` sees every shard's part,
/// committed or not, before its answers are taken: what the caller counts
/// or does after a commit.
pub async fn commit_all(
    ctx: &WriteContext,
    items: &[Item],
    stale: &mut StaleMapRetry,
    mut each: impl FnMut(&ShardCommit),
) -> Vec<Result<Outcome, WriteError>> {
    let mut out: Vec<Option<Result<Outcome, WriteError>>> = (0..items.len()).map(|_| None).collect();
    // Unreadable, the catalog fails each transaction on its own.
    let specs = ctx.unique().get(ctx.shards()).await.unwrap_or_default();
    for mut todo in rounds(items, &specs) {
        loop {
            for shard in commit_by_shard(ctx, items, &todo).await {
                each(&shard);
                for (i, r) in shard.answers() {
                    out[i] = Some(r);
                }
            }
            todo.retain(|&i| out[i].as_ref().is_some_and(|r| matches!(r, Err(e) if e.is_stale_map())));
            if todo.is_empty() || !stale.again(ctx.shards()).await {
                break;
            }
        }
    }
    out.into_iter().map(|r| r.expect("every item belongs to one shard")).collect()
}

/// The rounds a batch commits in, in order: an item whose put gives a
/// unique key that an earlier item of another entity gives too waits for
/// the round after that item's, so the first in order gets the key
/// whatever the shards (a later one then finds it held, or free if the
/// first was refused). A patch's keys are known only in its transaction:
/// it goes in the first round.
fn rounds(items: &[Item], specs: &[UniqueSpec]) -> Vec<Vec<usize>> {
    if specs.is_empty() {
        return vec![(0..items.len()).collect()];
    }
    let mut claimed: HashMap<(usize, Vec<u8>), (EntityId, usize)> = HashMap::new();
    let mut out: Vec<Vec<usize>> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let keys: Vec<(usize, Vec<u8>)> = match &item.change {
            Change::Put(bag) => specs
                .iter()
                .enumerate()
                .flat_map(|(s, u)| u.spec.keys(bag).into_iter().map(move |k| (s, key_id(&k))))
                .collect(),
            _ => Vec::new(),
        };
        let round = keys
            .iter()
            .filter_map(|k| claimed.get(k))
            .filter(|(id, _)| *id != item.id)
            .map(|(_, r)| r + 1)
            .max()
            .unwrap_or(0);
        for k in keys {
            claimed.insert(k, (item.id, round));
        }
        if out.len() <= round {
            out.resize(round + 1, Vec::new());
        }
        out[round].push(i);
    }
    out
}

/// Whether a keyed item's key was used within the window for another
/// request: a keyed batch that would be a 422 is refused whole before
/// anything is written (its transactions check each key again, locked).
pub async fn keys_reused(ctx: &WriteContext, guarded: &[(EntityId, Guard)]) -> Result<bool, StoreError> {
    let shards = ctx.shards();
    let mut per_shard: BTreeMap<usize, Vec<Guard>> = BTreeMap::new();
    for (id, g) in guarded {
        per_shard.entry(shards.of_id(id)).or_default().push(*g);
    }
    let window_us = ctx.rules().idempotency_window_us;
    let now = now_micros();
    for (shard, guards) in per_shard {
        let keys: Vec<[u8; 16]> = guards.iter().map(|g| g.key).collect();
        let found = idempotency::read_records(shard, shards.pool(shard), &keys).await?;
        let reused = guards.iter().any(|g| {
            found
                .get(&g.key)
                .is_some_and(|r| r.recorded_us.saturating_add(window_us) > now && r.request_hash != g.request)
        });
        if reused {
            return Ok(true);
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use schemas::value::bag_from_json;

    fn put(n: u8, email: &str) -> Item {
        let bag = bag_from_json(&serde_json::json!({ "email": email })).unwrap();
        Item { id: EntityId([n; 16]), change: Change::Put(bag), pre: Default::default() }
    }

    #[test]
    fn a_later_claimant_of_a_key_goes_in_the_round_after_the_earlier_one() {
        let spec: schemas::IndexSpec = toml::from_str(
            r#"table = "index_email"
               properties = [{ name = "email", type = "string" }]
               unique = true"#,
        )
        .unwrap();
        let specs = [UniqueSpec { spec, enforced: true }];
        // Items 0, 2 and 3 claim "a": each waits for the one before it.
        // Item 4 is item 0's entity again, claiming "c": it waits for no one.
        let items = [put(0, "a"), put(1, "b"), put(2, "a"), put(3, "a"), put(0, "c")];
        assert_eq!(rounds(&items, &specs), vec![vec![0, 1, 4], vec![2], vec![3]]);
        assert_eq!(rounds(&items, &[]), vec![vec![0, 1, 2, 3, 4]]);
    }
}
