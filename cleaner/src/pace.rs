//! The backfill's pace: a fixed ceiling in rows per second
//! (`cleaner.backfill_rate`), or a pace that follows the shards' health
//! (`cleaner.backfill_follow_health`), under that ceiling if one is set.
//!
//! Following health. A probe times a trivial statement on a connection of
//! its own to every shard, every [`PROBE_EVERY`]: the primary-key read of
//! the shard's one-row `bagstore_shard` that every read of entities makes
//! (`storage::topology::shard_epoch`). Before the
//! backfill writes anything, [`BASELINE_PROBES`] of them give each shard's
//! latency as it is without the backfill (its 90th percentile). While the backfill
//! runs, every [`CONTROL_EVERY`] the 90th percentile of the window's probes
//! is compared, shard by shard, with that baseline plus
//! `cleaner.backfill_health_slack_ms`:
//! - every shard within it: the pace rises by a fifth (at least
//!   [`MIN_STEP`] rows/s), but never above twice what the backfill actually
//!   did in the last window, so a pace nobody uses cannot run away;
//! - a shard over it, or a probe that failed: the pace halves (down to
//!   [`MIN_RATE`]).
//!
//! That is additive increase, multiplicative decrease, as in TCP's
//! congestion control; Vitess's table copy pauses on its servers' health in
//! the same spirit. The probe meets what a live writer's statement meets on
//! its way through the server (the run queue on a busy machine, the
//! server's latches, a table's locks), so its latency stands for the
//! writers' commit latency without asking the writers. It does not see fsyncs: the backfill's
//! commits share the log with the writers', and group commit shares the
//! fsyncs (BENCHMARKS.md: CPU, not fsyncs, is what the backfill takes from
//! the writers on two cores).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::MySqlConnection;
use storage::{OnShard, Shards, StoreError};
use tokio_util::sync::CancellationToken;

use crate::metrics::CleanerMetrics;

/// How often each shard is probed.
pub const PROBE_EVERY: Duration = Duration::from_millis(25);
/// How often the pace is adjusted (about ten probes per shard).
pub const CONTROL_EVERY: Duration = Duration::from_millis(250);
/// A probe taking this long counts as this long, and the control goes on
/// without it, so one stalled shard cannot stall the control of the pace.
pub const PROBE_TIMEOUT: Duration = CONTROL_EVERY;
/// Probes per shard taken before the backfill starts, for the baseline.
pub const BASELINE_PROBES: usize = 40;
/// Which quantile of a shard's probes is compared (and makes its
/// baseline): the writers' tail is what a backfill hurts first, so not the
/// median (with it, the full bench's writers fared no better beside a
/// backfill following health than beside an unlimited one).
pub const QUANTILE: f64 = 0.9;
/// The health pace's first value, rows per second.
pub const START_RATE: f64 = 5_000.0;
/// The health pace never goes below this, so a backfill always ends.
pub const MIN_RATE: f64 = 200.0;
/// The smallest rise of the health pace in one step, rows per second.
pub const MIN_STEP: f64 = 1_000.0;
/// Under a health pace, a batch is at most this share of a second's rows
/// (300-row statements at 30,000 rows/s), so the backfill's writes come
/// in small pieces between the writers', not in bursts.
const BATCH_SHARE: f64 = 0.01;
/// The smallest batch under a health pace.
const MIN_BATCH: usize = 50;

/// One control step: the next pace from the present one, whether a shard
/// was over its limit, and the rows per second actually done in the last
/// window.
pub fn next_rate(rate: f64, over: bool, done_per_sec: f64, ceiling: Option<f64>) -> f64 {
    let next = if over {
        rate / 2.0
    } else {
        let rise = (rate / 5.0).max(MIN_STEP);
        (rate + rise).min((2.0 * done_per_sec).max(START_RATE))
    };
    let next = next.max(MIN_RATE);
    match ceiling {
        Some(c) => next.min(c),
        None => next,
    }
}

