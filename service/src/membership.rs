//! Knowing when this process no longer owns its partitions.
//!
//! A consumer group member owns partitions only while the group coordinator
//! counts it as a member. librdkafka notices most losses itself (a heartbeat
//! answered "unknown member" or "illegal generation", its own session
//! timer) and revokes the partitions as lost. One path it misses with the
//! cooperative protocol: a member whose session expired on the broker while
//! it was between rebalance steps (its own session timer runs only in the
//! steady state; a broker outage during a rebalance is enough) sends
//! JoinGroup with its old member id, is told "unknown member", takes a new
//! id, and rejoins *keeping* its old assignment. It goes on fetching
//! partitions the group has given to someone else meanwhile, and nothing
//! in the consumer ever revokes them.
//!
//! Another it waits out: a member whose JoinGroup was in flight when the
//! broker went away can sit in the join for minutes (until the request
//! times out, max.poll.interval.ms + 3 s), still holding its partitions,
//! while the group, having ended its session, gives them to others.
//!
//! [`Membership`] is the consumer's context and watches for three signs,
//! any of which means the partitions held were given away:
//! - the member id under which they were assigned is no longer the
//!   member's id (the coordinator forgot the member and it rejoined);
//! - an offset commit was refused for an unknown member, an old generation
//!   or a fenced instance;
//! - the consumer has held partitions outside the steady join state for
//!   longer than twice the session timeout (librdkafka's statistics, every
//!   second). A join normally ends within one session timeout: the
//!   coordinator waits for the members it knows, and one that died leaves
//!   when its session ends. Twice that, and the join's request was lost
//!   with the broker, while the coordinator has ended this member's
//!   session (no heartbeats are sent during a join).
//!
//! - another consumer claimed one of its partitions since (a fence of our
//!   own, for brokers that do not tell a replaced member so: tansu accepts
//!   its heartbeats and commits). Each assignment is recorded as a claim
//!   per group and partition on the metadata shard, the newest winning,
//!   and the loop compares before each batch (at most once a second while
//!   idle). Every index write then proves its claims in its own
//!   transaction (`storage::fences`), so even a batch already under way
//!   when the partitions moved cannot land after the new owner's. The
//!   writers' Kafka ingest also compares the claims after applying a round
//!   and before answering it (`writer::ingest`).
//!
//! The consumer (`service::consumer`) then stops applying at once and
//! rebuilds itself (a new member that joins with nothing). Rebuilding
//! costs one more rebalance; the last sign may also fire when a rebalance
//! truly lasts that long (a member slow to rejoin), and then too a fresh
//! member is the safe choice.
//!
//! With member leases (`service::leases`) a consumer never joins the
//! group: it is given partitions by its lease ([`Membership::assigned`]; a
//! changed share gets a new consumer), and of the signs above only the
//! claims apply.

use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::{Statistics, TopicPartitionList};
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CStr;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use storage::fences::{self, Claim};
use storage::{Shards, StoreError};
use tokio::sync::Notify;

/// The consumer context that tracks whether the assignment is still ours.
#[derive(Debug)]
pub struct Membership {
    session_timeout: Duration,
    /// This consumer's identity in the partition claims (random, for its
    /// life: librdkafka's member id changes on a rejoin).
    instance: [u8; 16],
    topic: String,
    state: Mutex<State>,
    /// Woken at each assignment, so its claims are recorded at once (the
    /// consumer holds nothing it may apply until they are).
    assignments: Notify,
}

#[derive(Debug, Default)]
struct State {
    /// The member id at the last assignment; None before the first.
    assigned_as: Option<String>,
    /// Whether an assignment was given at all (an empty one counts: a
    /// group may have more members than partitions).
    assigned_once: bool,
    /// Since when partitions have been held outside the steady join state,
    /// and in which state it was last seen.
    unsteady: Option<(Instant, String)>,
    /// Why the assignment is known lost, once it is.
    lost: Option<String>,
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

    fn revoked(&mut self, partitions: &[i32]) {
        for p in partitions {
            self.claims.remove(p);
        }
        self.to_claim.retain(|p| !partitions.contains(p));
    }
}

impl ClientContext for Membership {
    fn stats(&self, statistics: Statistics) {
        let Some(cgrp) = statistics.cgrp else { return };
        let mut s = self.state.lock().expect("not poisoned");
        if cgrp.join_state == "steady" || cgrp.assignment_size == 0 {
            s.unsteady = None;
            return;
        }
        let since = s.unsteady.get_or_insert_with(|| (Instant::now(), String::new()));
        since.1 = cgrp.join_state.clone();
        let held_for = since.0.elapsed();
        if held_for > 2 * self.session_timeout && s.lost.is_none() {
            s.lost = Some(format!(
                "{} partitions held for {:.1} s outside the steady state (join state {}), longer than twice \
                 the session timeout ({} ms): the join was lost, and the coordinator has ended this member's session",
                cgrp.assignment_size,
                held_for.as_secs_f64(),
                cgrp.join_state,
                self.session_timeout.as_millis()
            ));
        }
    }
}

