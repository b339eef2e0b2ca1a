//! [`StaleMapRetry`]: what every caller does when the map it routed with
//! turned out stale.
//!
//! A write's ownership proof failed ([`StoreError::NotOwner`]) or a read
//! found a shard's epoch moved ([`StoreError::StaleMap`]): a move completed
//! since the map was loaded, or is in its cutover. The operation is not
//! wrong, only early or misrouted: reload the map, wait a little, and run
//! it again on the owner the reloaded map names. A cutover pauses a logical
//! shard's writes for well under a second, so a short budget covers it; a
//! caller gives up (with the stale-map error) once its budget is spent.
//!
//! Callers count their own retries (each service exports its own series):
//! [`StaleMapRetry::again`] says whether to go again, and
//! [`StaleMapRetry::tries`] how often it said so.
//!
//! [`StoreError::NotOwner`]: crate::StoreError::NotOwner
//! [`StoreError::StaleMap`]: crate::StoreError::StaleMap

use std::time::Duration;
use tokio::time::Instant;

use crate::Shards;

/// The first wait after a stale map; each next one is twice as long.
const FIRST_PAUSE: Duration = Duration::from_millis(5);
/// The longest wait between two tries.
const MAX_PAUSE: Duration = Duration::from_millis(200);

/// The retry loop of an operation whose map was stale: reload, wait a
/// little (longer each time), and go again until the budget is spent.
#[derive(Debug)]
pub struct StaleMapRetry {
    /// None: a budget too long to reach (a caller that retries until done).
    until: Option<Instant>,
    pause: Duration,
    tries: u32,
}

impl StaleMapRetry {
    /// A retry that goes on for `budget` from now (`Duration::MAX`: for
    /// as long as the map keeps being stale).
    pub fn new(budget: Duration) -> StaleMapRetry {
        StaleMapRetry { until: Instant::now().checked_add(budget), pause: FIRST_PAUSE, tries: 0 }
    }

    /// Reloads the map and waits; false (at once, reloading nothing) once
    /// the budget is spent. A map that cannot be reloaded now is logged,
    /// and the wait goes on: the metadata shard may be back by the next
    /// try, and the budget bounds how long that is hoped for.
    pub async fn again(&mut self, shards: &Shards) -> bool {
        if self.until.is_some_and(|until| Instant::now() >= until) {
            return false;
        }
        if let Err(e) = shards.reload().await {
            tracing::warn!(error = %e, "cannot reload the shard map");
        }
        tokio::time::sleep(self.pause).await;
        self.pause = (self.pause * 2).min(MAX_PAUSE);
        self.tries += 1;
        true
    }

    /// How many times [`StaleMapRetry::again`] said to go again.
    pub fn tries(&self) -> u32 {
        self.tries
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shards whose metadata shard never answers: every reload fails fast.
    fn unreachable() -> Shards {
        let mut settings = schemas::settings::MysqlSettings::default();
        settings.shards = vec![schemas::settings::Dsn("mysql://root@127.0.0.1:1/never".into())];
        settings.connect_timeout_ms = 10;
        Shards::configured(&settings).unwrap()
    }

    #[tokio::test]
    async fn it_waits_longer_each_time_and_stops_for_good_at_its_budget() {
        let shards = unreachable();
        let mut retry = StaleMapRetry::new(Duration::MAX);
        let mut pauses = Vec::new();
        for _ in 0..7 {
            pauses.push(retry.pause);
            // A map that cannot be reloaded does not end the retry.
            assert!(retry.again(&shards).await);
        }
        let ms: Vec<u128> = pauses.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [5, 10, 20, 40, 80, 160, 200]);
        assert_eq!((retry.pause, retry.tries()), (MAX_PAUSE, 7));

        let budget = Duration::from_millis(50);
        let (mut retry, start) = (StaleMapRetry::new(budget), Instant::now());
        let mut tries = 0;
        while retry.again(&shards).await {
            tries += 1;
            assert!(tries < 100, "the budget never ran out");
        }
        assert!(tries >= 1 && start.elapsed() >= budget, "{tries} tries in {:?}", start.elapsed());
        let asked = Instant::now();
        assert!(!retry.again(&shards).await);
        assert!(asked.elapsed() < FIRST_PAUSE, "a spent retry neither reloads nor waits");
        assert_eq!(retry.tries(), tries);
    }
}