/// The `q` quantile of `samples` (nearest rank); `None` when there are none.
pub fn quantile(samples: &mut [f64], q: f64) -> Option<f64> {
    if samples.is_empty() {
        return None;
    }
    samples.sort_by(f64::total_cmp);
    let rank = ((samples.len() - 1) as f64 * q).round() as usize;
    Some(samples[rank.min(samples.len() - 1)])
}

/// Whether a shard is over its limit: its window's [`QUANTILE`] of probe
/// latency above `baseline + slack` (ms), or no probe answered in it.
pub fn over(window: &mut [f64], baseline_ms: f64, slack_ms: f64) -> (bool, Option<f64>) {
    match quantile(window, QUANTILE) {
        Some(m) => (m > baseline_ms + slack_ms, Some(m)),
        None => (true, None),
    }
}

/// What the backfill's jobs share: the pace now, and when the next batch
/// may start.
#[derive(Debug)]
pub struct Pace {
    /// Rows per second allowed now; 0: no limit.
    rate: Mutex<f64>,
    /// The earliest start of the next batch.
    next: Mutex<Instant>,
    /// Rows done since the last control step (for [`next_rate`]).
    done: Mutex<u64>,
    follows_health: bool,
}

impl Pace {
    /// A fixed pace: `rate` rows per second, 0 for none.
    pub fn fixed(rate: u64) -> Pace {
        Pace::new(rate as f64, false)
    }

    fn new(rate: f64, follows_health: bool) -> Pace {
        Pace { rate: Mutex::new(rate), next: Mutex::new(Instant::now()), done: Mutex::new(0), follows_health }
    }

    /// Rows per second allowed now (0: no limit).
    pub fn rate(&self) -> f64 {
        *self.rate.lock().expect("pace lock")
    }

    /// Whether the pace follows the shards' health.
    pub fn follows_health(&self) -> bool {
        self.follows_health
    }

    /// How many entities the next batch may take, of at most `max`.
    pub fn batch(&self, max: usize) -> usize {
        if !self.follows_health {
            return max;
        }
        ((self.rate() * BATCH_SHARE) as usize).clamp(MIN_BATCH.min(max), max)
    }

    /// Called after a batch of `rows`: waits until the pace allows the next.
    pub async fn after(&self, rows: u64) {
        *self.done.lock().expect("pace lock") += rows;
        let rate = self.rate();
        if rate <= 0.0 {
            return;
        }
        let at = {
            let mut next = self.next.lock().expect("pace lock");
            let at = (*next).max(Instant::now()) + Duration::from_secs_f64(rows as f64 / rate);
            *next = at;
            at
        };
        tokio::time::sleep_until(at.into()).await;
    }
}

/// The health probe of one shard: a connection of its own (a pooled one
/// would time the pool's queue, which the backfill fills itself).
struct Probe {
    shard: usize,
    conn: Option<MySqlConnection>,
    /// A probe given up on, still running on its connection: it gives the
    /// connection back when its read returns. Until then no other probe
    /// is sent to the shard, so a stalled server does not collect a
    /// connection per probe.
    stalled: Option<tokio::task::JoinHandle<Option<MySqlConnection>>>,
    baseline_ms: f64,
    window: Vec<f64>,
}

impl Probe {
    fn new(shard: usize, conn: MySqlConnection) -> Probe {
        Probe { shard, conn: Some(conn), stalled: None, baseline_ms: 0.0, window: Vec::new() }
    }

    /// One probe: the latency of the shard's epoch read, ms. One that
    /// takes [`PROBE_TIMEOUT`] counts as that long, and so does every probe
    /// while it has not returned; one that fails counts as nothing
    /// (`None`), and the connection is made again next time.
    async fn once(&mut self, shards: &Shards) -> Option<f64> {
        let gave_up = Some(PROBE_TIMEOUT.as_secs_f64() * 1000.0);
        if let Some(h) = self.stalled.take() {
            if !h.is_finished() {
                self.stalled = Some(h);
                return gave_up;
            }
            self.conn = h.await.ok().flatten();
        }
        if self.conn.is_none() {
            let dsn = shards.dsn(self.shard);
            match tokio::time::timeout(PROBE_TIMEOUT, storage::dsn::dedicated_connection(dsn)).await {
                Ok(Ok(c)) => self.conn = Some(c),
                Ok(Err(_)) => return None,
                Err(_) => return gave_up,
            }
        }
        let (shard, mut conn) = (self.shard, self.conn.take()?);
        let t = Instant::now();
        let mut read = Box::pin(async move {
            let r = storage::topology::shard_epoch(shard, &mut conn).await;
            r.ok().map(|_| conn)
        });
        match tokio::time::timeout(PROBE_TIMEOUT, &mut read).await {
            Ok(Some(conn)) => {
                self.conn = Some(conn);
                Some(t.elapsed().as_secs_f64() * 1000.0)
            }
            Ok(None) => None,
            Err(_) => {
                self.stalled = Some(tokio::spawn(read));
                gave_up
            }
        }
    }
}

