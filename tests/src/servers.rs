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
    PORTS.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("mariadb-servers".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
                rt.block_on(async move {
                    let base = std::env::temp_dir().join(format!("bagstore-test-{}", std::process::id()));
                    let started = futures_lite_join(
                        MariaDb::start_with(&base.join("a"), opts()),
                        MariaDb::start_with(&base.join("b"), opts()),
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
    })
}

fn opts() -> MariaDbOptions {
    MariaDbOptions { ephemeral: true, ..Default::default() }
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
