//! The fused CUDA engine as one rank of a data-parallel run: ZeRO-1 over the flat
//! device buffers, as llm.c's `zero.cuh`. The gradients are reduce-scattered so rank r
//! holds the sum of its block, the global norm's square is all-reduced, AdamW updates
//! the block with moments of the block's size, and the blocks of weights are gathered.
//!
//! NCCL moves equal blocks: rank r's block is values [r x stride, (r + 1) x stride) of
//! buffers padded to ranks x stride (`parallel::Shards`); the part past the model is
//! zeros that nothing updates. The collectives run in place on the engine's stream,
//! ordered with its kernels, so a step still waits for nothing.
//!
//! Where NCCL is not built in (feature `nccl`), and under the emulator (whose device
//! memory is host memory), the blocks go through host memory and the host collective
//! (MPI): the same sums, slower on a GPU by two copies a step.

use std::ops::Range;
use std::sync::Arc;

use anyhow::Result;

use super::buffers::Buf;
use super::gpu::Gpu;
use crate::model::ModelSpec;
use crate::parallel::{Collective, Shards};

/// This rank's place in the run, and how its blocks reach the others.
pub struct Ranks {
    pub comm: Arc<dyn Collective>,
    pub shards: Shards,
    /// The parameters this rank updates (its block, less any padding).
    pub mine: Range<usize>,
    /// AdamW's chunks over `mine`, counted from its start (`kernels::adamw_chunks`).
    pub adam_chunks: Buf<u64>,
    carrier: Carrier,
}

/// What carries the device buffers between ranks.
enum Carrier {
    #[cfg(all(feature = "cuda", feature = "nccl"))]
    Nccl(nccl::Nccl),
    /// Device buffers copied to the host and through the host collective.
    Host,
}

impl Ranks {
    /// This rank of `comm` for the model `spec` on `gpu`: NCCL's communicator set up
    /// where there is one (every rank calls this together).
    pub fn new(gpu: &Gpu, spec: &ModelSpec, comm: Arc<dyn Collective>) -> Result<Self> {
        let shards = Shards::new(spec.len(), comm.size());
        let mine = shards.range(comm.rank());
        let chunks = super::kernels::adamw_chunks(spec.params(), mine.clone());
        let carrier = match gpu {
            #[cfg(all(feature = "cuda", feature = "nccl"))]
            Gpu::Cuda(_) => Carrier::Nccl(nccl::Nccl::new(gpu, comm.as_ref())?),
            #[allow(unreachable_patterns)]
            _ => Carrier::Host,
        };
        Ok(Self {
            adam_chunks: Buf::from_host(gpu, &chunks)?,
            comm,
            shards,
            mine,
            carrier,
        })
    }

    pub fn count(&self) -> usize {
        self.comm.size()
    }

    /// How the blocks travel, for the run's first line.
    pub fn describe(&self) -> String {
        let how = match &self.carrier {
            #[cfg(all(feature = "cuda", feature = "nccl"))]
            Carrier::Nccl(n) => format!("over NCCL {}", n.version()),
            Carrier::Host => format!(
                "through host memory and {} (build with --features nccl for NCCL)",
                self.comm.describe()
            ),
        };
        format!(
            "AdamW sharded over {} ranks (ZeRO-1), gradients {how}",
            self.count()
        )
    }

    /// Rank r's block of `buf` (padded): where its sum lands and its update starts.
    fn block(&self) -> Range<usize> {
        let start = self.comm.rank() * self.shards.stride();
        start..start + self.shards.stride()
    }

    /// Each rank's block of `grads` (padded to `shards.padded()`) replaced by the sum
    /// of every rank's.
    pub fn reduce_scatter(&self, gpu: &Gpu, grads: &mut Buf<f32>) -> Result<()> {
        match &self.carrier {
            #[cfg(all(feature = "cuda", feature = "nccl"))]
            Carrier::Nccl(n) => n.reduce_scatter(gpu, grads, self.shards.stride()),
            Carrier::Host => {
                let all = grads.read(gpu, self.shards.padded())?;
                let mut mine = vec![0.0; self.shards.stride()];
                let counts = vec![self.shards.stride(); self.count()];
                self.comm.reduce_scatter_sum(&all, &counts, &mut mine)?;
                grads.write_at(gpu, self.block().start, &mine)
            }
        }
    }

