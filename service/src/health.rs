//! Health: `/health/live` and `/health/ready`.
//!
//! Live means the process runs and answers HTTP; nothing is checked, so a
//! hung dependency never gets a process restarted.
//!
//! Ready is the policy (docs/operations.md, "Health"), answered within [`DEADLINE`]
//! whatever hangs, because every check runs at once under that deadline:
//! - **503** while the process starts or drains, or when it can serve
//!   nothing at all: no MySQL shard answers, or the process only consumes
//!   Kafka (an indexer) and the broker does not answer. Starting lasts
//!   until every part that asked to be waited for ([`Health::starting`]:
//!   an index consumer, until it holds its partitions) has started, so a
//!   write made once the process is ready is as fresh in its indexes as
//!   in steady state;
//! - **200 `degraded`** when part is down: a shard stopped or frozen, the
//!   broker, or a part of this process that reported a failure (a relay,
//!   an index consumer, a cleaner sweep); each named in `failing`. One
//!   shard's fault must not take every pod out of its Service, which would
//!   turn a partial outage into a full one;
//! - **200 `ok`** otherwise.
//!
//! Checked on every request: each physical shard answers `SELECT 1`, and
//! (for roles that use Kafka) the broker answers a metadata request. Parts
//! of the process report themselves through [`Health::report`]; a report
//! of failure stands until the same part reports success.

use rdkafka::consumer::{BaseConsumer, Consumer};
use schemas::settings::KafkaSettings;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use storage::Shards;
use tokio::sync::watch;

/// The most a readiness answer takes.
pub const DEADLINE: Duration = Duration::from_millis(1500);

/// Where the process is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    Starting = 0,
    Serving = 1,
    Draining = 2,
}

/// The process's health, shared by its parts (cheap to clone).
#[derive(Clone)]
pub struct Health {
    inner: Arc<Inner>,
}

struct Inner {
    phase: AtomicU8,
    shards: Shards,
    /// Present for processes that use Kafka; created on first use.
    broker: Option<Broker>,
    /// Whether the process has any work without Kafka (an indexer has none).
    needs_broker_for_everything: bool,
    reports: Mutex<BTreeMap<String, String>>,
    /// Parts still starting ([`Health::starting`]): the process is not
    /// ready until this is empty.
    starting: watch::Sender<BTreeSet<String>>,
}

struct Broker {
    settings: KafkaSettings,
    client: Mutex<Option<Arc<BaseConsumer>>>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health").field("phase", &self.phase()).finish()
    }
}

/// One check's outcome: the dependency's name and, if failing, why.
type Check = (String, Option<String>);

impl Health {
    /// `kafka` for processes that use the broker; `kafka_only` when all
    /// their work needs it.
    pub fn new(shards: Shards, kafka: Option<KafkaSettings>, kafka_only: bool) -> Health {
        Health {
            inner: Arc::new(Inner {
                phase: AtomicU8::new(Phase::Starting as u8),
                shards,
                broker: kafka.map(|settings| Broker { settings, client: Mutex::new(None) }),
                needs_broker_for_everything: kafka_only,
                reports: Mutex::default(),
                starting: watch::Sender::new(BTreeSet::new()),
            }),
        }
    }

    pub fn phase(&self) -> Phase {
        match self.inner.phase.load(Ordering::Relaxed) {
            0 => Phase::Starting,
            1 => Phase::Serving,
            _ => Phase::Draining,
        }
    }

    pub fn set_phase(&self, phase: Phase) {
        self.inner.phase.store(phase as u8, Ordering::Relaxed);
    }

    /// A part of the process (`relay s1`, `consumer index_foo`, `sweep`)
    /// says how it is doing: `Err(why)` stands until it reports `Ok`.
    pub fn report(&self, part: &str, outcome: Result<(), String>) {
        let mut reports = self.inner.reports.lock().expect("not poisoned");
        match outcome {
            Ok(()) => {
                reports.remove(part);
            }
            Err(why) => {
                reports.insert(part.to_string(), why);
            }
        }
    }

    /// A part that the process is not ready without (an index consumer
    /// before it holds its partitions): readiness answers 503 `starting`,
    /// naming it in `waiting_for`, until it reports [`Health::started`].
    pub fn starting(&self, part: &str) {
        self.inner.starting.send_modify(|s| {
            s.insert(part.to_string());
        });
    }

    /// `part` has started (see [`Health::starting`]); nothing when it was
    /// not waited for.
    pub fn started(&self, part: &str) {
        self.inner.starting.send_if_modified(|s| s.remove(part));
    }

    /// The parts still starting, by name.
    pub fn waiting_for(&self) -> Vec<String> {
        self.inner.starting.borrow().iter().cloned().collect()
    }

