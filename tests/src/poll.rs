//! Waiting without sleeping blindly: poll with a deadline.

use std::time::{Duration, Instant};

/// Polls `f` until it returns `Some`, or fails after `deadline`.
pub async fn eventually<T, F, Fut>(what: &str, deadline: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let until = Instant::now() + deadline;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if Instant::now() >= until {
            panic!("timed out after {deadline:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
