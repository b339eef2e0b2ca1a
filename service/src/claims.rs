//! What a consumer holds and has claimed.
//!
//! A consumer takes its partitions by its member lease (`service::leases`,
//! `service::consumer`), never by the broker's group protocol. A lease can
//! still be wrong about the present: a member whose lease ran out unseen
//! (the metadata shard out of reach, a process paused past its lease), or
//! whose share moved while it was in a batch, may go on working on
//! partitions that are another's now. So each partition given is recorded
//! as a *claim* per group and partition on the metadata shard, the newest
//! winning (`storage::fences`), before anything of it is handed out; the
//! consumer loop compares the claims before each batch (at most once a
//! second while idle), and every index write proves its claims in its own
//! transaction, so even a batch already under way when the partitions
//! moved cannot land after the new owner's. The writers' Kafka ingest also
//! compares the claims after applying a round and before answering it
//! (`writer::ingest`).
//!
//! [`Claims`] is the consumer's context: it keeps the partitions given
//! ([`Claims::assigned`]), the claims recorded for them, and wakes the
//! loop when there are new ones to claim. A consumer that finds its
//! partitions claimed by another stops applying at once and is replaced by
//! a new one that holds nothing until it has claimed its share.

use rdkafka::client::ClientContext;
use rdkafka::consumer::{Consumer, ConsumerContext};
use rdkafka::TopicPartitionList;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use storage::fences::{self, Claim};
use storage::{Shards, StoreError};
use tokio::sync::Notify;

/// The consumer context that keeps what the consumer was given and the
/// claims it recorded for it.
#[derive(Debug)]
pub struct Claims {
    /// This consumer's identity in the partition claims (random, for its
    /// life).
    instance: [u8; 16],
    topic: String,
    state: Mutex<State>,
    /// Woken at each assignment, so its claims are recorded at once (the
    /// consumer holds nothing it may apply until they are).
    assignments: Notify,
}

#[derive(Debug, Default)]
struct State {
    /// Whether an assignment was given at all (an empty one counts: a
    /// group may have more members than partitions).
    assigned_once: bool,
    /// Partitions assigned and not yet claimed.
    to_claim: Vec<i32>,
    /// The claims recorded for partitions held (partition → generation);
    /// every index write proves them (`storage::fences`).
    claims: BTreeMap<i32, u64>,
}

impl State {
    fn assigned(&mut self, partitions: Vec<i32>) {
        // An old claim on a partition assigned again may have been
        // overtaken meanwhile: nothing is applied until it is renewed.
        for p in &partitions {
            self.claims.remove(p);
        }
        self.to_claim.extend(partitions);
        self.assigned_once = true;
    }
}

impl ClientContext for Claims {}

impl ConsumerContext for Claims {}

impl Claims {
    pub fn new(topic: &str) -> Claims {
        Claims {
            instance: *uuid::Uuid::new_v4().as_bytes(),
            topic: topic.to_string(),
            state: Mutex::default(),
            assignments: Notify::new(),
        }
    }

    /// Notes partitions the consumer was given by its lease: to be claimed
    /// before they are applied.
    pub fn assigned(&self, partitions: Vec<i32>) {
        self.state.lock().expect("not poisoned").assigned(partitions);
        self.assignments.notify_one();
    }

    /// Returns at the next assignment (at once if one came since the last
    /// call returned).
    pub async fn assignment(&self) {
        self.assignments.notified().await;
    }

    /// Whether the consumer holds its assignment: one was given (maybe
    /// empty), and every partition of it is claimed.
    pub fn settled(&self) -> bool {
        let s = self.state.lock().expect("not poisoned");
        s.assigned_once && s.to_claim.is_empty()
    }

    /// This consumer's identity in the partition claims.
    pub fn instance(&self) -> [u8; 16] {
        self.instance
    }

    /// Partitions assigned since the last call, to be claimed.
    pub fn take_claims(&self) -> Vec<i32> {
        std::mem::take(&mut self.state.lock().expect("not poisoned").to_claim)
    }

