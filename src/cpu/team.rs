//! The threads of a one-stream decoding pass, awake from its start to its end.
//!
//! One token of one stream is about fifty products split over the threads (four a
//! layer and the classifier), each tens to hundreds of microseconds. Through rayon each
//! split wakes a sleeping worker through the kernel and waits for it (2 µs back to back,
//! 5-9 µs after a serial gap, on a 2-core VM), and the pass itself is handed to the pool
//! and waited for: in a profile of int4 decoding, a seventh of the samples were in
//! `sched_yield` and futex waits and wakes. A team's helpers instead spin through the
//! whole pass (and a little after it, across the sampling between two tokens), taking
//! shares of each split from a counter, so a split costs a few cache-line transfers.
//! Between passes they sleep: training and an idle server do not see them.
//!
//! One pass holds the team at a time; a pass begun while another holds it (two decoders
//! on two threads) runs on rayon's pool as before. [`split`] outside a pass is rayon's
//! parallel loop, so code that splits work need not know which it runs under.
//!
//! Which thread runs which share changes no result: a share is a fixed piece of the
//! outputs, computed by the same code whoever takes it.

use std::cell::Cell;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::thread::Thread;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use super::threads::{on_workers, threads};

/// How long helpers spin after a pass ends before they sleep: enough to span the
/// sampling and printing between two tokens (tens of microseconds), so the next pass
/// finds them awake; short enough not to hold a core from other work for long.
const LINGER: Duration = Duration::from_micros(300);

/// One split's work: shares `0..shares`, each taken once, from `next`.
struct Job<'a> {
    work: &'a (dyn Fn(usize) + Sync),
    shares: usize,
    next: AtomicUsize,
    /// A share panicked on a helper (the pass's thread panics in turn).
    panicked: AtomicBool,
}

impl Job<'_> {
    /// Runs shares until none is left.
    fn run(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.shares {
                return;
            }
            (self.work)(i);
        }
    }
}

/// A helper's mailbox: null (nothing offered), a [`Job`] offered by the pass's thread,
/// or [`TAKEN`] while the helper works on it. The pass's thread takes back an offer not
/// yet taken and waits for one taken to come back to null, so a job (on its stack)
/// outlives every helper's use of it.
struct Helper {
    offer: AtomicPtr<()>,
    /// Set by the helper when it starts, for waking it.
    thread: OnceLock<Thread>,
}

/// The mailbox value of a job being worked on: address 1, never a job's (a job is
/// aligned to its pointers).
const TAKEN: *mut () = std::ptr::dangling_mut();

struct Team {
    helpers: Vec<Helper>,
    /// Some pass holds the team.
    held: AtomicBool,
    /// A pass is running: helpers spin instead of sleeping.
    in_pass: AtomicBool,
}

thread_local! {
    /// The team, on the thread whose pass holds it.
    static HOLDING: Cell<Option<&'static Team>> = const { Cell::new(None) };
}

/// The process's team: one helper per thread beyond the caller's; `None` on one thread.
fn team() -> Option<&'static Team> {
    static TEAM: OnceLock<Option<&'static Team>> = OnceLock::new();
    *TEAM.get_or_init(|| {
        // Not more than the CPUs this process may use: a helper spinning where there is
        // no core for it takes the pass thread's.
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let helpers = threads().min(cpus).saturating_sub(1);
        if helpers == 0 {
            return None;
        }
        let team: &'static Team = Box::leak(Box::new(Team {
            helpers: (0..helpers)
                .map(|_| Helper {
                    offer: AtomicPtr::new(std::ptr::null_mut()),
                    thread: OnceLock::new(),
                })
                .collect(),
            held: AtomicBool::new(false),
            in_pass: AtomicBool::new(false),
        }));
        for i in 0..helpers {
            // A helper that fails to start never takes an offer: its shares are run by
            // the pass's thread.
            let _ = std::thread::Builder::new()
                .name(format!("tinygpt-team-{i}"))
                .spawn(move || help(team, i));
        }
        Some(team)
    })
}

