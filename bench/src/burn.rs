//! The benches' control load: CPU that is not bagstore's.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Threads (one per core needed, at most two) that each spin for a share of
/// every 20 ms and sleep the rest, `cores` cores busy in all, until `stop`.
pub fn burn(cores: f64, stop: Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<()>> {
    let threads = (cores.ceil() as usize).clamp(1, 2);
    let duty = (cores / threads as f64).clamp(0.0, 1.0);
    let period = Duration::from_millis(20);
    (0..threads)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    while t.elapsed() < period.mul_f64(duty) {
                        std::hint::spin_loop();
                    }
                    std::thread::sleep(period.saturating_sub(t.elapsed()));
                }
            })
        })
        .collect()
}