    /// Value `i` of `sums` replaced by its sum over the ranks.
    pub fn all_reduce_sum(&self, gpu: &Gpu, sums: &mut Buf<f64>, i: usize) -> Result<()> {
        match &self.carrier {
            #[cfg(all(feature = "cuda", feature = "nccl"))]
            Carrier::Nccl(n) => n.all_reduce_sum(gpu, sums.at(i)),
            Carrier::Host => {
                let mine = sums.read_one(gpu, i)?;
                let all = self.comm.all_gather_lists(&[mine])?;
                let sum: f64 = all.iter().flatten().sum();
                sums.write_at(gpu, i, &[sum])
            }
        }
    }

    /// Every rank's block of `params` (padded) into every rank's.
    pub fn all_gather(&self, gpu: &Gpu, params: &mut Buf<f32>) -> Result<()> {
        match &self.carrier {
            #[cfg(all(feature = "cuda", feature = "nccl"))]
            Carrier::Nccl(n) => n.all_gather(gpu, params, self.shards.stride()),
            Carrier::Host => {
                let mine = params.read_range(gpu, self.block())?;
                let mut all = vec![0.0; self.shards.padded()];
                let counts = vec![self.shards.stride(); self.count()];
                self.comm.all_gather(&mine, &counts, &mut all)?;
                params.write(gpu, &all)
            }
        }
    }

    /// The whole table's values from every rank's `mine` (this rank's range of it:
    /// moments, on their way to a checkpoint).
    pub fn gather_ranges(&self, mine: &[f32]) -> Result<Vec<f32>> {
        let mut all = vec![0.0; self.shards.range(self.count() - 1).end];
        self.comm
            .all_gather(mine, &self.shards.counts(), &mut all)?;
        Ok(all)
    }

    /// An error NCCL met in the background (a peer lost, a network fault), as an
    /// error here: the trainer then ends the job instead of waiting on a collective
    /// that will never complete.
    pub fn check(&self) -> Result<()> {
        match &self.carrier {
            #[cfg(all(feature = "cuda", feature = "nccl"))]
            Carrier::Nccl(n) => n.check(),
            Carrier::Host => Ok(()),
        }
    }
}

/// NCCL through cudarc's raw bindings: the engine's buffers are raw device addresses,
/// and its reduce-scatter and all-gather run in place (a rank's block is both what
/// it sends and where it receives), which cudarc's safe API cannot borrow.
#[cfg(all(feature = "cuda", feature = "nccl"))]
mod nccl {
    use std::ffi::c_void;

    use anyhow::Result;
    use candle_core::cuda::cudarc::nccl::{result, sys};

    use super::super::buffers::Buf;
    use super::super::gpu::Gpu;
    use crate::parallel::Collective;

    pub struct Nccl {
        comm: sys::ncclComm_t,
    }

    impl Nccl {
        /// Rank 0 makes NCCL's unique id and sends it to the others over the host
        /// collective (MPI), as llm.c does; then every rank joins the communicator.
        pub fn new(gpu: &Gpu, comm: &dyn Collective) -> Result<Self> {
            gpu.bind()?;
            let mut id = Vec::new();
            if comm.rank() == 0 {
                let unique = checked(result::get_uniqueid(), "ncclGetUniqueId")?;
                id = unique.internal.iter().map(|&c| c as u8).collect();
            }
            comm.broadcast_bytes(0, &mut id)?;
            let mut internal = [0 as std::ffi::c_char; 128];
            anyhow::ensure!(id.len() == internal.len(), "NCCL's id arrived cut");
            for (to, from) in internal.iter_mut().zip(&id) {
                *to = *from as std::ffi::c_char;
            }
            let mut raw = std::mem::MaybeUninit::uninit();
            // SAFETY: `raw` receives the communicator; the id is the one rank 0 made.
            let joined = unsafe {
                result::comm_init_rank(
                    raw.as_mut_ptr(),
                    comm.size() as i32,
                    sys::ncclUniqueId { internal },
                    comm.rank() as i32,
                )
            };
            let call = format!("ncclCommInitRank (rank {} of {})", comm.rank(), comm.size());
            checked(joined, &call)?;
            // SAFETY: initialised by the successful call above.
            let comm = unsafe { raw.assume_init() };
            Ok(Self { comm })
        }

