//! ZeRO-1's split of the flat parameter buffer (llm.c's `zero.cuh`): rank r keeps
//! AdamW's moments for one contiguous range of the parameters and updates only that
//! range; after the update the ranges are gathered so every rank holds all weights.
//!
//! Ranges start at multiples of [`NORM_CHUNK`], the blocks the global gradient norm is
//! summed in, so the norm summed shard by shard is the same number as over the whole
//! buffer. Any world size works: the last ranges may be shorter, or empty for a model
//! smaller than a chunk per rank.

use std::ops::Range;

use crate::optim::NORM_CHUNK;

/// Which range of `total` parameters each of `ranks` ranks updates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shards {
    total: usize,
    ranks: usize,
    /// Values per range but maybe the last ones (a multiple of NORM_CHUNK).
    stride: usize,
}

impl Shards {
    pub fn new(total: usize, ranks: usize) -> Self {
        assert!(ranks > 0, "at least one rank");
        let chunks = total.div_ceil(NORM_CHUNK);
        Self {
            total,
            ranks,
            stride: chunks.div_ceil(ranks) * NORM_CHUNK,
        }
    }

    /// The parameters rank `rank` updates.
    pub fn range(&self, rank: usize) -> Range<usize> {
        let start = (rank * self.stride).min(self.total);
        start..(start + self.stride).min(self.total)
    }

    /// Each rank's range length, in rank order (the counts of a reduce-scatter).
    pub fn counts(&self) -> Vec<usize> {
        (0..self.ranks).map(|r| self.range(r).len()).collect()
    }

    /// The largest range (what a rank's optimizer memory is sized for).
    pub fn largest(&self) -> usize {
        self.stride.min(self.total)
    }

    /// Values per rank when every rank's block has the same length, as NCCL's
    /// reduce-scatter and all-gather want: rank r's block starts at r x stride, and
    /// the buffers are padded to ranks x stride.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// The padded length: ranks x stride.
    pub fn padded(&self) -> usize {
        self.stride * self.ranks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_everything_once_from_chunk_boundaries() {
        for total in [0, 1, NORM_CHUNK, 3 * NORM_CHUNK + 7, 10 * NORM_CHUNK - 1] {
            for ranks in 1..=5 {
                let s = Shards::new(total, ranks);
                let mut next = 0;
                for r in 0..ranks {
                    let range = s.range(r);
                    assert_eq!(range.start, next, "contiguous, in rank order");
                    assert!(range.is_empty() || range.start.is_multiple_of(NORM_CHUNK));
                    assert!(range.len() <= s.largest());
                    next = range.end;
                }
                assert_eq!(next, total, "{total} values over {ranks} ranks");
                assert_eq!(s.counts().iter().sum::<usize>(), total);
            }
        }
    }

    #[test]
    fn three_ranks_get_unequal_shards() {
        let s = Shards::new(7 * NORM_CHUNK + 5, 3);
        assert_eq!(
            s.counts(),
            vec![3 * NORM_CHUNK, 3 * NORM_CHUNK, NORM_CHUNK + 5]
        );
    }
}
