//! Logs go to stderr (stdout carries the ready line): human-readable on a
//! terminal, JSON lines otherwise. `RUST_LOG` filters (default `info`).

use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

pub fn init() {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn,rdkafka=warn,librdkafka=warn"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if std::io::stderr().is_terminal() {
        builder.init();
    } else {
        builder.json().flatten_event(true).init();
    }
}
