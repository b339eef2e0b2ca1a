//! Progress of a long command on stderr (stdout keeps the results a script
//! reads): a bar redrawn in place on a terminal, a plain line every two
//! seconds otherwise (logs, CI).

use std::io::{IsTerminal, Write};
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Printer {
    tty: bool,
    last: Mutex<Option<Instant>>,
}

impl Printer {
    pub fn stderr() -> Printer {
        Printer { tty: std::io::stderr().is_terminal(), last: Mutex::new(None) }
    }

    /// `label`, a bar at `ratio` (0 to 1), then `detail`.
    pub fn show(&self, label: &str, ratio: f64, detail: &str) {
        let ratio = ratio.clamp(0.0, 1.0);
        let mut last = self.last.lock().expect("not poisoned");
        let mut out = std::io::stderr().lock();
        if self.tty {
            let width = 30;
            let filled = (ratio * width as f64).round() as usize;
            let bar = format!("{}{}", "#".repeat(filled), ".".repeat(width - filled));
            let _ = write!(out, "\r{label} [{bar}] {:5.1}% {detail} ", ratio * 100.0);
            let _ = out.flush();
        } else if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(2)) {
            *last = Some(Instant::now());
            let _ = writeln!(out, "{label}: {:.1}% {detail}", ratio * 100.0);
        }
    }

    /// Ends the line a bar was drawn on.
    pub fn finish(&self) {
        if self.tty {
            eprintln!();
        }
        *self.last.lock().expect("not poisoned") = None;
    }
}
