//! The collective interface over MPI (rsmpi): Open MPI, MPICH, or whatever MPI the build
//! found, started by `mpirun`, `mpiexec` or `srun --mpi=pmix`. MPI's default error
//! handler stays in place: an error in any call ends the whole job (MPI_Abort), and so
//! does `mpirun` when a rank dies, so no rank is left waiting for a dead one.

use std::time::Duration;

use anyhow::{ensure, Result};
use mpi::collective::SystemOperation;
use mpi::datatype::PartitionMut;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::Threading;

use super::collective::{check_counts, Collective};
use super::Launcher;

/// MPI_COMM_WORLD, and this rank's place on its machine.
pub struct Mpi {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    local_rank: usize,
    library: String,
}

// Safety: rsmpi's communicator is a handle (an int or a pointer, by library) to MPI's
// own state. MPI is initialised with MPI_THREAD_SERIALIZED or better (checked in
// `init`), under which any thread may call MPI as long as calls do not overlap; the
// trainer makes them from one thread at a time.
unsafe impl Send for Mpi {}
unsafe impl Sync for Mpi {}

impl Mpi {
    /// Initialises MPI for the ranks `launcher` started.
    pub fn init(launcher: &Launcher) -> Result<(Universe, Self)> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| anyhow::anyhow!("MPI was initialised twice"))?;
        ensure!(
            threading >= Threading::Serialized,
            "the MPI library offers only {threading:?} threading; tinygpt needs MPI_THREAD_SERIALIZED"
        );
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        if size == 1 && launcher.size.is_some_and(|n| n > 1) {
            // Each process would train alone: N runs racing for one run folder.
            drop(universe);
            return Err(crate::error::user_error(format!(
                "{} started {} processes, but MPI sees this one alone, so each would train by itself: tinygpt's ranks talk through MPI; start them with mpirun -np N (under Slurm: srun --mpi=pmix, or pmi2), or run one process without the launcher's variables",
                launcher.name,
                launcher.size_name()
            )));
        }
        if launcher.size.is_some_and(|n| n != size) {
            crate::errln!(
                "warning: {} says {} ranks, MPI says {size}",
                launcher.name,
                launcher.size_name()
            );
        }
        let local_rank = world.split_shared(world.rank()).rank() as usize;
        let library = mpi::environment::library_version()
            .ok()
            .and_then(|v| v.split([',', '\n']).next().map(|s| s.trim().to_string()))
            .unwrap_or_else(|| "MPI".into());
        let comm = Self {
            world,
            rank,
            size,
            local_rank,
            library,
        };
        Ok((universe, comm))
    }
}

/// MPI counts are C ints.
fn c_counts(counts: &[usize]) -> Result<Vec<i32>> {
    counts
        .iter()
        .map(|&c| {
            i32::try_from(c).map_err(|_| {
                anyhow::anyhow!("a block of {c} values is more than one MPI call can move")
            })
        })
        .collect()
}

/// Where each block starts, for counts laid end to end.
fn displacements(counts: &[i32]) -> Vec<i32> {
    counts
        .iter()
        .scan(0, |at, &c| {
            let start = *at;
            *at += c;
            Some(start)
        })
        .collect()
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn local_rank(&self) -> usize {
        self.local_rank
    }

    fn describe(&self) -> String {
        self.library.clone()
    }

    fn reduce_scatter_sum(&self, send: &[f32], counts: &[usize], recv: &mut [f32]) -> Result<()> {
        check_counts(counts, self.size, send.len())?;
        ensure!(
            recv.len() == counts[self.rank],
            "collective: receive buffer size"
        );
        let counts = c_counts(counts)?;
        // rsmpi wraps only the equal-block MPI_Reduce_scatter_block; the shards are
        // unequal, so this is MPI_Reduce_scatter itself.
        // Safety: `send` holds the sum of `counts` f32s and `recv` this rank's count,
        // both checked above; MPI reads and writes nothing else.
        unsafe {
            mpi::ffi::MPI_Reduce_scatter(
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                counts.as_ptr(),
                f32::equivalent_datatype().as_raw(),
                SystemOperation::sum().as_raw(),
                self.world.as_raw(),
            );
        }
        Ok(())
    }

    fn all_gather(&self, send: &[f32], counts: &[usize], recv: &mut [f32]) -> Result<()> {
        check_counts(counts, self.size, recv.len())?;
        ensure!(
            send.len() == counts[self.rank],
            "collective: send buffer size"
        );
        let counts = c_counts(counts)?;
        let displs = displacements(&counts);
        let mut partition = PartitionMut::new(recv, counts, displs);
        self.world.all_gather_varcount_into(send, &mut partition);
        Ok(())
    }

    fn all_gather_lists(&self, mine: &[f64]) -> Result<Vec<Vec<f64>>> {
        let mut lengths = vec![0i32; self.size];
        let len = c_counts(&[mine.len()])?[0];
        self.world.all_gather_into(&len, &mut lengths[..]);
        let total = lengths.iter().map(|&n| n as usize).sum();
        let mut all = vec![0.0f64; total];
        let displs = displacements(&lengths);
        let mut partition = PartitionMut::new(&mut all[..], lengths.clone(), displs.clone());
        self.world.all_gather_varcount_into(mine, &mut partition);
        Ok(lengths
            .iter()
            .zip(&displs)
            .map(|(&n, &at)| all[at as usize..(at + n) as usize].to_vec())
            .collect())
    }

    fn all_reduce_max(&self, value: i64) -> Result<i64> {
        let mut out = 0i64;
        self.world
            .all_reduce_into(&value, &mut out, SystemOperation::max());
        Ok(out)
    }

    fn broadcast_bytes(&self, root: usize, bytes: &mut Vec<u8>) -> Result<()> {
        let root = self.world.process_at_rank(root as i32);
        let mut len = bytes.len() as u64;
        root.broadcast_into(&mut len);
        bytes.resize(len as usize, 0);
        root.broadcast_into(&mut bytes[..]);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        // MPI_Barrier spins at full speed; an early rank instead asks every few
        // milliseconds, leaving the cores to a rank still preparing.
        let mut request = self.world.immediate_barrier();
        let mut pause = Duration::from_micros(50);
        loop {
            match request.test() {
                Ok(_) => return Ok(()),
                Err(pending) => request = pending,
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_start_where_the_previous_ends() {
        assert_eq!(displacements(&[3, 0, 2]), vec![0, 3, 3]);
        assert!(c_counts(&[1 << 31]).is_err());
    }
}
