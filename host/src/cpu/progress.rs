//! A progress line on stderr for CPU work that takes more than a couple of seconds:
//! nothing for short runs, then one line redrawn in place on a terminal (a new line
//! every few seconds when stderr is a file or a pipe).

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Nothing is shown before this much time has passed ...
const SHOW_AFTER: Duration = Duration::from_secs(1);
/// ... nor unless the whole run looks like taking at least this long.
const SHOW_IF_TOTAL: f64 = 2.0;
/// Redraws on a terminal at most this often; lines to a file at most this often.
const TTY_EVERY: Duration = Duration::from_millis(200);
const FILE_EVERY: Duration = Duration::from_secs(5);

pub(crate) struct Progress {
    /// `None`: count but never print.
    label: Option<String>,
    total: f64,
    done: f64,
    start: Instant,
    last: Option<Instant>,
    tty: bool,
}

impl Progress {
    /// Progress over `total` flops, printed under `label` (if any).
    pub(crate) fn new(label: Option<&str>, total: f64) -> Progress {
        Progress {
            label: label.map(str::to_string),
            total,
            done: 0.0,
            start: Instant::now(),
            last: None,
            tty: std::io::stderr().is_terminal(),
        }
    }

    pub(crate) fn advance(&mut self, flops: f64) {
        self.done += flops;
        if self.label.is_none() || self.total <= 0.0 || self.done >= self.total {
            return;
        }
        let elapsed = self.start.elapsed();
        let fraction = self.done / self.total;
        if elapsed < SHOW_AFTER || elapsed.as_secs_f64() / fraction < SHOW_IF_TOTAL {
            return;
        }
        let every = if self.tty { TTY_EVERY } else { FILE_EVERY };
        if self.last.is_some_and(|t| t.elapsed() < every) {
            return;
        }
        self.last = Some(Instant::now());
        let line = self.line();
        let mut err = std::io::stderr().lock();
        // A progress line that cannot be written is not worth failing the run for.
        let _ = if self.tty { write!(err, "\r{line}\x1b[K") } else { writeln!(err, "{line}") };
        let _ = err.flush();
    }

    fn line(&self) -> String {
        let secs = self.start.elapsed().as_secs_f64();
        let fraction = (self.done / self.total).min(1.0);
        let left = if fraction > 0.0 { secs / fraction - secs } else { 0.0 };
        format!(
            "{}: {:3.0}% of {:.0} GFLOP, {secs:.1} s, {:.1} GFLOP/s, about {left:.0} s left",
            self.label.as_deref().unwrap_or(""),
            100.0 * fraction,
            self.total / 1e9,
            self.done / secs.max(1e-9) / 1e9,
        )
    }

    /// Ends the line if one was shown (with the final state).
    fn finish(&mut self) {
        if self.last.take().is_some() {
            let secs = self.start.elapsed().as_secs_f64();
            let label = self.label.as_deref().unwrap_or("");
            let done = format!("{label}: done, {:.0} GFLOP in {secs:.1} s", self.done / 1e9);
            let mut err = std::io::stderr().lock();
            let _ = if self.tty { writeln!(err, "\r{done}\x1b[K") } else { writeln!(err, "{done}") };
        }
    }
}

/// The line ends when the run does (also on an error's early return).
impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}