/// Starts a pace that follows the shards' health (see the module doc):
/// measures the baselines, then adjusts the pace until `stop`. The pace is
/// at most `ceiling` rows/s (0: none).
pub async fn follow_health(
    shards: &Shards,
    table: &str,
    slack_ms: f64,
    ceiling: u64,
    metrics: CleanerMetrics,
    stop: CancellationToken,
) -> Result<(std::sync::Arc<Pace>, tokio::task::JoinHandle<()>), StoreError> {
    let mut probes = Vec::new();
    for shard in shards.ids().into_iter().filter(|s| *s < shards.slots_len()) {
        let conn = storage::dsn::dedicated_connection(shards.dsn(shard)).await.on(shard)?;
        probes.push(Probe::new(shard, conn));
    }
    // The baselines: all shards probed together, as while running.
    for _ in 0..BASELINE_PROBES * 3 {
        if probes.iter().all(|p| p.window.len() >= BASELINE_PROBES) {
            break;
        }
        for p in &mut probes {
            if let Some(ms) = p.once(shards).await {
                p.window.push(ms);
            }
        }
        tokio::time::sleep(PROBE_EVERY).await;
    }
    for p in &mut probes {
        if p.window.len() < BASELINE_PROBES {
            let why =
                format!("the health probe answered {} of {} reads", p.window.len(), BASELINE_PROBES * 3);
            return Err(StoreError::Shard { shard: p.shard, source: sqlx::Error::Protocol(why) });
        }
        p.baseline_ms = quantile(&mut p.window, QUANTILE).unwrap_or(0.0);
        p.window.clear();
    }
    let ceiling = (ceiling > 0).then_some(ceiling as f64);
    let start = ceiling.map_or(START_RATE, |c| c.min(START_RATE));
    let pace = std::sync::Arc::new(Pace::new(start, true));
    let baselines: Vec<(usize, f64)> = probes.iter().map(|p| (p.shard, p.baseline_ms)).collect();
    tracing::info!(index = %table, ?baselines, slack_ms, "backfill pace follows the shards' health");
    let (shards, table, shared) = (shards.clone(), table.to_string(), pace.clone());
    let task = tokio::spawn(async move {
        let gauge = |what: &str, v: f64| metrics.backfill_health.with_label_values(&[&table, what]).set(v);
        metrics.backfill_pace.with_label_values(&[&table]).set(shared.rate());
        // Until the first window: the highest baseline, and its limit.
        let highest = probes.iter().map(|p| p.baseline_ms).fold(0.0, f64::max);
        gauge("probe", highest / 1000.0);
        gauge("limit", (highest + slack_ms) / 1000.0);
        let mut stepped = Instant::now();
        while !stop.is_cancelled() {
            for p in &mut probes {
                if let Some(ms) = p.once(&shards).await {
                    p.window.push(ms);
                }
            }
            if stepped.elapsed() >= CONTROL_EVERY {
                let secs = stepped.elapsed().as_secs_f64();
                stepped = Instant::now();
                // The shard furthest over its baseline is the one shown.
                let (mut any_over, mut shown) = (false, None::<(f64, f64)>);
                for p in &mut probes {
                    let (o, m) = over(&mut p.window, p.baseline_ms, slack_ms);
                    any_over |= o;
                    let m = m.unwrap_or(f64::INFINITY);
                    if shown.is_none_or(|(sm, sb)| m - p.baseline_ms > sm - sb) {
                        shown = Some((m, p.baseline_ms));
                    }
                    p.window.clear();
                }
                let done = std::mem::take(&mut *shared.done.lock().expect("pace lock")) as f64 / secs;
                let rate = {
                    let mut r = shared.rate.lock().expect("pace lock");
                    *r = next_rate(*r, any_over, done, ceiling);
                    *r
                };
                metrics.backfill_pace.with_label_values(&[&table]).set(rate);
                if let Some((m, baseline)) = shown {
                    gauge("probe", m / 1000.0);
                    gauge("limit", (baseline + slack_ms) / 1000.0);
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(PROBE_EVERY) => {}
                _ = stop.cancelled() => {}
            }
        }
        metrics.backfill_pace.with_label_values(&[&table]).set(0.0);
    });
    Ok((pace, task))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pace_halves_when_a_shard_is_over_and_rises_by_a_fifth_when_not() {
        assert_eq!(next_rate(10_000.0, true, 10_000.0, None), 5_000.0);
        assert_eq!(next_rate(10_000.0, false, 10_000.0, None), 12_000.0);
        // At least MIN_STEP, and never below MIN_RATE.
        assert_eq!(next_rate(1_000.0, false, 1_000.0, None), 2_000.0);
        assert_eq!(next_rate(300.0, true, 300.0, None), MIN_RATE);
    }

    #[test]
    fn the_pace_stays_near_what_the_backfill_does_and_under_the_ceiling() {
        // A backfill doing 3,000 rows/s (bound elsewhere) cannot be given
        // more than twice that, however healthy the shards.
        assert_eq!(next_rate(100_000.0, false, 3_000.0, None), 6_000.0);
        // ... but the start rate is always allowed.
        assert_eq!(next_rate(5_000.0, false, 0.0, None), START_RATE);
        assert_eq!(next_rate(50_000.0, false, 50_000.0, Some(20_000.0)), 20_000.0);
        assert_eq!(next_rate(50_000.0, true, 50_000.0, Some(20_000.0)), 20_000.0);
    }

    #[test]
    fn a_shard_is_over_when_its_probes_90th_percentile_passes_baseline_plus_slack_or_none_answered() {
        // Ten probes: the 90th percentile is the ninth smallest.
        let mut quiet = vec![0.3, 0.2, 0.25, 0.3, 0.2, 0.4, 0.3, 0.2, 5.0, 0.3];
        assert_eq!(over(&mut quiet, 0.25, 1.0), (false, Some(0.4)));
        let mut tail = vec![0.3, 0.2, 0.25, 0.3, 0.2, 0.4, 0.3, 2.0, 5.0, 0.3];
        assert_eq!(over(&mut tail, 0.25, 1.0), (true, Some(2.0)));
        assert_eq!(over(&mut [], 0.25, 1.0), (true, None));
        assert_eq!(quantile(&mut [7.0], 0.9), Some(7.0));
    }

    #[tokio::test]
    async fn a_fixed_pace_spaces_batches_and_no_pace_does_not_wait() {
        let pace = Pace::fixed(1000);
        let t = Instant::now();
        for _ in 0..3 {
            pace.after(50).await;
        }
        // Three batches of 50 rows at 1000 rows/s: 150 ms.
        assert!(t.elapsed() >= Duration::from_millis(150), "{:?}", t.elapsed());
        assert_eq!(pace.batch(1000), 1000);
        let none = Pace::fixed(0);
        let t = Instant::now();
        none.after(1_000_000).await;
        assert!(t.elapsed() < Duration::from_millis(100));
    }

    #[test]
    fn a_health_pace_cuts_batches_to_a_hundredth_of_its_rate() {
        let pace = Pace::new(10_000.0, true);
        assert_eq!(pace.batch(1000), 100);
        let slow = Pace::new(200.0, true);
        assert_eq!(slow.batch(1000), MIN_BATCH);
        let fast = Pace::new(1e6, true);
        assert_eq!(fast.batch(1000), 1000);
    }
}
