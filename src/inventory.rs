//! What tinygpt keeps on disk besides the run folders, and who uses it (`tinygpt
//! cache`): the corpus caches (a folder per corpus version, holding trained tokenizers
//! and the corpus's ids under each tokenizer) and the ids that runs from before the
//! shared cache keep in their own folder (`tokens.bin`).
//!
//! A cache file is used by a run when the run, started again, would read it: the cache
//! folder its config's corpus has now (the same fingerprint), and the tokenizer its
//! folder holds. What no run uses, or what no run has read for longer than an age, is
//! what pruning offers to delete. Nothing here touches a run's checkpoint.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use serde::Serialize;

use crate::checkpoint::{CONFIG_FILE, TOKENIZER_FILE};
use crate::config::Config;
use crate::corpus::cache::{root_for, Manifest, IN_USE_FILE, MANIFEST_FILE, USED_FILE};
use crate::corpus::Corpus;
use crate::error::user_error;
use crate::tokenizer::Tokenizer;
use crate::util::sha256_hex;

/// Files a run from before the shared cache kept its ids in.
pub const LEGACY_FILES: [&str; 2] = ["tokens.bin", "tokens.json"];

/// Everything found, and who uses it.
#[derive(Debug, Serialize)]
pub struct Inventory {
    pub caches: Vec<CacheFolder>,
    pub legacy: Vec<LegacyFile>,
    /// The run folders looked at.
    pub runs: Vec<PathBuf>,
}

/// One corpus version's cache folder.
#[derive(Debug, Serialize)]
pub struct CacheFolder {
    pub dir: PathBuf,
    /// The corpus it was made from (`data.corpus` as the run named it).
    pub corpus: Option<PathBuf>,
    pub bytes: u64,
    /// When a run last read it, in seconds since 1970 (the newest file's time for
    /// folders from before that was noted).
    pub last_used: Option<u64>,
    /// A process (a trainer preparing or reading it) holds it now: never pruned.
    pub in_use: bool,
    pub files: Vec<CacheFile>,
}

/// A tokenizer or a corpus's ids in a cache folder.
#[derive(Debug, Serialize)]
pub struct CacheFile {
    pub path: PathBuf,
    pub kind: &'static str,
    pub bytes: u64,
    /// The runs that would read it.
    pub used_by: Vec<PathBuf>,
}

/// Ids a run keeps in its own folder (from before the shared cache).
#[derive(Debug, Serialize)]
pub struct LegacyFile {
    pub path: PathBuf,
    pub bytes: u64,
    pub run: PathBuf,
}

/// Something pruning would delete, and why.
#[derive(Debug, Serialize)]
pub struct Removal {
    pub path: PathBuf,
    pub bytes: u64,
    pub why: String,
}

impl CacheFolder {
    pub fn used(&self) -> bool {
        self.files.iter().any(|f| !f.used_by.is_empty())
    }
}

/// What a run would read of the caches: its cache folder and tokenizer.
struct RunUse {
    run: PathBuf,
    cache: PathBuf,
    /// The SHA-256 of its tokenizer as the cache names it (`tokenizer.to_json()`).
    tokenizer: String,
}

/// Looks through the run folders in `run_roots` (each a folder of runs, or a run) and
/// the cache folders they point at, plus those under `cache_roots`.
pub fn survey(cache_roots: &[PathBuf], run_roots: &[PathBuf]) -> Result<Inventory> {
    let runs = run_folders(run_roots);
    let mut uses = Vec::new();
    let mut roots: BTreeSet<PathBuf> = cache_roots.iter().cloned().collect();
    for run in &runs {
        if let Some((root, u)) = run_use(run) {
            roots.insert(root);
            uses.extend(u);
        }
    }
    let mut caches = Vec::new();
    for root in &roots {
        let Ok(entries) = std::fs::read_dir(root) else {
            continue;
        };
        let mut dirs: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.join(MANIFEST_FILE).is_file())
            .collect();
        dirs.sort();
        for dir in dirs {
            caches.push(cache_folder(&dir, &uses)?);
        }
    }
    let legacy = runs
        .iter()
        .flat_map(|run| {
            LEGACY_FILES.iter().filter_map(move |name| {
                let path = run.join(name);
                let bytes = std::fs::metadata(&path).ok()?.len();
                Some(LegacyFile {
                    path,
                    bytes,
                    run: run.clone(),
                })
            })
        })
        .collect();
    Ok(Inventory {
        caches,
        legacy,
        runs,
    })
}

