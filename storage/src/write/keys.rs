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
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use super::decide::Staged;
use super::transaction::{attempt, Tried};
use super::{Committed, Item, WriteContext, WriteError};
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

/// Reserves `wanted` (at once), noting each answer.
async fn reserve_all(ctx: &WriteContext, keys: &mut Keys, wanted: Vec<Wanted>) -> Result<(), StoreError> {
    let shards = ctx.shards();
    let rules = ctx.rules();
    let wanted: Vec<Wanted> = wanted.into_iter().collect::<HashSet<_>>().into_iter().collect();
    let token = keys.token;
    let specs = keys.specs.clone();
    let until_us = schemas::clock::now_micros().saturating_add(rules.unique_reservation_us);
    let answers = futures::future::try_join_all(wanted.iter().map(|w| {
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
    if rules.drill_exit_after_reserve && answers.contains(&Reserved::Mine) {
        tracing::warn!("drill: exiting after reserving a unique key, before the write's transaction");
        std::process::exit(137);
    }
    if answers.contains(&Reserved::Mine) {
        keys.until_us = keys.until_us.min(until_us);
    }
    keys.status.extend(wanted.into_iter().zip(answers));
    Ok(())
}

/// What follows a committed try: reservations settled, dropped keys
/// freed, the claim forgotten once nothing carries its token. A failure
/// here is logged and left: a reservation left pending resolves when it
/// runs out (see `crate::unique`), a held row of a dropped key is taken
/// over by the next writer and removed by the cleaner.
async fn settle(ctx: &WriteContext, shard: usize, keys: &Keys, done: Settled) {
    let shards = ctx.shards();
    let spec = |w: &Wanted| &keys.specs[w.index].spec;
    let settled = futures::future::join_all(
        done.settle
            .iter()
            .map(|(w, held)| unique::settle(shards, spec(w), &w.key, w.owner, &keys.token, *held)),
    );
    let freed =
        futures::future::join_all(done.freed.iter().map(|w| unique::free(shards, spec(w), &w.key, w.owner)));
    let (settled, freed) = futures::join!(settled, freed);
    let mut clean = true;
    for e in settled.into_iter().chain(freed).filter_map(Result::err) {
        tracing::warn!(shard, error = %e, "a unique key row was not settled; it resolves when its reservation runs out");
        clean = false;
    }
    if clean && done.claimed {
        if let Err(e) = unique::forget_claim(shards, shard, &keys.token).await {
            tracing::warn!(shard, error = %e, "a unique key claim was not removed; the cleaner removes it");
        }
    }
}

/// What a committed try leaves to [`settle`].
#[derive(Debug)]
pub(super) struct Settled {
    pub settle: Vec<(Wanted, bool)>,
    pub freed: Vec<Wanted>,
    /// The try claimed the call's token.
    pub claimed: bool,
}
