//! Two private `mariadbd` servers per test process, started once on a
//! thread of their own (so they outlive each test's runtime) and stopped
//! when the process exits; and names unique to each test, so every test
//! gets fresh databases and topics on them and tests run in parallel.

use devstack::mariadb::{MariaDb, MariaDbOptions};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

/// The ports of this process's two private MariaDB servers.
pub(crate) fn servers() -> &'static [u16] {
    static PORTS: OnceLock<Vec<u16>> = OnceLock::new();
    PORTS.get_or_init(|| start_pair("", opts))
}

/// The ports of two more, started on first use, as production runs MySQL:
/// the binary log on in ROW format. The `BLACKHOLE` engine is loaded for
/// the upgrade test, which makes the tables of an earlier release's
/// binary-log outbox (see `storage::migrate::upgrade`).
pub(crate) fn logged_servers() -> &'static [u16] {
    static PORTS: OnceLock<Vec<u16>> = OnceLock::new();
    PORTS.get_or_init(|| start_pair("logged-", logged_opts))
}

/// Starts two servers on a thread of their own (so they outlive each
/// test's runtime), kept until the process exits.
fn start_pair(prefix: &'static str, opts: fn(usize) -> MariaDbOptions) -> Vec<u16> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(format!("mariadb-{prefix}servers"))
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(async move {
                // Each server's directory sits in the temp dir itself: an
                // ephemeral server's wrapper deletes its own directory, so a
                // parent shared by the two would be left behind, empty.
                let dir = |name: &str| {
                    std::env::temp_dir().join(format!("bagstore-test-{}-{prefix}{name}", std::process::id()))
                };
                let started = futures_lite_join(
                    MariaDb::start_with(&dir("a"), opts(0)),
                    MariaDb::start_with(&dir("b"), opts(1)),
                )
                .await;
                match started {
                    (Ok(a), Ok(b)) => {
                        tx.send(Ok(vec![a.port(), b.port()])).ok();
                        // Keep both alive for the life of the process: the
                        // wrapper stops mariadbd when this process exits.
                        let _keep = (a, b);
                        std::future::pending::<()>().await;
                    }
                    (a, b) => {
                        let err = a.err().or(b.err()).expect("one failed");
                        tx.send(Err(format!("{err:#}"))).ok();
                    }
                }
            });
        })
        .expect("spawn server thread");
    match rx.recv().expect("server thread answers") {
        Ok(ports) => ports,
        Err(e) => panic!("cannot start the private MariaDB servers: {e}"),
    }
}

fn opts(_: usize) -> MariaDbOptions {
    MariaDbOptions { ephemeral: true, ..Default::default() }
}

fn logged_opts(i: usize) -> MariaDbOptions {
    MariaDbOptions {
        ephemeral: true,
        extra_args: vec![
            "--log-bin=binlog".into(),
            "--binlog-format=ROW".into(),
            "--plugin-load-add=ha_blackhole".into(),
            format!("--server-id={}", i + 1),
        ],
        ..Default::default()
    }
}

async fn futures_lite_join<A: std::future::Future, B: std::future::Future>(
    a: A,
    b: B,
) -> (A::Output, B::Output) {
    tokio::join!(a, b)
}

/// A unique, valid identifier for this test's databases and topics.
pub(crate) fn unique(name: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let clean: String =
        name.chars().filter(|c| c.is_ascii_alphanumeric()).take(20).collect::<String>().to_lowercase();
    format!(
        "t{}_{}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        clean,
        rand::random::<u16>()
    )
}