    /// Puts back claims that could not be written.
    pub fn retry_claims(&self, partitions: Vec<i32>) {
        self.state.lock().expect("not poisoned").to_claim.extend(partitions);
    }

    /// Notes claims recorded (of partitions still to be claimed, unless
    /// assigned again meanwhile: those are claimed once more).
    pub fn claimed(&self, claims: &[Claim]) {
        let mut s = self.state.lock().expect("not poisoned");
        for c in claims {
            if !s.to_claim.contains(&c.partition) {
                s.claims.insert(c.partition, c.gen);
            }
        }
    }

    /// The recorded claims on `partitions`, or None if one is not (yet).
    pub fn claims_for(&self, partitions: &BTreeSet<i32>) -> Option<Vec<Claim>> {
        let s = self.state.lock().expect("not poisoned");
        partitions.iter().map(|p| s.claims.get(p).map(|gen| Claim { partition: *p, gen: *gen })).collect()
    }

    /// The partitions of this member's topic that `consumer` holds.
    pub fn held<C: Consumer<Claims>>(&self, consumer: &C) -> BTreeSet<i32> {
        consumer
            .assignment()
            .map(|a| partitions_of(&a, &self.topic).into_iter().collect())
            .unwrap_or_default()
    }

    /// Records claims on the partitions assigned since the last call (see
    /// `storage::fences`); the claims made. When the metadata shard
    /// does not take them they are kept for the next call.
    pub async fn record_claims(&self, shards: &Shards, group: &str) -> Result<Vec<Claim>, StoreError> {
        let new = self.take_claims();
        if new.is_empty() {
            return Ok(Vec::new());
        }
        match fences::claim(shards, group, self.instance, &new).await {
            Ok(claims) => {
                self.claimed(&claims);
                Ok(claims)
            }
            Err(e) => {
                self.retry_claims(new);
                Err(e)
            }
        }
    }

    /// Why `partitions` are no longer this member's, if another member
    /// claimed one of them since (the claims on the metadata shard).
    pub async fn claimed_by_others(
        &self,
        shards: &Shards,
        group: &str,
        partitions: &BTreeSet<i32>,
    ) -> Result<Option<String>, StoreError> {
        let partitions: Vec<i32> = partitions.iter().copied().collect();
        let taken = fences::claimed_by_others(shards, group, self.instance, &partitions).await?;
        Ok((!taken.is_empty()).then(|| {
            format!("partitions {taken:?} were assigned to another consumer after this one took them")
        }))
    }
}

fn partitions_of(tpl: &TopicPartitionList, topic: &str) -> Vec<i32> {
    tpl.elements().iter().filter(|e| e.topic() == topic).map(|e| e.partition()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_assignment_is_held_once_given_and_every_partition_of_it_claimed() {
        let m = Claims::new("t");
        assert!(!m.settled(), "nothing was assigned yet");
        m.assigned(vec![]);
        assert!(m.settled(), "an empty assignment is held at once");
        m.assigned(vec![1, 2]);
        assert!(!m.settled());
        let new = m.take_claims();
        assert_eq!(new, vec![1, 2]);
        m.claimed(&[Claim { partition: 1, gen: 4 }, Claim { partition: 2, gen: 1 }]);
        assert!(m.settled());
        assert_eq!(m.claims_for(&BTreeSet::from([2])), Some(vec![Claim { partition: 2, gen: 1 }]));
        // Given again: the old claim no longer counts until renewed.
        m.assigned(vec![2]);
        assert!(!m.settled());
        assert_eq!(m.claims_for(&BTreeSet::from([2])), None);
    }

    #[tokio::test]
    async fn an_assignment_wakes_whoever_waits_for_it_even_if_it_came_first() {
        let m = Claims::new("t");
        m.assigned(vec![0]);
        tokio::time::timeout(Duration::from_secs(1), m.assignment()).await.expect("woken");
    }
}
