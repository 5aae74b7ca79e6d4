//! Data-parallel training: one process per rank, started by the launcher people already
//! run (`mpirun`, `srun`), each computing its share of a step's micro-batches, their
//! gradients summed through one collective interface.
//!
//! - [`launcher`]: what the launcher's environment says (who launched us, how many
//!   ranks), and the guard of builds without MPI;
//! - [`collective`]: the [`Collective`] interface the trainer and the engines use, and
//!   [`Single`], one process;
//! - `mpi` (feature `mpi`): the interface over MPI (rsmpi), for ranks on CPUs and for
//!   everything the GPUs' own library does not do;
//! - [`shards`]: ZeRO-1's split of the flat parameter buffer over the ranks;
//! - [`agree`]: how ranks that may fail apart end together;
//! - [`watchdog`]: the collectives with a time limit, so a silent rank ends the job.
//!
//! How a step is shared: a single process with `grad_accum = N x A` computes N x A
//! micro-batches; N ranks with `grad_accum = A` compute the same ones, rank r those at
//! positions r, r + N, ... (same batches, same dropout masks). Each rank sums its
//! micro-batches' gradients, scaled by 1 / (N x A), the ranks' sums are added by a
//! reduce-scatter, and each rank updates only its shard of the parameters with its
//! shard of AdamW's moments before the shards are gathered again.

pub mod agree;
pub mod collective;
pub mod launcher;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod shards;
pub mod watchdog;

use std::sync::Arc;

use anyhow::Result;

pub use agree::{agree, PeerFailed};
pub use collective::{Collective, Single};
pub use launcher::Launcher;
pub use shards::Shards;
pub use watchdog::Watched;

/// The ranks of this run, as the process joined them.
pub struct World {
    pub comm: Arc<dyn Collective>,
    /// Ends MPI (`MPI_Finalize`) when dropped: held until the command returns.
    #[cfg(feature = "mpi")]
    _universe: Option<::mpi::environment::Universe>,
}

impl World {
    /// One process.
    pub fn single() -> Self {
        Self {
            comm: Arc::new(Single),
            #[cfg(feature = "mpi")]
            _universe: None,
        }
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn size(&self) -> usize {
        self.comm.size()
    }
}

/// Joins the ranks the launcher started, if one did: MPI is initialised only then, so
/// a plain `tinygpt train` never touches it. A build without the `mpi` feature that
/// finds itself launched as one of several ranks refuses (a user error naming the
/// rebuild), before anything is read or written.
pub fn join() -> Result<World> {
    let Some(launcher) = Launcher::detect() else {
        return Ok(World::single());
    };
    #[cfg(feature = "mpi")]
    {
        let (universe, comm) = mpi::Mpi::init(&launcher)?;
        Ok(World {
            comm: Arc::new(comm),
            _universe: Some(universe),
        })
    }
    #[cfg(not(feature = "mpi"))]
    {
        if launcher.several() {
            return Err(crate::error::user_error(launcher.refusal()));
        }
        Ok(World::single())
    }
}
