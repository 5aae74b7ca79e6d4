//! How ranks end together. Most mistakes happen on every rank alike (a bad config), but
//! some on one rank alone (its node cannot read the corpus, its GPU is out of memory):
//! the others would then wait in their next collective forever. So each stage of
//! starting a run ends with [`agree`]: the ranks exchange their exit codes, and if any
//! failed, all stop: the rank that failed with its own error, the others quietly
//! ([`PeerFailed`]) with its exit code, so the job's one error line is the real one.

use std::collections::BTreeMap;

use anyhow::Result;

use super::Collective;
pub use crate::error::PeerFailed;
use crate::error::{exit_code_of, user_error};
use crate::util::sha256_hex;

/// `result` if every rank's stage succeeded; otherwise this rank's own error, or
/// [`PeerFailed`] naming the first rank that failed. Where every rank failed alike (the
/// same exit code and message: a mistake in the config they share), only rank 0 keeps
/// its error, so the job says it once.
pub fn agree<T>(comm: &dyn Collective, result: Result<T>) -> Result<T> {
    if comm.size() == 1 {
        return result;
    }
    let mine = match &result {
        Ok(_) => [0.0, 0.0],
        Err(e) => [
            f64::from(exit_code_of(e)),
            hash_words(&format!("{e:#}"), 1)[0],
        ],
    };
    // A rank that waits here for another still preparing sleeps in the barrier.
    comm.barrier()?;
    let codes = comm.all_gather_lists(&mine)?;
    let failed = codes
        .iter()
        .enumerate()
        .find_map(|(rank, code)| (code.first() != Some(&0.0)).then_some(rank));
    let all_alike = codes.iter().all(|code| *code == codes[0]);
    match (result, failed) {
        (result, None) => result,
        (Err(_), Some(0)) if all_alike && comm.rank() > 0 => Err(PeerFailed {
            rank: 0,
            code: mine[0] as i32,
        }
        .into()),
        (Err(e), Some(_)) => Err(e),
        (Ok(_), Some(rank)) => Err(PeerFailed {
            rank,
            code: codes[rank].first().map_or(1, |&c| c as i32),
        }
        .into()),
    }
}

/// Goes on only where every rank holds the same `settings` (`what` names them: "the
/// config"). Ranks that were given different configs or corpora (a file that differs
/// between nodes' disks, an MPMD launch, a path relative to another directory) would
/// otherwise exchange buffers of different sizes, corrupting memory, or wait forever
/// in collectives the others never reach, or train a model nobody asked for. A rank
/// that differs from rank 0 says which settings, and every rank stops.
pub fn same_everywhere(
    comm: &dyn Collective,
    what: &str,
    settings: &BTreeMap<String, String>,
) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    let text: String = settings
        .iter()
        .map(|(key, value)| format!("{key} = {value}\n"))
        .collect();
    let all = comm.all_gather_lists(&hash_words(&text, 3))?;
    if all.iter().all(|hash| *hash == all[0]) {
        return Ok(());
    }
    let mut first = text.into_bytes();
    comm.broadcast_bytes(0, &mut first)?;
    let theirs: BTreeMap<&str, &str> = std::str::from_utf8(&first)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.split_once(" = "))
        .collect();
    let mut differing: Vec<String> = settings
        .iter()
        .filter(|(key, value)| theirs.get(key.as_str()) != Some(&value.as_str()))
        .map(|(key, value)| {
            let at_0 = theirs.get(key.as_str()).copied().unwrap_or("none");
            format!("{key} = {value} (rank 0 has {at_0})")
        })
        .collect();
    differing.extend(
        theirs
            .iter()
            .filter(|(key, _)| !settings.contains_key(**key))
            .map(|(key, value)| format!("{key} = none (rank 0 has {value})")),
    );
    let result = match differing.is_empty() {
        true => Ok(()),
        false => Err(user_error(format!(
            "{what} differs from rank 0's: {}; start every rank with the same config, settings and corpus",
            differing.join(", ")
        ))),
    };
    agree(comm, result)
}

/// The first `words` x 32 bits of `text`'s SHA-256, each word an f64 (exact: the
/// collectives gather f64s).
fn hash_words(text: &str, words: usize) -> Vec<f64> {
    let hash = sha256_hex(text.as_bytes());
    (0..words)
        .map(|i| u32::from_str_radix(&hash[8 * i..8 * i + 8], 16).map_or(0.0, f64::from))
        .collect()
}
