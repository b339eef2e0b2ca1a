//! The operator console at `/` in a real headless browser (Debian's
//! chromium, which the test command installs): while writes flow, the page
//! shows every index and a lag chart with data, and a screenshot of it is
//! written to `target/console.png` (docs/operations.md, "Console").

use bagstore_tests::{Api, TestEnv, STANDARD_INDEXES};
use serde_json::json;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Where the screenshot goes: the workspace's `target/`.
fn screenshot_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/console.png")
}

fn chromium() -> Option<PathBuf> {
    ["/usr/bin/chromium", "/usr/bin/chromium-browser"].iter().map(PathBuf::from).find(|p| p.exists())
}

/// Runs headless chromium on `url` with `args`; its stdout. The virtual
/// time budget lets the page's polling run for that long (network waits
/// pause it, so every poll completes).
async fn browse(url: &str, budget_ms: u32, args: &[&str], profile: &std::path::Path) -> String {
    let bin = chromium().expect("chromium is installed by the test command (scripts/test)");
    let out = bagstore_tests::command(bin)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("--virtual-time-budget={budget_ms}"))
        .args(args)
        .arg(url)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(90), out)
        .await
        .expect("chromium finished")
        .expect("run chromium");
    assert!(out.status.success(), "chromium failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The `data-points` count of the lag chart's line of `index`, if drawn.
fn points_of(dom: &str, svg: &str, index: &str) -> Option<usize> {
    let chart = &dom[dom.find(&format!("id=\"{svg}\""))?..];
    let chart = &chart[..chart.find("</svg>")?];
    let line = &chart[chart.find(&format!("data-index=\"{index}\""))?..];
    let start = line.find("data-points=\"")? + "data-points=\"".len();
    line[start..].split('"').next()?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_shows_every_index_and_a_lag_chart_while_writes_flow() {
    let env = TestEnv::new("console", STANDARD_INDEXES).await;
    let dev = env.dev().await;
    let api = dev.api();
    let writing = Arc::new(AtomicBool::new(true));
    let flag = writing.clone();
    let writer = Api::clone(&api);
    let load = tokio::spawn(async move {
        let mut n = 0u64;
        while flag.load(Ordering::Relaxed) {
            n += 1;
            let body = json!({
                "user_id": uuid::Uuid::new_v4().to_string(),
                "first_name": format!("n{n}"), "last_name": "console",
                "bar": n as i64, "tags": ["a", "b"]
            });
            let (status, _) = writer.post_entity(&body).await;
            assert!(status == 200 || status == 201, "write refused: {status}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    let profile = tempfile::tempdir().expect("profile dir");

    let dom = browse(&dev.url, 6000, &["--dump-dom"], profile.path()).await;
    for index in ["index_user_id", "index_user_name", "index_foo", "index_tag"] {
        assert!(dom.contains(&format!("<td>{index}</td>")), "{index} is not in the indexes table:\n{dom}");
        let events = points_of(&dom, "lag-events", index);
        let seconds = points_of(&dom, "lag-seconds", index);
        assert!(
            events.is_some_and(|n| n >= 2) && seconds.is_some_and(|n| n >= 2),
            "the lag charts have no line with data for {index} ({events:?}, {seconds:?}):\n{dom}"
        );
    }
    assert!(dom.contains("<td>s0</td>") && dom.contains("<td>s1</td>"), "shards missing:\n{dom}");
    // Kafka ingest is on in dev: its lag is a number (nothing is produced
    // to it here, so 0), not "off" and not unknown.
    assert!(dom.contains("<b id=\"ingest-lag\">0</b>"), "no ingest lag shown:\n{dom}");
    assert!(!dom.contains("class=\"error\""), "the page shows an error:\n{dom}");

    let shot = screenshot_path();
    let _ = std::fs::remove_file(&shot);
    browse(
        &dev.url,
        6000,
        &[&format!("--screenshot={}", shot.display()), "--window-size=1280,900"],
        profile.path(),
    )
    .await;
    let png = std::fs::read(&shot).expect("the screenshot was written");
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "not a screenshot: {} bytes", png.len());
    eprintln!("console screenshot: {}", shot.display());

    writing.store(false, Ordering::Relaxed);
    load.await.expect("the writes went through");
}
