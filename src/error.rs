//! Errors a user can cause, told apart from bugs.
//!
//! Library code returns `anyhow::Result`. A mistake the user can fix (bad config, missing
//! file, corrupt checkpoint...) is raised as a [`UserError`]: `main` finds it in the error
//! chain, prints its one line and exits with code 2. Anything else is an internal failure
//! (exit code 1).

use std::fmt;

/// A mistake the user can fix: the message names the thing and the fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserError(pub String);

impl fmt::Display for UserError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UserError {}

/// Builds an `anyhow::Error` carrying a [`UserError`].
pub fn user_error(msg: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(UserError(msg.into()))
}

/// `bail!` for user mistakes: `user_bail!("config {path}: ...")`.
#[macro_export]
macro_rules! user_bail {
    ($($arg:tt)*) => {
        return Err($crate::error::user_error(format!($($arg)*)))
    };
}

/// `eprintln!` that cannot panic: a stderr that cannot be written (a log on a full
/// disk, `2>/dev/full`, a reader gone: `train ... | head`) loses the line, not the
/// work. The line is written at once, so the lines of ranks sharing a terminal or a
/// log do not cut into each other.
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let line = format!("{}\n", format_args!($($arg)*));
        let _ = std::io::stderr().write_all(line.as_bytes());
    }};
}

/// Process exit codes, documented in the README and docs/REFERENCE.md.
pub mod exit_code {
    pub const INTERNAL: i32 = 1;
    pub const USER: i32 = 2;
    pub const DIVERGED: i32 = 3;
}

/// Finds the [`UserError`] in an error chain, if there is one.
pub fn find_user_error(err: &anyhow::Error) -> Option<&UserError> {
    err.chain().find_map(|e| e.downcast_ref::<UserError>())
}

/// The context of a write to standard output.
pub const WRITING_STDOUT: &str = "writing to standard output";

/// A write the disk refused for want of room (full, over quota, read-only): the
/// user's to fix (exit code 2), with what to do.
pub fn out_of_storage(err: &anyhow::Error) -> Option<&'static str> {
    use std::io::ErrorKind;
    let to_stdout = err.chain().any(|e| e.to_string() == WRITING_STDOUT);
    if to_stdout && storage_full(err) {
        return Some("the disk standard output goes to is full: free space there or send the output elsewhere");
    }
    err.chain()
        .filter_map(|e| e.downcast_ref::<std::io::Error>())
        .find_map(|e| match e.kind() {
            ErrorKind::StorageFull | ErrorKind::QuotaExceeded => Some(
                "free space there or write elsewhere (training: run.out_dir, data.cache_dir; a run's last complete checkpoint is kept)",
            ),
            ErrorKind::ReadOnlyFilesystem => Some(
                "the filesystem is read-only: write elsewhere (training: run.out_dir, data.cache_dir)",
            ),
            _ => None,
        })
}

fn storage_full(err: &anyhow::Error) -> bool {
    use std::io::ErrorKind;
    err.chain()
        .filter_map(|e| e.downcast_ref::<std::io::Error>())
        .any(|e| matches!(e.kind(), ErrorKind::StorageFull | ErrorKind::QuotaExceeded))
}

/// Training produced a NaN or infinite loss or gradient (exit code 3).
#[derive(Debug, Clone, PartialEq)]
pub struct DivergedError {
    pub step: usize,
    pub lr: f64,
    pub what: &'static str,
    /// The step of the run folder's last checkpoint, if it has one.
    pub checkpoint: Option<usize>,
}

impl fmt::Display for DivergedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "training diverged: the {} is not finite at step {} (learning rate {:.3e}); ",
            self.what, self.step, self.lr
        )?;
        match self.checkpoint {
            Some(step) => write!(
                f,
                "the last checkpoint (step {step}) is kept; lower train.lr or raise train.warmup_iters and resume"
            ),
            None => write!(
                f,
                "no checkpoint was written yet; lower train.lr or raise train.warmup_iters and start again"
            ),
        }
    }
}

impl std::error::Error for DivergedError {}

/// Training stopped by SIGINT or SIGTERM after writing a checkpoint (exit 128 + signal).
#[derive(Debug, Clone, PartialEq)]
pub struct InterruptedError {
    pub signal: i32,
    pub step: usize,
    pub run_dir: std::path::PathBuf,
    /// How to continue, e.g. "the same command and --resume".
    pub continue_with: String,
    /// Whether the run folder holds a checkpoint to continue from (a stop before the
    /// first step trained saves none).
    pub saved: bool,
}

impl fmt::Display for InterruptedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.saved {
            true => write!(
                f,
                "interrupted at step {}; checkpoint saved in {}; continue with {}",
                self.step,
                self.run_dir.display(),
                self.continue_with
            ),
            false => write!(
                f,
                "interrupted at step {} before a step was trained: nothing was saved in {}; start again with {}",
                self.step,
                self.run_dir.display(),
                self.continue_with
            ),
        }
    }
}

impl std::error::Error for InterruptedError {}

/// Another rank of a data-parallel run failed, and said why; this one stops quietly
/// with that rank's exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerFailed {
    pub rank: usize,
    pub code: i32,
}

impl fmt::Display for PeerFailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stopped: rank {} failed (exit {})", self.rank, self.code)
    }
}

impl std::error::Error for PeerFailed {}

/// The exit code for `err`: 2 for a user's mistake, 3 for divergence, 128 + signal for
/// a stop, another rank's code when it failed, 1 for anything else.
pub fn exit_code_of(err: &anyhow::Error) -> i32 {
    if find_user_error(err).is_some() || out_of_storage(err).is_some() {
        return exit_code::USER;
    }
    for cause in err.chain() {
        if let Some(e) = cause.downcast_ref::<InterruptedError>() {
            return 128 + e.signal;
        }
        if let Some(e) = cause.downcast_ref::<crate::util::Stopped>() {
            return 128 + e.signal;
        }
        if let Some(e) = cause.downcast_ref::<PeerFailed>() {
            return e.code;
        }
        if cause.downcast_ref::<DivergedError>().is_some() {
            return exit_code::DIVERGED;
        }
    }
    exit_code::INTERNAL
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn a_full_disk_is_the_users_to_fix() {
        for kind in [
            std::io::ErrorKind::StorageFull,
            std::io::ErrorKind::QuotaExceeded,
            std::io::ErrorKind::ReadOnlyFilesystem,
        ] {
            let err = Err::<(), _>(std::io::Error::from(kind))
                .context("writing checkpoints/r/model.safetensors.next")
                .unwrap_err();
            assert_eq!(exit_code_of(&err), exit_code::USER, "{kind:?}");
            assert!(out_of_storage(&err).unwrap().contains("run.out_dir"));
        }
        let other = Err::<(), _>(std::io::Error::from(std::io::ErrorKind::InvalidData))
            .context("reading")
            .unwrap_err();
        assert_eq!(exit_code_of(&other), exit_code::INTERNAL);
        assert_eq!(out_of_storage(&other), None);
    }
}
