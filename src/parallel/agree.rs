//! How ranks end together. Most mistakes happen on every rank alike (a bad config), but
//! some on one rank alone (its node cannot read the corpus, its GPU is out of memory):
//! the others would then wait in their next collective forever. So each stage of
//! starting a run ends with [`agree`]: the ranks exchange their exit codes, and if any
//! failed, all stop: the rank that failed with its own error, the others quietly
//! ([`PeerFailed`]) with its exit code, so the job's one error line is the real one.

use anyhow::Result;

use super::Collective;
use crate::error::exit_code_of;
pub use crate::error::PeerFailed;

/// `result` if every rank's stage succeeded; otherwise this rank's own error, or
/// [`PeerFailed`] naming the first rank that failed.
pub fn agree<T>(comm: &dyn Collective, result: Result<T>) -> Result<T> {
    if comm.size() == 1 {
        return result;
    }
    let mine = match &result {
        Ok(_) => 0,
        Err(e) => exit_code_of(e),
    };
    // A rank that waits here for another still preparing sleeps in the barrier.
    comm.barrier()?;
    let codes = comm.all_gather_lists(&[f64::from(mine)])?;
    let failed = codes
        .iter()
        .enumerate()
        .find_map(|(rank, code)| (code.first() != Some(&0.0)).then_some(rank));
    match (result, failed) {
        (result, None) => result,
        (Err(e), Some(_)) => Err(e),
        (Ok(_), Some(rank)) => Err(PeerFailed {
            rank,
            code: codes[rank].first().map_or(1, |&c| c as i32),
        }
        .into()),
    }
}