/// The run folders (those with a config.toml) in or at `roots`, sorted.
fn run_folders(roots: &[PathBuf]) -> Vec<PathBuf> {
    let mut runs = BTreeSet::new();
    for root in roots {
        if root.join(CONFIG_FILE).is_file() {
            runs.insert(root.clone());
        } else if let Ok(entries) = std::fs::read_dir(root) {
            runs.extend(
                entries
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| p.join(CONFIG_FILE).is_file()),
            );
        }
    }
    runs.into_iter().collect()
}

/// The cache root a run's config points at, and what it would read there: nothing
/// when its corpus is gone or is token files (read as they are).
fn run_use(run: &Path) -> Option<(PathBuf, Option<RunUse>)> {
    let text = std::fs::read_to_string(run.join(CONFIG_FILE)).ok()?;
    let config = Config::from_toml_str(&text, &[]).ok()?;
    let data = &config.data;
    let root = root_for(&data.cache_dir, &data.corpus);
    let read = || -> Option<RunUse> {
        let corpus = Corpus::open(&data.corpus, &data.text_field).ok()?;
        if corpus.is_tokenized() {
            return None;
        }
        let fingerprint = corpus.fingerprint(data.fingerprint).ok()?;
        let tokenizer = Tokenizer::from_file(&run.join(TOKENIZER_FILE)).ok()?;
        Some(RunUse {
            run: run.to_path_buf(),
            cache: root.join(format!("{}-{}", corpus.name(), &fingerprint[..16])),
            tokenizer: sha256_hex(tokenizer.to_json().ok()?.as_bytes()),
        })
    };
    let used = read();
    Some((root, used))
}

fn cache_folder(dir: &Path, uses: &[RunUse]) -> Result<CacheFolder> {
    let corpus = std::fs::read(dir.join(MANIFEST_FILE))
        .ok()
        .and_then(|bytes| manifest_corpus(&bytes));
    let here: Vec<&RunUse> = uses.iter().filter(|u| same(&u.cache, dir)).collect();
    let mut files = Vec::new();
    let mut bytes = 0;
    let mut newest = None;
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| user_error(format!("cannot list {}: {e}", dir.display())))?
        .flatten()
        .map(|e| e.path())
        .collect();
    entries.sort();
    for path in entries {
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        bytes += meta.len();
        let modified = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| d.as_secs());
        newest = newest.max(modified);
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let (kind, used_by) = if name.starts_with("tokenizer-") {
            // Used by the runs that hold this very tokenizer.
            let sha = Tokenizer::from_file(&path)
                .ok()
                .and_then(|t| t.to_json().ok())
                .map(|json| sha256_hex(json.as_bytes()));
            let runs = here
                .iter()
                .filter(|u| Some(&u.tokenizer) == sha.as_ref())
                .map(|u| u.run.clone())
                .collect();
            ("tokenizer", runs)
        } else if let Some(stem) = name.strip_prefix("tokens-") {
            // tokens-<the first 16 of the tokenizer's SHA-256>.bin and its header.
            let prefix = stem.split('.').next().unwrap_or_default();
            let runs = here
                .iter()
                .filter(|u| u.tokenizer.starts_with(prefix))
                .map(|u| u.run.clone())
                .collect();
            ("ids", runs)
        } else if crate::corpus::cache::is_unfinished_write(&name) {
            // A write a killed process never finished (the folder is in use while
            // one is under way): nothing reads it.
            ("unfinished write", Vec::new())
        } else {
            continue;
        };
        files.push(CacheFile {
            path,
            kind,
            bytes: meta.len(),
            used_by,
        });
    }
    let noted = std::fs::read_to_string(dir.join(USED_FILE))
        .ok()
        .and_then(|s| s.trim().parse().ok());
    Ok(CacheFolder {
        dir: dir.to_path_buf(),
        corpus,
        bytes,
        last_used: noted.or(newest),
        in_use: matches!(claim(dir), Claim::Held),
        files,
    })
}

