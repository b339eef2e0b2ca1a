//! Where entities live: id → `added_id`, the clustered key of the entity's
//! row on its shard.
//!
//! `entities` is clustered by `added_id` (inserts append), so a fetch by id
//! descends the unique `id` key and then the clustered key: two B-trees.
//! An `added_id` never changes for an id (updates and deletes keep the row),
//! so once a read has seen it, later fetches go straight to the clustered
//! key. Nothing here is trusted blindly: a fetch by location checks that
//! the row it got is that id's, and falls back to the id otherwise (see
//! `execute::Reader::get_many`). The rows themselves are always read fresh;
//! only where to find them is remembered.
//!
//! Queries mostly do not need it: index rows carry their entity's location
//! (see `schemas::ddl::index_table`). It serves point reads (`GET`, batch
//! get) and index rows that do not know the location yet.
//!
//! Bounded, approximately least recently used: two generations of at most
//! `capacity / 2` entries each. New and used entries go to the young one;
//! when it is full it becomes the old one and the previous old one is
//! dropped.

use schemas::EntityId;
use std::collections::HashMap;
use std::sync::Mutex;

#[derive(Debug)]
pub struct Locations {
    /// Entries per generation (0: remember nothing).
    half: usize,
    gens: Mutex<Generations>,
}

#[derive(Debug, Default)]
struct Generations {
    young: HashMap<EntityId, u64>,
    old: HashMap<EntityId, u64>,
}

impl Generations {
    fn insert(&mut self, half: usize, id: EntityId, added_id: u64) {
        if self.young.len() >= half && !self.young.contains_key(&id) {
            self.old = std::mem::take(&mut self.young);
        }
        self.young.insert(id, added_id);
    }
}

impl Locations {
    /// Remembers at most `capacity` locations (0: none).
    pub fn new(capacity: usize) -> Locations {
        Locations { half: capacity / 2, gens: Mutex::new(Generations::default()) }
    }

    /// Where `id` was last seen, if remembered.
    pub fn get(&self, id: &EntityId) -> Option<u64> {
        if self.half == 0 {
            return None;
        }
        let mut g = self.gens.lock().expect("not poisoned");
        if let Some(a) = g.young.get(id) {
            return Some(*a);
        }
        let a = g.old.remove(id)?;
        g.insert(self.half, *id, a);
        Some(a)
    }

    /// Remembers the locations of rows just read.
    pub fn learn(&self, seen: impl IntoIterator<Item = (EntityId, u64)>) {
        if self.half == 0 {
            return;
        }
        let mut g = self.gens.lock().expect("not poisoned");
        for (id, added_id) in seen {
            g.insert(self.half, id, added_id);
        }
    }

    /// Drops a location that turned out wrong.
    pub fn forget(&self, id: &EntityId) {
        let mut g = self.gens.lock().expect("not poisoned");
        g.young.remove(id);
        g.old.remove(id);
    }

    /// Locations remembered now.
    pub fn len(&self) -> usize {
        let g = self.gens.lock().expect("not poisoned");
        g.young.len() + g.old.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> EntityId {
        EntityId([n; 16])
    }

    #[test]
    fn remembers_and_forgets() {
        let l = Locations::new(10);
        assert_eq!(l.get(&id(1)), None);
        l.learn([(id(1), 7), (id(2), 9)]);
        assert_eq!(l.get(&id(1)), Some(7));
        assert_eq!(l.get(&id(2)), Some(9));
        l.forget(&id(1));
        assert_eq!(l.get(&id(1)), None);
        l.learn([(id(2), 11)]);
        assert_eq!(l.get(&id(2)), Some(11), "a newer sighting wins");
    }

    #[test]
    fn stays_within_capacity_and_keeps_what_is_used() {
        let l = Locations::new(6);
        l.learn((0..3).map(|n| (id(n), u64::from(n))));
        l.learn((3..6).map(|n| (id(n), u64::from(n))));
        // 0..3 are the old generation now; using 0 moves it to the young one.
        assert_eq!(l.get(&id(0)), Some(0));
        l.learn((6..12).map(|n| (id(n), u64::from(n))));
        assert!(l.len() <= 6, "{} entries", l.len());
        assert_eq!(l.get(&id(1)), None, "an entry not used for two generations is gone");
        assert_eq!(l.get(&id(11)), Some(11));
    }

    #[test]
    fn capacity_zero_remembers_nothing() {
        let l = Locations::new(0);
        l.learn([(id(1), 1)]);
        assert_eq!(l.get(&id(1)), None);
        assert!(l.is_empty());
    }
}
