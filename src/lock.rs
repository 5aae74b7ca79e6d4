//! One training process per run folder: `train.lock` holds the owner's pid.
//!
//! A second `train` into the same folder is refused with the holder's pid. A lock whose
//! process is gone (killed, crashed) is stale and taken over.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::user_bail;

pub const LOCK_FILE: &str = "train.lock";

/// Held while training; the file is removed on drop.
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
}

impl RunLock {
    pub fn acquire(dir: &Path) -> Result<Self> {
        let path = dir.join(LOCK_FILE);
        for _ in 0..3 {
            match fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut f) => {
                    writeln!(f, "{}", std::process::id())
                        .and_then(|_| f.sync_all())
                        .with_context(|| format!("writing {}", path.display()))?;
                    return Ok(Self { path });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let holder = fs::read_to_string(&path)
                        .ok()
                        .and_then(|s| s.trim().parse::<u32>().ok());
                    match holder {
                        Some(pid) if pid != std::process::id() && process_alive(pid) => user_bail!(
                            "{} is in use by another tinygpt train (pid {pid}); wait for it, stop it, or pick another run.name",
                            dir.display()
                        ),
                        // Created a moment ago by a trainer that has not written its
                        // pid yet.
                        None if just_created(&path) => user_bail!(
                            "{} is being taken by another tinygpt train starting now; wait for it, stop it, or pick another run.name",
                            dir.display()
                        ),
                        // Stale (dead pid, or left empty long ago): take it over.
                        _ => {
                            let _ = fs::remove_file(&path);
                        }
                    }
                }
                Err(e) => {
                    return Err(e).with_context(|| format!("creating {}", path.display()));
                }
            }
        }
        user_bail!(
            "could not take {}; remove it if no training is running",
            path.display()
        )
    }
}

/// Whether the file at `path` was modified in the last few seconds: the pid is written
/// straight after the file is created, so an empty lock older than this was left by a
/// trainer that died in between.
fn just_created(path: &Path) -> bool {
    const WRITING_PID: std::time::Duration = std::time::Duration::from_secs(5);
    fs::metadata(path)
        .and_then(|m| m.modified())
        .is_ok_and(|t| match t.elapsed() {
            Ok(age) => age < WRITING_PID,
            // Stamped ahead of this clock (a file server's clock, a clock stepped back):
            // as young as the gap says.
            Err(ahead) => ahead.duration() < WRITING_PID,
        })
}

impl Drop for RunLock {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

#[cfg(unix)]
fn process_alive(pid: u32) -> bool {
    // Signal 0 checks existence and permission without sending anything.
    // Safety: kill with signal 0 has no effect on the target.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    let exists = r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    exists && !is_zombie(pid)
}

/// A process that has exited but was not yet waited for (a killed MPI rank whose
/// launcher is gone, in a container whose first process reaps nothing) exists, but
/// holds nothing.
#[cfg(unix)]
fn is_zombie(pid: u32) -> bool {
    // /proc/<pid>/stat: "pid (command) state ...", the command in parentheses.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            let after = &stat[stat.rfind(')')? + 1..];
            after.split_whitespace().next().map(|state| state == "Z")
        })
        .unwrap_or(false)
}

#[cfg(windows)]
fn process_alive(pid: u32) -> bool {
    use windows_sys::Win32::Foundation::{CloseHandle, GetLastError, ERROR_ACCESS_DENIED};
    use windows_sys::Win32::System::Threading::{
        GetExitCodeProcess, OpenProcess, PROCESS_QUERY_LIMITED_INFORMATION,
    };
    // STILL_ACTIVE: the exit code of a process that has not exited.
    const STILL_ACTIVE: u32 = 259;
    // Safety: a handle opened here is closed here; a failed open returns null.
    unsafe {
        let handle = OpenProcess(PROCESS_QUERY_LIMITED_INFORMATION, 0, pid);
        if handle.is_null() {
            // Another user's process exists but may not be opened: it holds the lock.
            return GetLastError() == ERROR_ACCESS_DENIED;
        }
        let mut code = 0u32;
        let ok = GetExitCodeProcess(handle, &mut code) != 0;
        CloseHandle(handle);
        !ok || code == STILL_ACTIVE
    }
}

#[cfg(not(any(unix, windows)))]
fn process_alive(_pid: u32) -> bool {
    // No way to ask on this platform: assume the holder lives (a stale lock is removed
    // by hand, as the refusal says).
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_holder_is_refused_and_stale_locks_are_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        // Held by a live process (pid 1 is always alive).
        fs::write(dir.path().join(LOCK_FILE), "1\n").unwrap();
        let err = RunLock::acquire(dir.path()).unwrap_err();
        assert!(format!("{err}").contains("pid 1"), "{err}");
        // A dead pid: a child that has exited.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        fs::write(dir.path().join(LOCK_FILE), format!("{pid}\n")).unwrap();
        let lock = RunLock::acquire(dir.path()).unwrap();
        assert_eq!(
            fs::read_to_string(dir.path().join(LOCK_FILE))
                .unwrap()
                .trim(),
            std::process::id().to_string()
        );
        drop(lock);
        assert!(!dir.path().join(LOCK_FILE).exists());
    }

    #[test]
    fn an_empty_lock_is_held_while_young_and_stale_once_old() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOCK_FILE);
        // Another trainer has created the lock and not yet written its pid.
        fs::write(&path, "").unwrap();
        let err = RunLock::acquire(dir.path()).unwrap_err();
        assert!(format!("{err}").contains("starting now"), "{err}");
        // One that died between the two, a minute ago.
        let minute_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
        fs::File::options()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_modified(minute_ago))
            .unwrap();
        let lock = RunLock::acquire(dir.path()).unwrap();
        assert_eq!(
            fs::read_to_string(&path).unwrap().trim(),
            std::process::id().to_string()
        );
        drop(lock);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn an_exited_process_not_yet_waited_for_holds_nothing() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Exited but not waited for: a zombie, which kill(pid, 0) still finds.
        let start = std::time::Instant::now();
        while !is_zombie(pid) {
            assert!(start.elapsed().as_secs() < 10, "`true` never exited");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!process_alive(pid));
        assert!(process_alive(std::process::id()));
        child.wait().unwrap();
    }
}