/// A helper's life: take offered jobs; spin while a pass runs and for [`LINGER`] after;
/// then sleep until a pass wakes it.
fn help(team: &'static Team, me: usize) {
    let mine = &team.helpers[me];
    let _ = mine.thread.set(std::thread::current());
    let mut idle_since: Option<Instant> = None;
    loop {
        let offered = mine.offer.load(Ordering::Acquire);
        if !offered.is_null() && offered != TAKEN {
            if mine
                .offer
                .compare_exchange(offered, TAKEN, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                // Safety: the offer was this job's address and is now TAKEN: the pass's
                // thread waits for it to return to null before the job leaves its stack.
                let job = unsafe { &*(offered as *const Job<'_>) };
                // A panic must not leave the offer TAKEN (the pass would wait forever).
                if catch_unwind(AssertUnwindSafe(|| job.run())).is_err() {
                    job.panicked.store(true, Ordering::Relaxed);
                }
                mine.offer.store(std::ptr::null_mut(), Ordering::Release);
            }
            idle_since = None;
            continue;
        }
        if team.in_pass.load(Ordering::Relaxed) {
            // Pauses only: a job offered while the helper is in the scheduler would
            // wait for it, and the helpers are no more than the CPUs (see `team`).
            idle_since = None;
            std::hint::spin_loop();
            continue;
        }
        let since = *idle_since.get_or_insert_with(Instant::now);
        if since.elapsed() < LINGER {
            std::hint::spin_loop();
            continue;
        }
        // A pass begun after the check above unparks this thread: park returns at once.
        std::thread::park();
    }
}

/// A spin-wait's step: a pause instruction, and every 4096th time the rest of the time
/// slice given back, so a waiter on a machine with fewer free cores than threads does
/// not hold a core from the thread it waits for.
fn spin_or_yield(spins: &mut u32) {
    *spins = spins.wrapping_add(1);
    if spins.is_multiple_of(4096) {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// Runs `pass` with the team awake, on this thread; helpers take shares of each
/// [`split`] inside it. Without helpers (one thread) it runs `pass` as it is; while
/// another pass holds the team, on rayon's pool (where its splits fork and join).
pub fn pass<R: Send>(pass: impl FnOnce() -> R + Send) -> R {
    if HOLDING.with(Cell::get).is_some() {
        return pass();
    }
    let Some(team) = team() else {
        return pass();
    };
    if team
        .held
        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        return on_workers(pass);
    }
    /// Lets the team go however the pass ends (a panic included).
    struct Holding(&'static Team);
    impl Drop for Holding {
        fn drop(&mut self) {
            HOLDING.with(|h| h.set(None));
            self.0.in_pass.store(false, Ordering::Relaxed);
            self.0.held.store(false, Ordering::Release);
        }
    }
    let _holding = Holding(team);
    team.in_pass.store(true, Ordering::Relaxed);
    for thread in team.helpers.iter().filter_map(|h| h.thread.get()) {
        // A system call only for a helper asleep.
        thread.unpark();
    }
    HOLDING.with(|h| h.set(Some(team)));
    pass()
}

/// Runs `work(i)` once for each share `i` in `0..shares`: on the team inside a [`pass`]
/// (this thread and the helpers each take the next share until none is left), on
/// rayon's pool otherwise.
pub fn split(shares: usize, work: impl Fn(usize) + Sync) {
    if shares <= 1 {
        (0..shares).for_each(work);
        return;
    }
    let Some(team) = HOLDING.with(Cell::get) else {
        (0..shares).into_par_iter().for_each(&work);
        return;
    };
    let job = Job {
        work: &work,
        shares,
        next: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
    };
    let address = &job as *const Job<'_> as *mut ();
    let helpers = &team.helpers[..team.helpers.len().min(shares - 1)];
    for helper in helpers {
        helper.offer.store(address, Ordering::Release);
    }
    {
        let _offered = Offered {
            team,
            helpers,
            address,
        };
        HOLDING.with(|h| h.set(None));
        job.run();
    }
    if job.panicked.load(Ordering::Relaxed) {
        panic!("a share of a split panicked on a helper thread");
    }
}

/// A job offered to `helpers`. While it lives, splits inside a share run on rayon (a
/// nested offer would overwrite the helper's mailbox). When it ends, however the pass's
/// thread leaves its shares (a panic included), offers not taken are taken back and
/// the helpers that took one are waited for: the job on the stack outlives their use.
struct Offered<'t> {
    team: &'static Team,
    helpers: &'t [Helper],
    address: *mut (),
}

impl Drop for Offered<'_> {
    fn drop(&mut self) {
        for helper in self.helpers {
            // Not taken: take it back. Taken: wait until the helper is done with it.
            let back = helper.offer.compare_exchange(
                self.address,
                std::ptr::null_mut(),
                Ordering::Acquire,
                Ordering::Acquire,
            );
            if let Err(mut now) = back {
                let mut spins = 0u32;
                while now == TAKEN {
                    spin_or_yield(&mut spins);
                    now = helper.offer.load(Ordering::Acquire);
                }
            }
        }
        HOLDING.with(|h| h.set(Some(self.team)));
    }
}

/// `slice` cut into pieces of `size` (the last may be shorter), handed out by share.
struct Pieces<'a, T> {
    start: *mut T,
    len: usize,
    size: usize,
    _slice: PhantomData<&'a mut [T]>,
}

// Safety: a share's piece is handed to one thread (`split` runs each share once).
unsafe impl<T: Send> Sync for Pieces<'_, T> {}

impl<'a, T> Pieces<'a, T> {
    fn new(slice: &'a mut [T], size: usize) -> Self {
        Pieces {
            start: slice.as_mut_ptr(),
            len: slice.len(),
            size: size.max(1),
            _slice: PhantomData,
        }
    }

    fn count(&self) -> usize {
        self.len.div_ceil(self.size)
    }

    /// # Safety
    /// Each `i` is asked for once while the pieces live.
    #[allow(clippy::mut_from_ref)]
    unsafe fn piece(&self, i: usize) -> &'a mut [T] {
        let first = i * self.size;
        let len = self.size.min(self.len - first);
        // Safety: first + len <= len of the slice, and pieces do not overlap.
        unsafe { std::slice::from_raw_parts_mut(self.start.add(first), len) }
    }
}

