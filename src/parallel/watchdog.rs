//! A rank that stops answering (stopped with SIGSTOP, hung in a driver, its node
//! frozen but not dead) is not noticed by MPI: the launcher ends a job when a rank
//! dies, but the others wait in their next collective for one that is merely silent,
//! spinning at full speed, holding the cluster's machines until the job's time limit.
//! [`Watched`] is the collective interface with a watch on it: a call that waits longer
//! than the limit ends the whole job with one line saying why (PyTorch's NCCL watchdog
//! does the same, with a 10-minute default).
//!
//! Barriers are not timed: a rank waits in one while rank 0 prepares the corpus, which
//! may take hours on a large one.

use std::io::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;

use super::Collective;

/// The exit code of a job ended by the watch (README's table).
pub const LOST_RANKS: i32 = 4;

/// `inner`, with a watch on every call but [`Collective::barrier`].
pub struct Watched {
    inner: Arc<dyn Collective>,
    waiting: Arc<Waiting>,
}

/// What this rank is waiting in, and since when.
#[derive(Default)]
struct Waiting(Mutex<Option<(Instant, &'static str)>>);

impl Waiting {
    fn enter(&self, what: &'static str) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), what));
    }

    fn leave(&self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// The call being waited in and for how long, if any.
    fn current(&self) -> Option<(Duration, &'static str)> {
        let at = *self.0.lock().unwrap_or_else(|e| e.into_inner());
        at.map(|(since, what)| (since.elapsed(), what))
    }
}

impl Watched {
    /// Watches `inner`'s calls: one that waits longer than `limit` ends the job
    /// (`Collective::abort` with [`LOST_RANKS`]).
    pub fn new(inner: Arc<dyn Collective>, limit: Duration) -> Self {
        let waiting = Arc::new(Waiting::default());
        let watch = (Arc::clone(&inner), Arc::clone(&waiting));
        // Looks often enough that the job ends within a tenth of the limit past it.
        let every = (limit / 10).clamp(Duration::from_millis(100), Duration::from_secs(10));
        std::thread::Builder::new()
            .name("collective watch".into())
            .spawn(move || {
                let (inner, waiting) = watch;
                loop {
                    std::thread::sleep(every);
                    if let Some((waited, what)) = waiting.current().filter(|(w, _)| *w > limit) {
                        let line = format!(
                            "rank {}: error: waited {} s for the other ranks ({what}): one of them is stopped, hung or cut off; ending the job (the last checkpoint stands; if a rank can take this long, e.g. writing a large checkpoint, pass a longer train --collective-timeout)\n",
                            inner.rank(),
                            match waited.as_secs_f64() {
                                s if s < 10.0 => format!("{s:.1}"),
                                s => format!("{s:.0}"),
                            }
                        );
                        // One write: the ranks' lines must not cut into each other.
                        let _ = std::io::stderr().write_all(line.as_bytes());
                        inner.abort(LOST_RANKS)
                    }
                }
            })
            .expect("a thread for the collective watch");
        Self { inner, waiting }
    }

    fn timed<T>(&self, what: &'static str, call: impl FnOnce() -> T) -> T {
        self.waiting.enter(what);
        let result = call();
        self.waiting.leave();
        result
    }
}

impl Collective for Watched {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn local_rank(&self) -> usize {
        self.inner.local_rank()
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn reduce_scatter_sum(&self, send: &[f32], counts: &[usize], recv: &mut [f32]) -> Result<()> {
        self.timed("summing gradients", || {
            self.inner.reduce_scatter_sum(send, counts, recv)
        })
    }

    fn all_gather(&self, send: &[f32], counts: &[usize], recv: &mut [f32]) -> Result<()> {
        self.timed("gathering weights", || {
            self.inner.all_gather(send, counts, recv)
        })
    }

    fn all_gather_lists(&self, mine: &[f64]) -> Result<Vec<Vec<f64>>> {
        self.timed("gathering values", || self.inner.all_gather_lists(mine))
    }

    fn all_reduce_max(&self, value: i64) -> Result<i64> {
        self.timed("agreeing on the next step", || {
            self.inner.all_reduce_max(value)
        })
    }

    fn broadcast_bytes(&self, root: usize, bytes: &mut Vec<u8>) -> Result<()> {
        self.timed("receiving rank 0's bytes", || {
            self.inner.broadcast_bytes(root, bytes)
        })
    }

    fn barrier(&self) -> Result<()> {
        self.inner.barrier()
    }

    fn abort(&self, code: i32) -> ! {
        self.inner.abort(code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The watch sees a call while it lasts, and nothing once it returned. (Built
    /// without its watching thread: a thread left sleeping in the test process makes
    /// the other tests' child processes likelier to hang in qemu-user's fork.)
    #[test]
    fn a_call_is_watched_while_it_lasts() {
        let watched = Watched {
            inner: Arc::new(super::super::Single),
            waiting: Arc::new(Waiting::default()),
        };
        let seen = watched.timed("testing", || watched.waiting.current());
        let (waited, what) = seen.expect("inside the call");
        assert_eq!(what, "testing");
        assert!(waited < Duration::from_secs(1));
        assert!(watched.waiting.current().is_none());
        assert_eq!(watched.all_reduce_max(7).unwrap(), 7);
        assert!(watched.waiting.current().is_none());
    }
}