impl ConsumerContext for Membership {
    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let mut s = self.state.lock().expect("not poisoned");
        match rebalance {
            Rebalance::Assign(tpl) => {
                s.assigned_as = member_id(consumer);
                s.assigned(partitions_of(tpl, &self.topic));
                self.assignments.notify_one();
            }
            Rebalance::Revoke(tpl) => {
                s.revoked(&partitions_of(tpl, &self.topic));
                if consumer.assignment_lost() {
                    // librdkafka saw the loss itself and has taken the partitions away.
                    tracing::info!("partitions revoked as lost by the consumer");
                }
            }
            Rebalance::Error(_) => {}
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, _offsets: &TopicPartitionList) {
        if let Err(KafkaError::ConsumerCommit(code)) = result {
            if is_fencing(code) {
                self.lose(format!("an offset commit was refused: {code}"));
            }
        }
    }
}

impl Membership {
    pub fn new(session_timeout: Duration, topic: &str) -> Membership {
        Membership {
            session_timeout,
            instance: *uuid::Uuid::new_v4().as_bytes(),
            topic: topic.to_string(),
            state: Mutex::default(),
            assignments: Notify::new(),
        }
    }

    /// Notes partitions the consumer was given outside a rebalance (by
    /// leases, `service::leases`): to be claimed before they are applied.
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

    /// Why this member's partitions are no longer its own, if they are not:
    /// a recorded refusal, or partitions held under a member id other than
    /// the current one.
    pub fn lost<C: Consumer<Membership>>(&self, consumer: &C) -> Option<String> {
        let s = self.state.lock().expect("not poisoned");
        if let Some(why) = &s.lost {
            return Some(why.clone());
        }
        let held = consumer.assignment().map(|a| a.count()).unwrap_or(0);
        let now = member_id(consumer);
        match &s.assigned_as {
            Some(was) if held > 0 && now.as_ref() != Some(was) => Some(format!(
                "{held} partitions are held under member id {was:?}, but the member is now {:?} \
                 (its session ended on the broker and it rejoined as a new member)",
                now.unwrap_or_default()
            )),
            _ => None,
        }
    }

    /// The partitions of this member's topic that `consumer` holds.
    pub fn held<C: Consumer<Membership>>(&self, consumer: &C) -> BTreeSet<i32> {
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

    fn lose(&self, why: String) {
        let mut s = self.state.lock().expect("not poisoned");
        s.lost.get_or_insert(why);
    }
}

fn partitions_of(tpl: &TopicPartitionList, topic: &str) -> Vec<i32> {
    tpl.elements().iter().filter(|e| e.topic() == topic).map(|e| e.partition()).collect()
}

/// Commit errors by which the coordinator says "you are not a member of
/// this generation".
fn is_fencing(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::UnknownMemberId
            | RDKafkaErrorCode::IllegalGeneration
            | RDKafkaErrorCode::FencedInstanceId
    )
}

/// The member id the group coordinator gave this consumer (None before the
/// first join; empty while rejoining after a loss). rust-rdkafka does not
/// wrap `rd_kafka_memberid`, hence an unsafe block (the workspace's others
/// are in `devstack::fds`).
#[allow(unsafe_code)]
fn member_id<C: Consumer<Membership>>(consumer: &C) -> Option<String> {
    let rk = consumer.client().native_ptr();
    // SAFETY: `rk` is the live handle `consumer` owns. rd_kafka_memberid
    // returns NULL or a NUL-terminated copy that we own and free with
    // rd_kafka_mem_free.
    unsafe {
        let p = rdkafka::bindings::rd_kafka_memberid(rk);
        if p.is_null() {
            return None;
        }
        let id = CStr::from_ptr(p).to_string_lossy().into_owned();
        rdkafka::bindings::rd_kafka_mem_free(rk, p.cast());
        Some(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_membership_errors_count_as_fencing() {
        assert!(is_fencing(RDKafkaErrorCode::UnknownMemberId));
        assert!(is_fencing(RDKafkaErrorCode::IllegalGeneration));
        assert!(is_fencing(RDKafkaErrorCode::FencedInstanceId));
        assert!(!is_fencing(RDKafkaErrorCode::RequestTimedOut));
        assert!(!is_fencing(RDKafkaErrorCode::RebalanceInProgress));
    }

    #[test]
    fn the_assignment_is_held_once_given_and_every_partition_of_it_claimed() {
        let m = Membership::new(Duration::from_secs(6), "t");
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
        let m = Membership::new(Duration::from_secs(6), "t");
        m.assigned(vec![0]);
        tokio::time::timeout(Duration::from_secs(1), m.assignment()).await.expect("woken");
    }

    #[test]
    fn a_recorded_refusal_is_kept_with_its_first_reason() {
        let m = Membership::new(Duration::from_secs(6), "t");
        m.lose("first".into());
        m.lose("second".into());
        assert_eq!(m.state.lock().unwrap().lost.as_deref(), Some("first"));
    }
}