/// `work(i, piece)` for each `size`-long piece of `out` (the last may be shorter), as
/// [`split`] runs shares.
pub fn for_each_piece<T: Send>(out: &mut [T], size: usize, work: impl Fn(usize, &mut [T]) + Sync) {
    let pieces = Pieces::new(out, size);
    // Safety: split runs each share once.
    split(pieces.count(), |i| work(i, unsafe { pieces.piece(i) }));
}

/// Whether this thread's pass holds the team.
pub fn holding() -> bool {
    HOLDING.with(Cell::get).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_share_runs_once_in_a_pass_and_outside() {
        for in_pass in [false, true] {
            let runs: Vec<AtomicUsize> = (0..37).map(|_| AtomicUsize::new(0)).collect();
            let go = || {
                for _ in 0..200 {
                    split(runs.len(), |i| {
                        runs[i].fetch_add(1, Ordering::Relaxed);
                    });
                }
            };
            match in_pass {
                true => pass(go),
                false => go(),
            }
            for (i, r) in runs.iter().enumerate() {
                assert_eq!(
                    r.load(Ordering::Relaxed),
                    200,
                    "share {i}, in a pass: {in_pass}"
                );
            }
        }
    }

    #[test]
    fn a_helper_takes_shares_in_a_pass() {
        if threads() < 2 {
            eprintln!("SKIPPED: one thread (RAYON_NUM_THREADS=1 or one core): no helpers");
            return;
        }
        let start = Instant::now();
        let mut elsewhere = 0;
        // Helpers start asleep; within a pass they join after waking. (A pass begun
        // while another test's holds the team runs on rayon: not counted.)
        while elsewhere == 0 && start.elapsed() < Duration::from_secs(10) {
            pass(|| {
                let me = std::thread::current().id();
                for _ in 0..100 {
                    if !holding() {
                        return;
                    }
                    let other = AtomicUsize::new(0);
                    split(2, |_| {
                        std::thread::sleep(Duration::from_micros(200));
                        if std::thread::current().id() != me {
                            other.fetch_add(1, Ordering::Relaxed);
                        }
                    });
                    elsewhere += other.into_inner();
                }
            });
        }
        assert!(elsewhere > 0, "no share ran off the pass's thread in 10 s");
        assert!(!holding(), "the pass let the team go");
    }

    #[test]
    fn splits_inside_a_share_and_panics_in_one_end_cleanly() {
        let total = AtomicUsize::new(0);
        pass(|| {
            split(4, |_| {
                split(3, |_| {
                    total.fetch_add(1, Ordering::Relaxed);
                })
            })
        });
        assert_eq!(total.into_inner(), 12);
        let panicked = std::panic::catch_unwind(|| {
            pass(|| {
                split(8, |i| {
                    std::thread::sleep(Duration::from_micros(100));
                    assert!(i != 5, "share five fails");
                })
            })
        });
        assert!(panicked.is_err());
        // The team is let go after it: a later pass holds it (other tests' passes may
        // hold it a while) and its splits still run every share.
        let start = Instant::now();
        let mut held = false;
        while !held && start.elapsed() < Duration::from_secs(10) {
            let runs = AtomicUsize::new(0);
            held = pass(|| {
                split(16, |_| {
                    runs.fetch_add(1, Ordering::Relaxed);
                });
                holding()
            });
            assert_eq!(runs.into_inner(), 16);
        }
        assert!(held, "no pass held the team in 10 s after a panic in one");
    }

    #[test]
    fn pieces_cover_the_slice() {
        let mut out = vec![0usize; 1001];
        pass(|| for_each_piece(&mut out, 100, |i, piece| piece.fill(i)));
        assert!(out.iter().enumerate().all(|(k, &v)| v == k / 100));
    }

    #[test]
    fn passes_on_several_threads_at_once_each_finish() {
        let totals: Vec<usize> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..4)
                .map(|t| {
                    scope.spawn(move || {
                        let mut total = 0;
                        for _ in 0..50 {
                            let mut out = vec![0usize; 64];
                            pass(|| for_each_piece(&mut out, 8, |i, p| p.fill(i + t)));
                            total += out.iter().sum::<usize>();
                        }
                        total
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (t, total) in totals.into_iter().enumerate() {
            assert_eq!(total, 50 * 8 * (0..8).map(|i| i + t).sum::<usize>());
        }
    }
}
