//! Unique keys in the write transaction (the protocol is `crate::unique`'s).
//!
//! A transaction on a shard with unique indexes runs as tries: each try
//! locks and decides its items as any transaction does, then asks which
//! keys its writes newly give their entities ([`KeyEffects`]). A key not
//! yet reserved sends the try back (rolled back) to reserve it, and the
//! items are tried again; a key another entity holds refuses its item
//! with [`WriteError::UniqueViolation`] (after its preconditions passed);
//! with every new key reserved, the try claims the call's token and
//! commits. Then each reservation is settled (held by what the entity
//! holds now, else deleted) and the keys the entities dropped are freed.

use schemas::index::IndexKey;
use schemas::{Bag, EntityId};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use super::decide::Staged;
use super::transaction::{attempt, Tried};
use super::{Committed, Item, WriteContext, WriteError};
use crate::unique::many::{self, Look};
use crate::unique::{self, key_id, Reserved, UniqueSpec};
use crate::StoreError;

/// How many tries a transaction gets to find every key it needs reserved.
const TRIES: usize = 6;

/// One key of one unique index for one entity.
#[derive(Debug, Clone)]
pub(super) struct Wanted {
    /// Its place in [`Keys::specs`].
    pub index: usize,
    pub owner: EntityId,
    pub key: IndexKey,
    bytes: Vec<u8>,
}

impl Wanted {
    fn new(index: usize, owner: EntityId, key: IndexKey) -> Wanted {
        Wanted { index, owner, bytes: key_id(&key), key }
    }
}

impl PartialEq for Wanted {
    fn eq(&self, other: &Wanted) -> bool {
        (self.index, self.owner, &self.bytes) == (other.index, other.owner, &other.bytes)
    }
}

impl Eq for Wanted {}

impl Hash for Wanted {
    fn hash<H: Hasher>(&self, h: &mut H) {
        (self.index, self.owner, &self.bytes).hash(h)
    }
}

/// What one write call has reserved, under which token.
#[derive(Debug)]
pub(super) struct Keys {
    pub specs: Arc<Vec<UniqueSpec>>,
    pub token: [u8; 16],
    pub status: HashMap<Wanted, Reserved>,
    /// When the first of the token's reservations runs out (µs, by this
    /// process's clock, no later than the rows say): a try past it gives
    /// up its claim and reserves again, so no write claims a token whose
    /// revocation the cleaner may since have purged.
    pub until_us: i64,
}

/// What one try's items do to unique keys.
#[derive(Debug)]
pub(super) struct KeyEffects<'k> {
    keys: &'k Keys,
    /// Each entity's keys as stored when locked, expired or not: what it
    /// no longer yields after the try is freed (an expired entity holds
    /// none, but its rows may still name it).
    before: HashMap<EntityId, HashSet<Wanted>>,
    /// Keys the items need and the call has not reserved.
    pub missing: Vec<Wanted>,
    /// Keys newly given by this try's writes (reserved): the try claims
    /// the token when there is any.
    pub acquired: Vec<Wanted>,
    /// Keys held as locked and not after the try.
    pub freed: Vec<Wanted>,
    /// Each reservation of the call and whether its entity holds the key
    /// after the try.
    pub settle: Vec<(Wanted, bool)>,
    /// Keys given by this try so far: a later item of another entity
    /// wanting one is refused (the first in order wins).
    given: HashMap<(usize, Vec<u8>), EntityId>,
}

/// The unique keys `bag` yields, of every index in `specs`.
fn keys_of(specs: &[UniqueSpec], owner: EntityId, bag: Option<&Bag>) -> HashSet<Wanted> {
    let Some(bag) = bag else { return HashSet::new() };
    specs
        .iter()
        .enumerate()
        .flat_map(|(i, u)| u.spec.keys(bag).into_iter().map(move |k| Wanted::new(i, owner, k)))
        .collect()
}

fn visible(s: &Staged) -> Option<&Bag> {
    s.bag.as_ref().filter(|_| s.live)
}

