//! Atomic file writes and content hashes.

use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};

/// Writes `bytes` to `path` atomically: temp file in the same folder, fsync, rename,
/// fsync of the folder. A crash leaves either the old file or the new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut file = AtomicFile::create(path)?;
    file.write_all(bytes)
        .with_context(|| format!("writing {}", path.display()))?;
    file.commit()
}

/// A file written under a temporary name in its folder and renamed into place by
/// [`AtomicFile::commit`]: readers see the old file or the whole new one, never part.
/// Dropped without a commit (an error, a full disk), the temporary file is removed.
pub struct AtomicFile {
    path: PathBuf,
    tmp: PathBuf,
    file: Option<BufWriter<fs::File>>,
}

impl AtomicFile {
    pub fn create(path: &Path) -> Result<Self> {
        let name = path.file_name().context("a file path")?.to_string_lossy();
        let tmp = folder_of(path).join(format!(".{name}.tmp{}", std::process::id()));
        let file = fs::File::create(&tmp).with_context(|| format!("writing {}", tmp.display()))?;
        Ok(Self {
            path: path.to_path_buf(),
            tmp,
            file: Some(BufWriter::with_capacity(1 << 20, file)),
        })
    }

    /// Flushes, fsyncs and renames the file into place.
    pub fn commit(mut self) -> Result<()> {
        let file = self.file.take().expect("not committed yet");
        let finish = || -> std::io::Result<()> {
            let file = file.into_inner().map_err(|e| e.into_error())?;
            file.sync_all()?;
            fs::rename(&self.tmp, &self.path)?;
            // The rename itself must reach the disk.
            fs::File::open(folder_of(&self.path))?.sync_all()
        };
        let result = finish();
        if result.is_err() {
            // A failed flush or fsync (a full disk) must not leave the temporary file.
            let _ = fs::remove_file(&self.tmp);
        }
        result.with_context(|| format!("writing {}", self.path.display()))
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.file.as_mut().expect("not committed").write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.as_mut().expect("not committed").flush()
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

fn folder_of(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Whether the file at `path` begins with `magic` (a format's first bytes).
pub fn file_starts_with(path: &Path, magic: &[u8]) -> bool {
    use std::io::Read;
    let mut start = vec![0u8; magic.len()];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut start))
        .is_ok()
        && start == magic
}

/// The SHA-256 of `bytes`, as 64 lowercase hex digits.
pub fn sha256_hex(bytes: &[u8]) -> String {
    sha256_hex_of([bytes])
}

/// The SHA-256 of everything `reader` yields, and its length, read a MiB at a time.
pub fn sha256_hex_of_reader(mut reader: impl std::io::Read) -> std::io::Result<(String, u64)> {
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    let mut len = 0u64;
    loop {
        match reader.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => {
                hasher.update(&buffer[..n]);
                len += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok((hex(&hasher.finalize()), len))
}

/// The SHA-256 of `parts` one after another, as 64 lowercase hex digits.
pub fn sha256_hex_of<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> String {
    let mut hasher = Sha256::new();
    for part in parts {
        hasher.update(part);
    }
    hex(&hasher.finalize())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Checks a file path given with `flag` (`--out`) before any work: it names a file (not
/// a folder, nor a path ending in `/`), ends in one of `extensions` (the first is the
/// one suggested; none: any name), and its folder exists. Each is a one-line user
/// error naming the fix.
pub fn check_output_file(flag: &str, path: &Path, extensions: &[&str]) -> Result<()> {
    let shown = path.display().to_string();
    let suggested = extensions.first().copied().unwrap_or("out");
    if path.is_dir() || shown.ends_with('/') || shown.ends_with(std::path::MAIN_SEPARATOR) {
        crate::user_bail!(
            "{flag} {shown} is a folder; give a file, e.g. {flag} {}/out.{suggested}",
            shown.trim_end_matches(['/', std::path::MAIN_SEPARATOR])
        );
    }
    let extension = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase());
    if !extensions.is_empty() && !extension.is_some_and(|e| extensions.contains(&e.as_str())) {
        crate::user_bail!(
            "{flag} {shown}: writes {}; end the name with .{suggested}",
            extensions
                .iter()
                .map(|e| format!(".{e}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let folder = folder_of(path);
    if folder.exists() && !folder.is_dir() {
        crate::user_bail!(
            "{flag} {shown}: {} is a file, not a folder; pick another place",
            folder.display()
        );
    }
    if !folder.is_dir() {
        crate::user_bail!(
            "{flag} {shown}: the folder {} does not exist; create it (mkdir -p {}) or pick another",
            folder.display(),
            folder.display()
        );
    }
    // Writable, asked now rather than after the work (a read-only disk, a folder not
    // ours, a name too long): a file that is there is opened for appending, a new one
    // made and removed.
    let probe = if path.exists() {
        fs::OpenOptions::new().append(true).open(path).map(drop)
    } else {
        fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .and_then(|_| fs::remove_file(path))
    };
    if let Err(e) = probe {
        crate::user_bail!("{flag} {shown}: cannot write there ({e}); pick another place");
    }
    Ok(())
}

/// Refuses a folder `path` (given as `flag`) that could not be made: a file where a
/// folder of its path goes, or a place not writable. Asked before the work, as
/// [`check_output_file`] does; creates nothing.
pub fn check_output_folder(flag: &str, path: &Path) -> Result<()> {
    let shown = path.display();
    let mut existing = path;
    while !existing.exists() {
        match existing.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => existing = parent,
            _ => {
                existing = Path::new(".");
                break;
            }
        }
    }
    if !existing.is_dir() {
        crate::user_bail!(
            "{flag} {shown}: {} is a file, not a folder; pick another place",
            existing.display()
        );
    }
    // A folder made and removed again, under a name no one else uses.
    let probe = existing.join(format!(".tinygpt-probe-{}", std::process::id()));
    if let Err(e) = fs::create_dir(&probe).and_then(|_| fs::remove_dir(&probe)) {
        crate::user_bail!(
            "{flag} {shown}: cannot create a folder in {} ({e}); pick another place",
            existing.display()
        );
    }
    Ok(())
}

/// Serialises a path as text, bytes that are not UTF-8 as U+FFFD: a record that names
/// files (a corpus cache's corpus.json) must not fail on a file named in another
/// encoding, which serde refuses. For `#[serde(serialize_with = ...)]`.
pub fn serialize_path_lossy<P: AsRef<Path>, S: serde::Serializer>(
    path: &P,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(&path.as_ref().to_string_lossy())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_whole_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.bin");
        write_atomic(&p, b"first").unwrap();
        write_atomic(&p, b"second").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"second");
        let leftovers: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temp files left behind");
    }

    #[test]
    fn sha256_of_a_reader_is_that_of_its_bytes() {
        // Longer than one read, so the chunks are joined.
        let bytes: Vec<u8> = (0..(3 << 19) + 7).map(|i| (i * 31 % 251) as u8).collect();
        let (hash, len) = sha256_hex_of_reader(bytes.as_slice()).unwrap();
        assert_eq!((hash, len), (sha256_hex(&bytes), bytes.len() as u64));
    }

    #[test]
    fn sha256_of_a_known_text() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
