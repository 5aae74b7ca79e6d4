//! One training process per run folder: `train.lock`, locked by the trainer.
//!
//! The trainer holds an exclusive lock on the file (`flock` on Unix, `LockFileEx` on
//! Windows) for as long as it runs and writes its pid and host name into it for the
//! refusal's message. The system lets go of the lock when the process ends however it
//! ends (killed, crashed), so a dead trainer's file is free at once, and of two
//! trainers that find it free at the same instant the system lets one take it. A
//! second `train` into the folder is refused naming the holder's pid and host.
//!
//! Where the filesystem cannot lock files (some network and FUSE mounts), the pid in
//! the file decides: a live process holds it, a dead one's lock is taken over. A pid
//! written on another machine cannot be asked after from this one, so such a file is
//! held until it is removed by hand.

use std::fs;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::user_bail;

pub const LOCK_FILE: &str = "train.lock";

/// Held while training; the file is removed on drop (on Windows a locked file is left
/// in place, unlocked: see [`names_this_file`]).
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
    /// Whether dropping the lock removes the file.
    remove: bool,
    /// Open for as long as the lock is held: closing it lets go of the system's lock.
    /// Dropped after `Drop::drop` has removed the file, so the name is gone first.
    _file: fs::File,
}

impl RunLock {
    pub fn acquire(dir: &Path) -> Result<Self> {
        let path = dir.join(LOCK_FILE);
        // A holder that lets go removes the file; one opened just before that removal
        // is locked in vain (another trainer may create and lock the name anew), so a
        // lock counts only on the file the name still holds. Each retry follows a
        // holder that let go meanwhile.
        for _ in 0..8 {
            let open = fs::OpenOptions::new().read(true).write(true).to_owned();
            let (mut file, created) = match open.clone().create_new(true).open(&path) {
                Ok(file) => (file, true),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    match open.open(&path) {
                        Ok(file) => (file, false),
                        // Removed by a holder letting go meanwhile.
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                        Err(e) => {
                            return Err(e).with_context(|| format!("opening {}", path.display()))
                        }
                    }
                }
                Err(e) => return Err(e).with_context(|| format!("creating {}", path.display())),
            };
            match try_lock_awhile(&file) {
                Ok(()) => {
                    if !names_this_file(&path, &file) {
                        continue;
                    }
                    // Not synced: the pid only names the holder in a refusal, and a
                    // crash lets go of the lock anyway.
                    write_holder(&mut file)
                        .with_context(|| format!("writing {}", path.display()))?;
                    return Ok(Self {
                        path,
                        remove: cfg!(unix),
                        _file: file,
                    });
                }
                Err(fs::TryLockError::WouldBlock) => {
                    // A holder letting go holds the file it is removing a moment more.
                    if !names_this_file(&path, &file) {
                        continue;
                    }
                    user_bail!("{}", in_use(dir, Holder::read(&mut file).as_ref()))
                }
                Err(fs::TryLockError::Error(e)) if cannot_lock(&e) => {
                    drop(file);
                    if created {
                        // Empty, it would read as a trainer starting.
                        let _ = fs::remove_file(&path);
                    }
                    return Self::acquire_by_pid(dir, path);
                }
                Err(fs::TryLockError::Error(e)) => {
                    return Err(e).with_context(|| format!("locking {}", path.display()));
                }
            }
        }
        user_bail!(
            "could not take {}: trainers keep taking and leaving it; try again",
            path.display()
        )
    }

    /// Where files cannot be locked: the pid written in the file says who holds it.
    fn acquire_by_pid(dir: &Path, path: PathBuf) -> Result<Self> {
        for _ in 0..3 {
            let holder = fs::File::open(&path)
                .ok()
                .and_then(|mut file| Holder::read(&mut file));
            match holder {
                // Its pid means nothing here: whether it lives cannot be known.
                Some(holder) if !holder.on_this_host() => user_bail!(
                    "{}; if no training runs there, remove {}",
                    in_use(dir, Some(&holder)),
                    path.display()
                ),
                Some(holder) if holder.pid != std::process::id() && process_alive(holder.pid) => {
                    user_bail!("{}", in_use(dir, Some(&holder)))
                }
                // Created a moment ago by a trainer that has not written its pid yet.
                None if path.exists() && just_created(&path) => user_bail!(
                    "{} is being taken by another tinygpt train starting now; wait for it, stop it, or pick another run.name",
                    dir.display()
                ),
                // Stale (dead pid, or left empty long ago): take it over.
                Some(_) | None => {
                    let _ = fs::remove_file(&path);
                }
            }
            match fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut file) => {
                    // Here the pid is the lock: on disk before training starts.
                    write_holder(&mut file)
                        .and_then(|()| file.sync_all())
                        .with_context(|| format!("writing {}", path.display()))?;
                    return Ok(Self {
                        path,
                        remove: true,
                        _file: file,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
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

/// The trainer that holds `dir`, as "pid 4242 on node07", where its lock file names one
/// that lives on this machine, or one on another (whose pid cannot be asked after from
/// here: "if it still runs"). For messages only: it takes no lock, so it never gets in
/// a starting trainer's way.
pub fn holder(dir: &Path) -> Option<String> {
    let mut file = fs::File::open(dir.join(LOCK_FILE)).ok()?;
    let holder = Holder::read(&mut file)?;
    match (&holder.host, holder.on_this_host()) {
        (Some(host), false) => Some(format!("pid {} on {host}, if it still runs", holder.pid)),
        _ if !process_alive(holder.pid) => None,
        (Some(host), true) => Some(format!("pid {} on {host}", holder.pid)),
        (None, _) => Some(format!("pid {}", holder.pid)),
    }
}

/// Whether a lock failed because the filesystem offers none (rather than for a reason
/// to report).
fn cannot_lock(e: &std::io::Error) -> bool {
    #[cfg(unix)]
    if let Some(code) = e.raw_os_error() {
        // ENOLCK: an NFS mount without its lock service.
        // ENOTSUP and EOPNOTSUPP are one number on Linux, two on macOS and the BSDs.
        return [libc::ENOLCK, libc::ENOSYS, libc::EOPNOTSUPP, libc::ENOTSUP].contains(&code);
    }
    e.kind() == std::io::ErrorKind::Unsupported
}

/// The refusal: who holds `dir`, and what to do.
fn in_use(dir: &Path, holder: Option<&Holder>) -> String {
    let who = match holder {
        Some(Holder {
            pid,
            host: Some(host),
        }) => format!(" (pid {pid} on {host})"),
        Some(Holder { pid, host: None }) => format!(" (pid {pid})"),
        // It has not written its pid yet (or, on Windows, its lock keeps the file from
        // being read).
        None => String::new(),
    };
    format!(
        "{} is in use by another tinygpt train{who}; wait for it, stop it, or pick another run.name",
        dir.display()
    )
}

/// Who holds the lock, as its file says: `<pid> <host>` (a file written before the
/// host was added holds the pid alone).
#[derive(Debug, PartialEq)]
struct Holder {
    pid: u32,
    host: Option<String>,
}

impl Holder {
    /// The holder a file names, if its holder has written it yet (and, on Windows, where
    /// the holder's lock keeps its bytes from being read, none).
    fn read(file: &mut fs::File) -> Option<Self> {
        let mut text = String::new();
        file.read_to_string(&mut text).ok()?;
        Self::parse(&text)
    }

    fn parse(text: &str) -> Option<Self> {
        let mut words = text.split_whitespace();
        let pid = words.next()?.parse().ok()?;
        Some(Self {
            pid,
            host: words.next().map(str::to_owned),
        })
    }

    /// Whether the pid is one of this machine's (a file naming no host is taken to be).
    fn on_this_host(&self) -> bool {
        match (&self.host, host_name()) {
            (Some(theirs), Some(ours)) => *theirs == ours,
            _ => true,
        }
    }
}

/// Replaces the file's contents with this process's pid and its machine's name.
fn write_holder(file: &mut fs::File) -> std::io::Result<()> {
    file.set_len(0)?;
    file.rewind()?;
    match host_name() {
        Some(host) => writeln!(file, "{} {host}", std::process::id()),
        None => writeln!(file, "{}", std::process::id()),
    }
}

/// This machine's name, as `hostname` prints it (none if it cannot be read or would
/// not survive the file's one line).
fn host_name() -> Option<String> {
    let name = system_host_name()?;
    let fits = !name.is_empty() && !name.chars().any(char::is_whitespace);
    fits.then_some(name)
}

#[cfg(unix)]
fn system_host_name() -> Option<String> {
    let mut buf = [0u8; 256];
    // Safety: the buffer's length is passed; the name is NUL-terminated within it
    // when it fits (checked below).
    let r = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if r != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0)?;
    String::from_utf8(buf[..end].to_vec()).ok()
}

#[cfg(not(unix))]
fn system_host_name() -> Option<String> {
    std::env::var("COMPUTERNAME").ok()
}

/// Whether `path` still names the open `file` (not removed, nor replaced by a new one).
#[cfg(unix)]
fn names_this_file(path: &Path, file: &fs::File) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (fs::metadata(path), file.metadata()) {
        (Ok(named), Ok(open)) => named.dev() == open.dev() && named.ino() == open.ino(),
        _ => false,
    }
}

/// Elsewhere (Windows) a holder leaves the file in place when it lets go, unlocked,
/// so the name never moves to another file.
#[cfg(not(unix))]
fn names_this_file(_path: &Path, _file: &fs::File) -> bool {
    true
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

/// The file's lock, waiting up to [`EXIT_GRACE`] while another process holds it: a
/// trainer killed a moment ago (`kill -9`, a job's time limit) holds its lock until the
/// kernel has closed its files, and a retry loop restarting it at once was refused.
fn try_lock_awhile(file: &fs::File) -> Result<(), fs::TryLockError> {
    let deadline = std::time::Instant::now() + EXIT_GRACE;
    loop {
        match file.try_lock() {
            Err(fs::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

/// How long a lock held by another process is waited for before it counts as in use.
const EXIT_GRACE: std::time::Duration = std::time::Duration::from_millis(1000);

impl Drop for RunLock {
    fn drop(&mut self) {
        if self.remove {
            let _ = fs::remove_file(&self.path);
        }
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
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn a_held_lock_refuses_a_second_trainer_and_is_free_once_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOCK_FILE);
        let first = RunLock::acquire(dir.path()).unwrap();
        let own = std::process::id();
        assert_eq!(holder_pid(&path), own);
        let err = RunLock::acquire(dir.path()).unwrap_err();
        let named = match host_name() {
            Some(host) => format!("(pid {own} on {host})"),
            None => format!("(pid {own})"),
        };
        assert!(format!("{err}").contains(&named), "{err}");
        drop(first);
        assert_eq!(path.exists(), cfg!(not(unix)));
        drop(RunLock::acquire(dir.path()).unwrap());

        // A holder letting go within the grace (a killed trainer still exiting) is
        // waited for, not refused.
        let held = RunLock::acquire(dir.path()).unwrap();
        let letting_go = std::thread::spawn(move || {
            std::thread::sleep(EXIT_GRACE / 4);
            drop(held);
        });
        let waited = std::time::Instant::now();
        drop(RunLock::acquire(dir.path()).unwrap());
        assert!(waited.elapsed() >= EXIT_GRACE / 4 && waited.elapsed() < EXIT_GRACE);
        letting_go.join().unwrap();
    }

    #[test]
    fn a_file_left_by_a_dead_trainer_is_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOCK_FILE);
        // What a killed trainer leaves: its pid in a file nobody locks. pid 1 lives,
        // so only the missing lock can say the file is free.
        fs::write(&path, "1\n").unwrap();
        let lock = RunLock::acquire(dir.path()).unwrap();
        assert_eq!(holder_pid(&path), std::process::id());
        drop(lock);
    }

    /// The pid the lock file names.
    fn holder_pid(path: &Path) -> u32 {
        Holder::parse(&fs::read_to_string(path).unwrap())
            .unwrap()
            .pid
    }

    #[test]
    fn a_folder_being_trained_names_its_trainer() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(holder(dir.path()), None);
        let lock = RunLock::acquire(dir.path()).unwrap();
        let named = holder(dir.path()).unwrap();
        assert!(
            named.starts_with(&format!("pid {}", std::process::id())),
            "{named}"
        );
        // What `info` says of the folder before its first checkpoint.
        let err = crate::checkpoint::RunDir::new(dir.path())
            .state()
            .unwrap_err();
        assert!(
            format!("{err}").contains(&format!("a trainer ({named})")),
            "{err}"
        );
        drop(lock);
        // A dead trainer's file names nobody.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        fs::write(dir.path().join(LOCK_FILE), format!("{pid}\n")).unwrap();
        assert_eq!(holder(dir.path()), None);
    }

    #[test]
    fn the_file_names_pid_and_host_and_older_files_the_pid_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOCK_FILE);
        let lock = RunLock::acquire(dir.path()).unwrap();
        let written = Holder::parse(&fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(written.pid, std::process::id());
        assert_eq!(written.host, host_name());
        assert!(written.on_this_host());
        drop(lock);
        let old = Holder::parse("4242\n").unwrap();
        assert_eq!((old.pid, old.host.as_deref()), (4242, None));
        assert!(old.on_this_host());
        assert_eq!(Holder::parse(""), None);
        assert_eq!(Holder::parse("node07"), None);
    }

    /// Another process holding the lock (util-linux's `flock`, as a trainer holds it).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_lock_held_by_another_process_refuses_and_its_death_frees_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOCK_FILE);
        fs::write(&path, "").unwrap();
        let mut holder = match std::process::Command::new("flock")
            .args(["--exclusive", "--no-fork"])
            .arg(&path)
            .args(["sleep", "60"])
            .spawn()
        {
            Ok(child) => child,
            Err(e) => {
                crate::errln!("SKIPPED: util-linux's flock is not installed ({e})");
                return;
            }
        };
        let start = std::time::Instant::now();
        while fs::File::open(&path).unwrap().try_lock().is_ok() {
            if let Ok(Some(status)) = holder.try_wait() {
                crate::errln!("SKIPPED: this flock exited ({status}) without holding the file (no --no-fork?)");
                return;
            }
            assert!(start.elapsed().as_secs() < 20, "flock never took the file");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let err = RunLock::acquire(dir.path()).unwrap_err();
        assert!(format!("{err}").contains("in use"), "{err}");
        // Killed as a trainer may be: the system lets go of its lock, and its file
        // (never removed) is taken over at once.
        holder.kill().unwrap();
        holder.wait().unwrap();
        assert!(path.exists());
        drop(RunLock::acquire(dir.path()).unwrap());
    }

    #[test]
    fn trainers_taking_and_leaving_at_once_never_hold_it_together() {
        let dir = Arc::new(tempfile::tempdir().unwrap());
        let holding = Arc::new(AtomicUsize::new(0));
        let taken = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (dir, holding, taken) = (dir.clone(), holding.clone(), taken.clone());
                std::thread::spawn(move || {
                    for _ in 0..5000 {
                        if let Ok(lock) = RunLock::acquire(dir.path()) {
                            assert_eq!(holding.fetch_add(1, Ordering::SeqCst), 0, "two holders");
                            taken.fetch_add(1, Ordering::SeqCst);
                            std::thread::yield_now();
                            holding.fetch_sub(1, Ordering::SeqCst);
                            drop(lock);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(taken.load(Ordering::SeqCst) > 0);
    }

    #[test]
    fn without_file_locks_the_pid_decides() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOCK_FILE);
        // Held by a live process (pid 1 is always alive).
        fs::write(&path, "1\n").unwrap();
        let err = RunLock::acquire_by_pid(dir.path(), path.clone()).unwrap_err();
        assert!(format!("{err}").contains("pid 1"), "{err}");
        // A dead pid: a child that has exited.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        fs::write(&path, format!("{pid}\n")).unwrap();
        let lock = RunLock::acquire_by_pid(dir.path(), path.clone()).unwrap();
        assert_eq!(holder_pid(&path), std::process::id());
        drop(lock);
        assert!(!path.exists());
        // The same dead pid written on another machine: whether it lives there cannot
        // be asked from here, so the file holds until removed by hand.
        fs::write(&path, format!("{pid} another-machine.invalid\n")).unwrap();
        let err = RunLock::acquire_by_pid(dir.path(), path.clone()).unwrap_err();
        let message = format!("{err}");
        assert!(
            message.contains(&format!("(pid {pid} on another-machine.invalid)")),
            "{message}"
        );
        assert!(message.contains("remove"), "{message}");
        fs::remove_file(&path).unwrap();
        // Created a moment ago by a trainer that has not written its pid yet.
        fs::write(&path, "").unwrap();
        let err = RunLock::acquire_by_pid(dir.path(), path.clone()).unwrap_err();
        assert!(format!("{err}").contains("starting now"), "{err}");
        // One that died between the two, a minute ago.
        let minute_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
        fs::File::options()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_modified(minute_ago))
            .unwrap();
        let lock = RunLock::acquire_by_pid(dir.path(), path.clone()).unwrap();
        assert_eq!(holder_pid(&path), std::process::id());
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