impl<'k> KeyEffects<'k> {
    pub(super) fn new(keys: &'k Keys, rows: &HashMap<EntityId, Staged>) -> KeyEffects<'k> {
        let before = rows.iter().map(|(id, s)| (*id, keys_of(&keys.specs, *id, s.bag.as_ref()))).collect();
        KeyEffects {
            keys,
            before,
            missing: Vec::new(),
            acquired: Vec::new(),
            freed: Vec::new(),
            settle: Vec::new(),
            given: HashMap::new(),
        }
    }

    /// One decided item of entity `id` going from `before` to `after`
    /// (visible bags): refused when it would take a key another entity
    /// holds; else its new keys are noted (reserved, or missing).
    pub(super) fn check(
        &mut self,
        id: EntityId,
        before: Option<&Bag>,
        after: Option<&Bag>,
    ) -> Result<(), WriteError> {
        let old = keys_of(&self.keys.specs, id, before);
        let mut missing = Vec::new();
        let mut acquired = Vec::new();
        for w in keys_of(&self.keys.specs, id, after) {
            if old.contains(&w) {
                continue;
            }
            let u = &self.keys.specs[w.index];
            let refuse =
                |by: EntityId| WriteError::UniqueViolation { index: u.spec.table.clone(), existing_id: by };
            if let Some(by) = self.given.get(&(w.index, w.bytes.clone())).filter(|by| **by != id) {
                if u.enforced {
                    return Err(refuse(*by));
                }
                continue;
            }
            match self.keys.status.get(&w) {
                Some(Reserved::Mine) => acquired.push(w),
                Some(Reserved::HeldBy(by)) if u.enforced => return Err(refuse(*by)),
                // Not enforced yet: the key stays its holder's, and the
                // backfill finds the clash.
                Some(Reserved::HeldBy(_)) => {}
                None => missing.push(w),
            }
        }
        for w in &acquired {
            self.given.insert((w.index, w.bytes.clone()), id);
        }
        self.missing.extend(missing);
        self.acquired.extend(acquired);
        Ok(())
    }

    /// After every item: what each entity dropped, and how each
    /// reservation of the call ends (`rows`: each entity as the items left
    /// it).
    pub(super) fn finish(&mut self, rows: &HashMap<EntityId, Staged>) {
        let after: HashMap<EntityId, HashSet<Wanted>> =
            rows.iter().map(|(id, s)| (*id, keys_of(&self.keys.specs, *id, visible(s)))).collect();
        for (id, old) in &self.before {
            let now = after.get(id);
            self.freed.extend(old.iter().filter(|w| !now.is_some_and(|n| n.contains(*w))).cloned());
        }
        for (w, r) in &self.keys.status {
            if *r == Reserved::Mine {
                let held = after.get(&w.owner).is_some_and(|n| n.contains(w));
                self.settle.push((w.clone(), held));
            }
        }
    }
}

/// `items` in one transaction on `shard`, with the unique indexes `specs`
/// kept: tries until every key its writes newly give is reserved (or
/// refused), then settles the reservations.
pub(super) async fn commit(
    ctx: &WriteContext,
    shard: usize,
    items: &[Item],
    specs: Arc<Vec<UniqueSpec>>,
) -> Result<Committed, StoreError> {
    let mut keys = Keys { specs, token: unique::new_token(), status: HashMap::new(), until_us: i64::MAX };
    for _ in 0..TRIES {
        match attempt(ctx, shard, items, Some(&keys)).await? {
            Tried::Done(committed, Some(done)) => {
                settle(ctx, shard, &keys, done).await;
                return Ok(committed);
            }
            Tried::Done(committed, None) => return Ok(committed),
            Tried::NeedKeys(wanted) => reserve_all(ctx, &mut keys, wanted).await?,
            Tried::Revoked => {
                // A contender took a reservation over after it ran out (or
                // they ran out): taken again under a new token.
                keys.token = unique::new_token();
                keys.status.clear();
                keys.until_us = i64::MAX;
            }
        }
    }
    Err(StoreError::UniqueKeysMoving { shard })
}

/// Reserves `wanted`, noting each answer: those of one index on one key
/// shard in one transaction (all at once), a key another entity's row has
/// the one-key way.
async fn reserve_all(ctx: &WriteContext, keys: &mut Keys, wanted: Vec<Wanted>) -> Result<(), StoreError> {
    let shards = ctx.shards();
    let rules = ctx.rules();
    let wanted: Vec<Wanted> = wanted.into_iter().collect::<HashSet<_>>().into_iter().collect();
    let (token, specs) = (keys.token, keys.specs.clone());
    let until_us = schemas::clock::now_micros().saturating_add(rules.unique_reservation_us);
    let map = shards.routing();
    let mut groups: BTreeMap<(usize, usize), Vec<&Wanted>> = BTreeMap::new();
    for w in &wanted {
        let logical = specs[w.index].spec.logical_of_key(&w.key, map.logical_shards());
        groups.entry((w.index, map.of_logical(logical))).or_default().push(w);
    }
    let looked = futures::future::join_all(groups.iter().map(|((index, shard), ws)| {
        let wants: Vec<(IndexKey, EntityId)> = ws.iter().map(|w| (w.key.clone(), w.owner)).collect();
        let spec = &specs[*index].spec;
        async move { many::reserve_many(shards, *shard, spec, &wants, token, until_us).await }
    }))
    .await;
    let mut answers: Vec<(Wanted, Reserved)> = Vec::new();
    let mut contended: Vec<&Wanted> = Vec::new();
    for ((_, ws), looks) in groups.iter().zip(looked) {
        match looks {
            Ok(looks) => {
                for (w, look) in ws.iter().zip(looks) {
                    match look {
                        Look::Answered(r) => answers.push(((*w).clone(), r)),
                        Look::Contended => contended.push(w),
                    }
                }
            }
            // A stale map or a lost race: each key the one-key way, which
            // reloads and tries again.
            Err(e) if e.is_stale_map() || e.is_retryable_conflict() => contended.extend(ws.iter().copied()),
            Err(e) => return Err(e),
        }
    }
    let slow = futures::future::try_join_all(contended.iter().map(|w| {
        let spec = &specs[w.index].spec;
        unique::reserve(
            shards,
            rules.expiry.as_deref(),
            spec,
            &w.key,
            w.owner,
            token,
            rules.unique_reservation_us,
        )
    }))
    .await?;
    answers.extend(contended.into_iter().cloned().zip(slow));
    if rules.drill_exit_after_reserve && answers.iter().any(|(_, r)| *r == Reserved::Mine) {
        tracing::warn!("drill: exiting after reserving a unique key, before the write's transaction");
        std::process::exit(137);
    }
    if answers.iter().any(|(_, r)| *r == Reserved::Mine) {
        keys.until_us = keys.until_us.min(until_us);
    }
    keys.status.extend(answers);
    Ok(())
}

/// What follows a committed try: per index and key shard, one statement
/// each for the reservations now held, those its entities did not keep,
/// and the keys they dropped. A failure here is logged and left: a
/// reservation left pending resolves when it runs out (see
/// `crate::unique`), a held row of a dropped key is taken over by the next
/// writer and removed by the cleaner. The claim stays until the cleaner
/// purges it.
async fn settle(ctx: &WriteContext, shard: usize, keys: &Keys, done: Settled) {
    let shards = ctx.shards();
    let map = shards.routing();
    type Group<'a> = (Vec<&'a IndexKey>, Vec<&'a IndexKey>, Vec<(&'a IndexKey, EntityId)>);
    let mut groups: BTreeMap<(usize, usize), Group<'_>> = BTreeMap::new();
    let home = |w: &Wanted| {
        let logical = keys.specs[w.index].spec.logical_of_key(&w.key, map.logical_shards());
        (w.index, map.of_logical(logical))
    };
    for (w, held) in &done.settle {
        let g = groups.entry(home(w)).or_default();
        if *held {
            g.0.push(&w.key)
        } else {
            g.1.push(&w.key)
        }
    }
    for w in &done.freed {
        groups.entry(home(w)).or_default().2.push((&w.key, w.owner));
    }
    let settled = futures::future::join_all(groups.iter().map(|((index, on), (held, dropped, freed))| {
        let spec = &keys.specs[*index].spec;
        many::settle_many(shards, *on, spec, &keys.token, held, dropped, freed)
    }))
    .await;
    for e in settled.into_iter().filter_map(Result::err) {
        tracing::warn!(shard, error = %e, "unique key rows were not settled; they resolve when their reservations run out");
    }
}

/// What a committed try leaves to [`settle`].
#[derive(Debug)]
pub(super) struct Settled {
    pub settle: Vec<(Wanted, bool)>,
    pub freed: Vec<Wanted>,
}
