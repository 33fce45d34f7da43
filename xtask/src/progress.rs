//! Progress of long-running commands (setup's Go builds, a lab bringing up
//! many pods or applying many objects, the bench): plain lines on stderr,
//! saying what, how many of how many, and the time elapsed, so a terminal
//! and a CI log both show that work goes on. No spinners, no cursor moves.

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// `4 s`, `2 min 05 s`, `1 h 02 min`.
pub fn elapsed(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..=59 => format!("{s} s"),
        60..=3599 => format!("{} min {:02} s", s / 60, s % 60),
        _ => format!("{} h {:02} min", s / 3600, s % 3600 / 60),
    }
}

/// While alive, prints `  ... <what>: <elapsed> so far` every `every`: for
/// one long step that says nothing itself (a `go build`, a large apply).
pub struct Heartbeat {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Heartbeat {
    /// Lines to stderr.
    pub fn start(what: impl Into<String>, every: Duration) -> Self {
        Self::start_with(what, every, |line| eprintln!("{line}"))
    }

    /// Lines to `sink` (tests).
    pub fn start_with(
        what: impl Into<String>,
        every: Duration,
        sink: impl Fn(String) + Send + 'static,
    ) -> Self {
        let what = what.into();
        let (tx, rx) = mpsc::channel::<()>();
        let started = Instant::now();
        let thread = std::thread::spawn(move || {
            // A message or a hang-up both end it.
            while let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(every) {
                sink(format!(
                    "  ... {what}: {} so far",
                    elapsed(started.elapsed())
                ));
            }
        });
        Heartbeat {
            stop: Some(tx),
            thread: Some(thread),
        }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Counts the items of a long loop: [`tick`](Counter::tick) prints
/// `<what>: <done> of <total> (<elapsed>)` when `every` has passed since
/// the last line, and always for the last item. Quiet when `total` is below
/// `min_total` (a loop that short needs no progress).
pub struct Counter {
    what: String,
    total: usize,
    done: usize,
    started: Instant,
    last: Instant,
    every: Duration,
    quiet: bool,
}

impl Counter {
    pub fn new(what: impl Into<String>, total: usize, min_total: usize, every: Duration) -> Self {
        let now = Instant::now();
        Counter {
            what: what.into(),
            total,
            done: 0,
            started: now,
            last: now,
            every,
            quiet: total < min_total,
        }
    }

    /// One more item done; prints the line when it is due.
    pub fn tick(&mut self) {
        if let Some(line) = self.tick_at(Instant::now()) {
            eprintln!("{line}");
        }
    }

    /// [`tick`](Counter::tick)'s line at `now`, if one is due.
    pub fn tick_at(&mut self, now: Instant) -> Option<String> {
        self.done += 1;
        if self.quiet {
            return None;
        }
        let last_one = self.done >= self.total;
        if !last_one && now.duration_since(self.last) < self.every {
            return None;
        }
        self.last = now;
        Some(format!(
            "{}: {} of {} ({})",
            self.what,
            self.done,
            self.total,
            elapsed(now.duration_since(self.started))
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn elapsed_reads_as_a_person_would_say_it() {
        assert_eq!(elapsed(Duration::from_secs(4)), "4 s");
        assert_eq!(elapsed(Duration::from_secs(125)), "2 min 05 s");
        assert_eq!(elapsed(Duration::from_secs(3720)), "1 h 02 min");
    }

    #[test]
    fn counter_prints_when_due_and_at_the_end() {
        let mut c = Counter::new("pods", 4, 2, Duration::from_secs(5));
        let t0 = c.started;
        assert_eq!(c.tick_at(t0 + Duration::from_secs(1)), None);
        assert_eq!(
            c.tick_at(t0 + Duration::from_secs(6)).as_deref(),
            Some("pods: 2 of 4 (6 s)")
        );
        assert_eq!(c.tick_at(t0 + Duration::from_secs(7)), None);
        assert_eq!(
            c.tick_at(t0 + Duration::from_secs(8)).as_deref(),
            Some("pods: 4 of 4 (8 s)")
        );
        let mut short = Counter::new("pods", 1, 2, Duration::ZERO);
        assert_eq!(short.tick_at(Instant::now()), None);
    }

    #[test]
    fn heartbeat_beats_until_dropped() {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        let hb = Heartbeat::start_with("building x", Duration::from_millis(20), move |l| {
            sink.lock().unwrap().push(l)
        });
        std::thread::sleep(Duration::from_millis(110));
        drop(hb);
        let n = lines.lock().unwrap().len();
        assert!(n >= 2, "{n} lines");
        assert!(lines.lock().unwrap()[0].starts_with("  ... building x: "));
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(lines.lock().unwrap().len(), n, "beats after the drop");
    }
}