/// The corpus a `corpus.json` names; folders from before it named one list the files
/// alone (the corpus is then the file, or the folder of the files).
fn manifest_corpus(bytes: &[u8]) -> Option<PathBuf> {
    if let Ok(manifest) = serde_json::from_slice::<Manifest>(bytes) {
        return Some(manifest.corpus);
    }
    let files: Vec<crate::corpus::CorpusFile> = serde_json::from_slice(bytes).ok()?;
    match files.as_slice() {
        [one] => Some(one.path.clone()),
        [first, ..] => first.path.parent().map(Path::to_path_buf),
        [] => None,
    }
}

/// Whether two paths name the same folder (as given, or once resolved).
fn same(a: &Path, b: &Path) -> bool {
    a == b
        || matches!(
            (a.canonicalize(), b.canonicalize()),
            (Ok(x), Ok(y)) if x == y
        )
}

/// Whether a process holds a cache folder (see [`IN_USE_FILE`]).
enum Claim {
    /// Nobody does: this process holds it exclusively while the file is open (none
    /// where the folder has no such file, from before it, or the disk cannot lock).
    Free(Option<std::fs::File>),
    Held,
}

fn claim(dir: &Path) -> Claim {
    let open = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join(IN_USE_FILE));
    let Ok(file) = open else {
        return Claim::Free(None);
    };
    match file.try_lock() {
        Ok(()) => Claim::Free(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => Claim::Held,
        Err(_) => Claim::Free(None),
    }
}

/// What pruning deletes: cache folders no run uses (whole), files no run uses in
/// folders that are used, folders no run has read for longer than `older_than`, and the
/// ids runs keep in their own folders. A folder a process holds now (a trainer
/// preparing or reading it, before its run folder says which cache it uses) is left
/// alone, whole.
pub fn removals(inv: &Inventory, older_than: Option<Duration>, now: SystemTime) -> Vec<Removal> {
    let now = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut out = Vec::new();
    for cache in inv.caches.iter().filter(|c| !c.in_use) {
        let age = cache.last_used.map(|t| now.saturating_sub(t));
        let stale = match (older_than, age) {
            (Some(limit), Some(age)) => age > limit.as_secs(),
            _ => false,
        };
        if stale || !cache.used() {
            let why = if stale {
                format!("last used {} ago", span(age.unwrap_or(0)))
            } else {
                "no run uses it".to_string()
            };
            out.push(Removal {
                path: cache.dir.clone(),
                bytes: cache.bytes,
                why,
            });
            continue;
        }
        for file in cache.files.iter().filter(|f| f.used_by.is_empty()) {
            out.push(Removal {
                path: file.path.clone(),
                bytes: file.bytes,
                why: match file.kind {
                    "ids" => "no run uses these ids".to_string(),
                    "unfinished write" => "a write its process never finished (killed)".to_string(),
                    kind => format!("no run uses this {kind}"),
                },
            });
        }
    }
    for file in &inv.legacy {
        out.push(Removal {
            path: file.path.clone(),
            bytes: file.bytes,
            why: format!(
                "ids {} kept from before the shared cache (its checkpoint stays)",
                file.run.display()
            ),
        });
    }
    out
}

/// Deletes what `removals` listed (folders whole), each cache folder under its
/// exclusive lock; what was left because a process took it up since the survey.
pub fn remove(removals: &[Removal]) -> Result<Vec<PathBuf>> {
    let mut left = Vec::new();
    for r in removals {
        let folder = match r.path.is_dir() {
            true => r.path.as_path(),
            false => r.path.parent().unwrap_or(Path::new(".")),
        };
        let Claim::Free(held) = claim(folder) else {
            left.push(r.path.clone());
            continue;
        };
        let done = if r.path.is_dir() {
            std::fs::remove_dir_all(&r.path)
        } else {
            std::fs::remove_file(&r.path)
        };
        drop(held);
        done.map_err(|e| user_error(format!("cannot delete {}: {e}", r.path.display())))?;
    }
    Ok(left)
}