        pub fn version(&self) -> String {
            match result::get_nccl_version() {
                Ok(v) => format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100),
                Err(_) => String::new(),
            }
        }

        fn stream(gpu: &Gpu) -> sys::cudaStream_t {
            match gpu {
                Gpu::Cuda(g) => g.stream.cu_stream() as sys::cudaStream_t,
                #[allow(unreachable_patterns)]
                _ => unreachable!("NCCL is set up on CUDA devices only"),
            }
        }

        pub fn reduce_scatter(&self, gpu: &Gpu, grads: &mut Buf<f32>, stride: usize) -> Result<()> {
            let rank = grads_rank(self.comm)?;
            let (all, mine) = (grads.ptr(), grads.at(rank * stride));
            // SAFETY: `grads` holds ranks x stride values (padded); in place, as NCCL
            // defines it: the receive block is this rank's block of the send buffer.
            let done = unsafe {
                result::reduce_scatter(
                    all as *const c_void,
                    mine as *mut c_void,
                    stride,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    self.comm,
                    Self::stream(gpu),
                )
            };
            checked(done, "ncclReduceScatter")?;
            Ok(())
        }

        pub fn all_reduce_sum(&self, gpu: &Gpu, at: u64) -> Result<()> {
            // SAFETY: one f64 at `at`, summed in place.
            let done = unsafe {
                result::all_reduce(
                    at as *const c_void,
                    at as *mut c_void,
                    1,
                    sys::ncclDataType_t::ncclFloat64,
                    sys::ncclRedOp_t::ncclSum,
                    self.comm,
                    Self::stream(gpu),
                )
            };
            checked(done, "ncclAllReduce")?;
            Ok(())
        }

        pub fn all_gather(&self, gpu: &Gpu, params: &mut Buf<f32>, stride: usize) -> Result<()> {
            let rank = grads_rank(self.comm)?;
            let (all, mine) = (params.ptr(), params.at(rank * stride));
            // SAFETY: `params` holds ranks x stride values; in place: this rank's
            // block is where the receive buffer holds it.
            let done = unsafe {
                result::all_gather(
                    mine as *const c_void,
                    all as *mut c_void,
                    stride,
                    sys::ncclDataType_t::ncclFloat32,
                    self.comm,
                    Self::stream(gpu),
                )
            };
            checked(done, "ncclAllGather")?;
            Ok(())
        }

        pub fn check(&self) -> Result<()> {
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: a live communicator; NCCL writes the state.
            unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
            anyhow::ensure!(
                state == sys::ncclResult_t::ncclSuccess
                    || state == sys::ncclResult_t::ncclInProgress,
                "NCCL failed in the background ({state:?}): a rank or the network between the GPUs was lost"
            );
            Ok(())
        }
    }

    /// NCCL's result as ours, naming the call (its error type is not a std error).
    fn checked<T>(done: Result<T, result::NcclError>, call: &str) -> Result<T> {
        done.map_err(|e| anyhow::anyhow!("{call} failed: {e:?}"))
    }

    /// This rank in the communicator.
    fn grads_rank(comm: sys::ncclComm_t) -> Result<usize> {
        // SAFETY: a live communicator.
        let rank = checked(unsafe { result::comm_user_rank(comm) }, "ncclCommUserRank")?;
        Ok(rank as usize)
    }

    impl Drop for Nccl {
        fn drop(&mut self) {
            // SAFETY: the communicator is ours and no collective is queued on it once
            // the engine is dropped (its stream is synchronised first).
            let _ = unsafe { result::comm_destroy(self.comm) };
        }
    }
}