    /// Returns once no part is starting (see [`Health::starting`]).
    pub async fn until_started(&self) {
        let mut rx = self.inner.starting.subscribe();
        // The sender lives as long as `self`, so this cannot fail.
        let _ = rx.wait_for(BTreeSet::is_empty).await;
    }

    /// The readiness answer: an HTTP status and the body.
    pub async fn ready(&self) -> (u16, Value) {
        let phase = self.phase();
        if phase != Phase::Serving {
            let status = if phase == Phase::Starting { "starting" } else { "draining" };
            return (503, json!({ "status": status }));
        }
        let shard_checks = self.inner.shards.ids().into_iter().map(|id| self.check_shard(id));
        let (shards, broker) = tokio::join!(futures::future::join_all(shard_checks), self.check_broker());
        let shards_down = shards.iter().filter(|(_, why)| why.is_some()).count();
        let mut checks: Vec<Check> = shards;
        let broker_down = broker.as_ref().is_some_and(|(_, why)| why.is_some());
        checks.extend(broker);
        let reports = self.inner.reports.lock().expect("not poisoned").clone();
        checks.extend(reports.into_iter().map(|(part, why)| (part, Some(why))));

        let failing: Vec<Value> = checks
            .iter()
            .filter_map(|(name, why)| why.as_ref().map(|w| json!({ "name": name, "error": w })))
            .collect();
        let all_shards_down = shards_down > 0 && shards_down == self.inner.shards.ids().len();
        let nothing = all_shards_down || (broker_down && self.inner.needs_broker_for_everything);
        let waiting_for = self.waiting_for();
        let (code, status) = match (nothing, waiting_for.is_empty(), failing.is_empty()) {
            (true, _, _) => (503, "unavailable"),
            (false, false, _) => (503, "starting"),
            (false, true, true) => (200, "ok"),
            (false, true, false) => (200, "degraded"),
        };
        let checked: Vec<&str> = checks.iter().map(|(name, _)| name.as_str()).collect();
        let mut body = json!({ "status": status, "failing": failing, "checked": checked });
        if !waiting_for.is_empty() {
            body["waiting_for"] = json!(waiting_for);
        }
        (code, body)
    }

    async fn check_shard(&self, id: usize) -> Check {
        let shards = &self.inner.shards;
        let name = format!("shard {}", shards.name(id));
        let why = match tokio::time::timeout(DEADLINE, shards.ping(id)).await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("{e}")),
            Err(_) => Some(format!("no answer within {} ms (stopped or frozen?)", DEADLINE.as_millis())),
        };
        (name, why)
    }

    async fn check_broker(&self) -> Option<Check> {
        let broker = self.inner.broker.as_ref()?;
        let client = {
            let mut slot = broker.client.lock().expect("not poisoned");
            if slot.is_none() {
                match crate::kafka::create::<BaseConsumer>(&crate::kafka::base_config(&broker.settings)) {
                    Ok(c) => *slot = Some(Arc::new(c)),
                    Err(e) => return Some(("broker".into(), Some(format!("cannot create a client: {e}")))),
                }
            }
            slot.clone().expect("just set")
        };
        let topic = broker.settings.topic.clone();
        let ask = tokio::task::spawn_blocking(move || {
            client.fetch_metadata(Some(&topic), DEADLINE).map(|_| ()).map_err(|e| e.to_string())
        });
        let why = match tokio::time::timeout(DEADLINE + Duration::from_millis(100), ask).await {
            Ok(Ok(Ok(()))) => None,
            Ok(Ok(Err(e))) => Some(e),
            Ok(Err(e)) => Some(format!("the check failed: {e}")),
            Err(_) => Some(format!("no answer within {} ms", DEADLINE.as_millis())),
        };
        Some(("broker".into(), why))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health() -> Health {
        let mysql = schemas::settings::MysqlSettings {
            shards: vec![schemas::settings::Dsn("mysql://root@127.0.0.1:1/never".into())],
            ..Default::default()
        };
        Health::new(Shards::configured(&mysql).expect("shards"), None, false)
    }

    #[tokio::test]
    async fn the_process_starts_once_every_part_it_waits_for_has_started() {
        let h = health();
        h.until_started().await;
        h.starting("consumer index_a");
        h.starting("consumer index_b");
        assert_eq!(h.waiting_for(), ["consumer index_a", "consumer index_b"]);
        let waiting = tokio::spawn({
            let h = h.clone();
            async move { h.until_started().await }
        });
        h.started("consumer index_a");
        h.started("not waited for");
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "index_b has not started");
        h.started("consumer index_b");
        tokio::time::timeout(Duration::from_secs(1), waiting).await.expect("started").expect("joined");
        assert!(h.waiting_for().is_empty());
    }
}