/// "30d", "12h", "2w", "90m", "600s" as a duration.
pub fn parse_age(text: &str) -> Result<Duration> {
    let text = text.trim();
    let (number, unit) = text.split_at(text.len().saturating_sub(1));
    let seconds = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        "w" => 7 * 86_400,
        _ => 0,
    };
    match (number.parse::<u64>(), seconds) {
        // Longer than time has run: nothing is that old.
        (Ok(n), s) if s > 0 => Ok(Duration::from_secs(n.saturating_mul(s))),
        _ => Err(user_error(format!(
            "--older-than {text:?}: give a whole number and a unit: 600s, 90m, 12h, 30d or 2w"
        ))),
    }
}

/// A span of seconds in the largest unit that keeps it above 1: "3 days".
pub fn span(seconds: u64) -> String {
    let units = [
        (7 * 86_400, "week"),
        (86_400, "day"),
        (3600, "hour"),
        (60, "minute"),
    ];
    for (size, name) in units {
        if seconds >= size {
            let n = seconds / size;
            return format!("{n} {name}{}", if n == 1 { "" } else { "s" });
        }
    }
    format!("{seconds} seconds")
}

/// Bytes as people read them: "12.3 MB".
pub fn size(bytes: u64) -> String {
    let b = bytes as f64;
    match b {
        b if b >= 1e9 => format!("{:.2} GB", b / 1e9),
        b if b >= 1e6 => format!("{:.1} MB", b / 1e6),
        b if b >= 1e3 => format!("{:.1} kB", b / 1e3),
        _ => format!("{bytes} B"),
    }
}

/// The inventory as lines for a terminal.
pub fn describe(inv: &Inventory, now: SystemTime) -> String {
    let now = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut out = String::new();
    let used_by = |runs: &[PathBuf]| match runs.len() {
        0 => "unused".to_string(),
        _ => {
            let names: Vec<String> = runs.iter().map(|r| r.display().to_string()).collect();
            format!("used by {}", names.join(", "))
        }
    };
    for c in &inv.caches {
        let corpus = c.corpus.as_ref().map_or("corpus unknown".into(), |p| {
            format!("corpus {}", p.display())
        });
        let last = c.last_used.map_or("never used".into(), |t| {
            format!("last used {} ago", span(now.saturating_sub(t)))
        });
        let busy = if c.in_use { "; in use now" } else { "" };
        out += &format!(
            "{}  ({corpus}; {}, {last}{busy})\n",
            c.dir.display(),
            size(c.bytes)
        );
        for f in &c.files {
            let name = f.path.file_name().unwrap_or_default().to_string_lossy();
            out += &format!("    {name}  {}  {}\n", size(f.bytes), used_by(&f.used_by));
        }
    }
    for f in &inv.legacy {
        out += &format!(
            "{}  {}  (ids from before the shared cache)\n",
            f.path.display(),
            size(f.bytes)
        );
    }
    let total: u64 = inv.caches.iter().map(|c| c.bytes).sum::<u64>()
        + inv.legacy.iter().map(|f| f.bytes).sum::<u64>();
    let runs: BTreeMap<_, _> = inv.runs.iter().map(|r| (r, ())).collect();
    out += &format!(
        "{} in {} cache folder(s) and {} file(s) in run folders; {} run(s) looked at\n",
        size(total),
        inv.caches.len(),
        inv.legacy.len(),
        runs.len()
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_and_sizes_in_words() {
        assert_eq!(parse_age("30d").unwrap(), Duration::from_secs(30 * 86_400));
        assert_eq!(parse_age("12h").unwrap(), Duration::from_secs(12 * 3600));
        assert_eq!(parse_age("2w").unwrap(), Duration::from_secs(14 * 86_400));
        assert_eq!(parse_age("600s").unwrap(), Duration::from_secs(600));
        assert!(parse_age("soon").is_err() && parse_age("5").is_err() && parse_age("d").is_err());
        assert!(
            parse_age("-5d").is_err(),
            "a negative age is refused by parse_age itself"
        );
        // Past u64's seconds: as long as can be (it wrapped to a short age once).
        assert_eq!(
            parse_age("99999999999999999d").unwrap(),
            Duration::from_secs(u64::MAX)
        );
        assert_eq!(span(90), "1 minute");
        assert_eq!(span(3 * 86_400 + 5), "3 days");
        assert_eq!(size(12_300_000), "12.3 MB");
        assert_eq!(size(512), "512 B");
    }
}
