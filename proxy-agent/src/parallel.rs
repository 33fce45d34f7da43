//! Work split over the node's CPUs for the large batches of a start (a
//! manifests file of thousands of documents, thousands of Services computed
//! at once, the repacks after them), on scoped threads. A thread that cannot
//! be made (a container's process limit reached) is no error: its part runs
//! on the calling thread, as it would on a machine of one CPU. A panic in a
//! part is raised in the caller, as it would have been without the thread.

use std::sync::Mutex;
use std::thread::{Builder, Scope, ScopedJoinHandle};

/// The most threads one batch is split over.
pub const MAX_THREADS: usize = 4;

/// How many parts a large batch is split into: the CPUs this process may
/// use (its cgroup's CPU limit included), at most [`MAX_THREADS`].
pub fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(MAX_THREADS))
}

/// Runs `a` on a thread of its own while `b` runs on this one, where the
/// process may use more than one CPU (else one after the other).
pub fn join(a: impl FnOnce() + Send, b: impl FnOnce()) {
    if threads() < 2 {
        a();
        b();
        return;
    }
    let a = Mutex::new(Some(a));
    std::thread::scope(|scope| {
        let other = spawn(scope, &a, true);
        b();
        finish(other, &a);
    });
}

/// The results of `jobs`, in their order: the first runs on this thread,
/// each other one on a thread of its own.
pub fn map_parts<T: Send>(jobs: Vec<impl FnOnce() -> T + Send>) -> Vec<T> {
    map_parts_with(jobs, true)
}

/// [`map_parts`]; `spawn_threads: false` runs every part here, as when no
/// thread can be made.
fn map_parts_with<T: Send>(jobs: Vec<impl FnOnce() -> T + Send>, spawn_threads: bool) -> Vec<T> {
    let jobs: Vec<Mutex<Option<_>>> = jobs.into_iter().map(|j| Mutex::new(Some(j))).collect();
    std::thread::scope(|scope| {
        let others: Vec<_> = jobs
            .iter()
            .skip(1)
            .map(|job| spawn(scope, job, spawn_threads))
            .collect();
        let mut out = Vec::with_capacity(jobs.len());
        out.extend(jobs.first().and_then(take).map(|job| job()));
        for (job, other) in jobs.iter().skip(1).zip(others) {
            out.extend(finish(other, job));
        }
        out
    })
}

/// Starts the job in `slot` on a thread of `scope`; `None` if none could be
/// made (the job stays in its slot).
fn spawn<'scope, 'env, T: Send + 'scope>(
    scope: &'scope Scope<'scope, 'env>,
    slot: &'env Mutex<Option<impl FnOnce() -> T + Send>>,
    spawn_threads: bool,
) -> Option<ScopedJoinHandle<'scope, Option<T>>> {
    if !spawn_threads {
        return None;
    }
    Builder::new()
        .spawn_scoped(scope, move || take(slot).map(|job| job()))
        .ok()
}

/// The job's result: from its thread, or run here if it has none.
fn finish<T>(
    thread: Option<ScopedJoinHandle<'_, Option<T>>>,
    slot: &Mutex<Option<impl FnOnce() -> T>>,
) -> Option<T> {
    let done = thread.and_then(|t| t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
    done.or_else(|| take(slot).map(|job| job()))
}

fn take<F>(slot: &Mutex<Option<F>>) -> Option<F> {
    slot.lock().unwrap_or_else(|e| e.into_inner()).take()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_come_back_in_order_with_or_without_threads() {
        for spawn_threads in [true, false] {
            let jobs: Vec<_> = (0..5u32).map(|i| move || i * 10).collect();
            assert_eq!(
                map_parts_with(jobs, spawn_threads),
                vec![0, 10, 20, 30, 40],
                "threads: {spawn_threads}"
            );
        }
    }

    #[test]
    fn both_sides_of_a_join_run() {
        let (mut a, mut b) = (0, 0);
        join(|| a = 1, || b = 2);
        assert_eq!((a, b), (1, 2));
    }

    #[test]
    fn a_panic_in_a_part_reaches_the_caller() {
        let got = std::panic::catch_unwind(|| {
            let jobs: Vec<Box<dyn FnOnce() -> u32 + Send>> =
                vec![Box::new(|| 1), Box::new(|| panic!("part failed"))];
            map_parts(jobs)
        });
        assert!(got.is_err());
    }
}
