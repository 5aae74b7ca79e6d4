//! The one interface through which ranks combine their work. The trainer and the
//! engines call it without asking what is behind it: [`Single`] for one process, MPI
//! for ranks (`super::mpi`). Every method is collective: every rank calls it, in the
//! same order, with buffers of the same shape (`counts` are the same on every rank).
//!
//! These move host memory. A GPU engine moves its device buffers with the GPUs' own
//! library (NCCL), bootstrapped through [`Collective::broadcast_bytes`].

use anyhow::Result;

/// Sums, gathers and agreements across the ranks of a run.
pub trait Collective: Send + Sync {
    /// This process's rank, from 0.
    fn rank(&self) -> usize;

    /// Ranks in the run.
    fn size(&self) -> usize;

    /// This process's rank among the ranks on its machine (which GPU it takes).
    fn local_rank(&self) -> usize;

    /// What carries the messages, for the run's first line ("Open MPI v4.1.4").
    fn describe(&self) -> String;

    /// Rank r receives, in `recv` (`counts[r]` values), its block of the element-wise
    /// sum over ranks of `send` (the blocks of `counts`, in rank order, end to end).
    fn reduce_scatter_sum(&self, send: &[f32], counts: &[usize], recv: &mut [f32]) -> Result<()>;

    /// Every rank's `send` (`counts[r]` values from rank r), end to end in rank order.
    fn all_gather(&self, send: &[f32], counts: &[usize], recv: &mut [f32]) -> Result<()>;

    /// Every rank's list, in rank order; the lists may differ in length.
    fn all_gather_lists(&self, mine: &[f64]) -> Result<Vec<Vec<f64>>>;

    /// The largest of the ranks' `value`s.
    fn all_reduce_max(&self, value: i64) -> Result<i64>;

    /// Rank `root`'s `bytes` on every rank (the others' are replaced, any length).
    fn broadcast_bytes(&self, root: usize, bytes: &mut Vec<u8>) -> Result<()>;

    /// Returns once every rank has called it. Ranks that arrive early sleep rather
    /// than spin (a rank preparing a corpus for minutes should keep its cores).
    fn barrier(&self) -> Result<()>;

    /// Ends every rank of the run now, with `code` (MPI_Abort): for a failure the other
    /// ranks cannot know about, which would leave them waiting in a collective forever.
    fn abort(&self, code: i32) -> !;
}

/// One process: every collective is the identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct Single;

impl Collective for Single {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn local_rank(&self) -> usize {
        0
    }

    fn describe(&self) -> String {
        "one process".into()
    }

    fn reduce_scatter_sum(&self, send: &[f32], counts: &[usize], recv: &mut [f32]) -> Result<()> {
        check_counts(counts, 1, send.len())?;
        recv.copy_from_slice(send);
        Ok(())
    }

    fn all_gather(&self, send: &[f32], counts: &[usize], recv: &mut [f32]) -> Result<()> {
        check_counts(counts, 1, recv.len())?;
        recv.copy_from_slice(send);
        Ok(())
    }

    fn all_gather_lists(&self, mine: &[f64]) -> Result<Vec<Vec<f64>>> {
        Ok(vec![mine.to_vec()])
    }

    fn all_reduce_max(&self, value: i64) -> Result<i64> {
        Ok(value)
    }

    fn broadcast_bytes(&self, _root: usize, _bytes: &mut Vec<u8>) -> Result<()> {
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        Ok(())
    }

    fn abort(&self, code: i32) -> ! {
        std::process::exit(code)
    }
}

/// `counts` has a block per rank and adds up to `total`.
pub fn check_counts(counts: &[usize], ranks: usize, total: usize) -> Result<()> {
    anyhow::ensure!(
        counts.len() == ranks && counts.iter().sum::<usize>() == total,
        "collective: counts {counts:?} for {ranks} ranks and {total} values"
    );
    Ok(())
}

/// The lists of [`Collective::all_gather_lists`] in the order of the work they came
/// from, when that work was dealt round-robin (item i to rank i mod N, each rank
/// keeping its items in order): rank 0's first, rank 1's first, ..., rank 0's second.
pub fn interleave(lists: &[Vec<f64>]) -> Vec<f64> {
    let longest = lists.iter().map(Vec::len).max().unwrap_or(0);
    (0..longest)
        .flat_map(|j| lists.iter().filter_map(move |list| list.get(j).copied()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaving_undoes_a_round_robin_deal() {
        let items: Vec<f64> = (0..7).map(f64::from).collect();
        for ranks in 1..=4 {
            let lists: Vec<Vec<f64>> = (0..ranks)
                .map(|r| items.iter().copied().skip(r).step_by(ranks).collect())
                .collect();
            assert_eq!(interleave(&lists), items, "{ranks} ranks");
        }
    }

    #[test]
    fn one_process_is_the_identity() {
        let s = Single;
        let mut recv = [0.0; 3];
        s.reduce_scatter_sum(&[1.0, 2.0, 3.0], &[3], &mut recv)
            .unwrap();
        assert_eq!(recv, [1.0, 2.0, 3.0]);
        assert!(s.reduce_scatter_sum(&[1.0], &[2], &mut [0.0]).is_err());
        assert_eq!(s.all_reduce_max(-4).unwrap(), -4);
        assert_eq!(s.all_gather_lists(&[0.5]).unwrap(), vec![vec![0.5]]);
    }
}
