//! A request to stop (Ctrl-C, SIGTERM), shared between whoever asks and the work that
//! honours it. Long loops call [`Stop::check`] once per unit of work (an evaluation
//! batch, a wave of encoded chunks, a decoded token) and return [`Stopped`] when asked,
//! so a process stops within about a second, with every file either whole or absent.
//!
//! A `Stop` is a handle, not a global: tests run side by side in one process, each
//! with its own.

use std::fmt;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;

#[derive(Debug, Clone, Default)]
pub struct Stop(Arc<AtomicI32>);

impl Stop {
    /// A handle nobody asks through until [`Stop::request`].
    pub fn new() -> Self {
        Self::default()
    }

    /// A handle over a flag a signal handler sets to the signal's number.
    pub fn from_flag(flag: Arc<AtomicI32>) -> Self {
        Self(flag)
    }

    /// Asks the work to stop, as `signal` (2: SIGINT, 15: SIGTERM) would.
    pub fn request(&self, signal: i32) {
        self.0.store(signal, Ordering::SeqCst);
    }

    /// The signal that asked, if one has.
    pub fn signal(&self) -> Option<i32> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }

    /// `Err(Stopped)` once a stop has been asked for.
    pub fn check(&self) -> Result<(), Stopped> {
        match self.signal() {
            None => Ok(()),
            Some(signal) => Err(Stopped { signal }),
        }
    }
}

/// Work given up because a stop was asked for (exit code 128 + signal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stopped {
    pub signal: i32,
}

impl fmt::Display for Stopped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.signal {
            2 => "Ctrl-C (SIGINT)".to_string(),
            13 => "a closed pipe (SIGPIPE)".to_string(),
            15 => "SIGTERM".to_string(),
            #[cfg(unix)]
            libc::SIGHUP => "SIGHUP (the terminal closed)".to_string(),
            #[cfg(unix)]
            libc::SIGUSR1 => "SIGUSR1".to_string(),
            #[cfg(unix)]
            libc::SIGUSR2 => "SIGUSR2".to_string(),
            s => format!("signal {s}"),
        };
        write!(f, "stopped by {name}")
    }
}

impl std::error::Error for Stopped {}
