//! Buffers the engine owns for its whole life, each with its address: device memory
//! on CUDA, host memory under the emulator (the kernels then read host addresses).

use std::alloc::{self, Layout};
use std::ptr::NonNull;

#[cfg(feature = "cuda")]
use anyhow::Context;
use anyhow::Result;
#[cfg(feature = "cuda")]
use candle_core::cuda::cudarc::driver::{
    result, CudaEvent, CudaSlice, DevicePtr, DeviceRepr, PinnedHostSlice, ValidAsZeroBits,
};

use super::gpu::Gpu;

/// What a copy made while recording says (a CUDA graph's capture refuses it as well).
const RECORDED_COPY: &str = "a copy between host and device cannot be recorded for replay";

/// What a buffer can hold: plain values, all-zero bits a valid zero.
#[cfg(feature = "cuda")]
pub trait Value: Copy + Default + DeviceRepr + ValidAsZeroBits {}
#[cfg(not(feature = "cuda"))]
pub trait Value: Copy + Default {}
impl Value for f32 {}
/// bf16 bits.
impl Value for u16 {}
impl Value for f64 {}
impl Value for u32 {}
impl Value for u64 {}
impl Value for i32 {}

/// `len` values of T (at least one allocated, so every buffer has an address).
pub struct Buf<T: Value> {
    mem: Memory<T>,
    ptr: u64,
    len: usize,
}

enum Memory<T: Value> {
    #[cfg(feature = "cuda")]
    Device(CudaSlice<T>),
    /// Host memory only ever reached through its address (kernels write it), never
    /// through a Rust reference held across a launch.
    #[allow(dead_code)] // built on CUDA only under the emulator
    Host(NonNull<T>, Layout),
}

impl<T: Value> Drop for Buf<T> {
    #[allow(irrefutable_let_patterns)] // host memory is all there is without CUDA
    fn drop(&mut self) {
        if let Memory::Host(ptr, layout) = &self.mem {
            // SAFETY: allocated in `zeros` with this layout, freed once.
            unsafe { alloc::dealloc(ptr.as_ptr().cast(), *layout) };
        }
    }
}

impl<T: Value> Buf<T> {
    pub fn zeros(gpu: &Gpu, len: usize) -> Result<Self> {
        let room = len.max(1);
        match gpu {
            #[cfg(feature = "cuda")]
            Gpu::Cuda(g) => {
                let slice = g
                    .stream
                    .alloc_zeros::<T>(room)
                    .with_context(|| format!("allocating {len} values on the GPU"))?;
                let ptr = slice.device_ptr(&g.stream).0;
                Ok(Self {
                    mem: Memory::Device(slice),
                    ptr,
                    len,
                })
            }
            #[cfg(feature = "cuda-emulator")]
            Gpu::Emulated => {
                let layout = Layout::array::<T>(room)?;
                // SAFETY: a non-zero size; all-zero bits are a valid T (`Value`).
                let raw = unsafe { alloc::alloc_zeroed(layout) }.cast::<T>();
                let ptr = NonNull::new(raw).ok_or_else(|| anyhow::anyhow!("out of memory"))?;
                Ok(Self {
                    mem: Memory::Host(ptr, layout),
                    ptr: raw as u64,
                    len,
                })
            }
        }
    }

    pub fn from_host(gpu: &Gpu, values: &[T]) -> Result<Self> {
        let mut buf = Self::zeros(gpu, values.len())?;
        buf.write(gpu, values)?;
        Ok(buf)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes of its `len` values.
    pub fn bytes(&self) -> u64 {
        (self.len * std::mem::size_of::<T>()) as u64
    }

    /// The address of the first value.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The address of value `i`.
    pub fn at(&self, i: usize) -> u64 {
        debug_assert!(i <= self.len, "{i} past a buffer of {}", self.len);
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }

    /// Copies `values` to the start of the buffer.
    pub fn write(&mut self, gpu: &Gpu, values: &[T]) -> Result<()> {
        self.write_at(gpu, 0, values)
    }

    /// Copies `values` to the buffer from value `first` on.
    pub fn write_at(&mut self, gpu: &Gpu, first: usize, values: &[T]) -> Result<()> {
        let range = first..first + values.len();
        assert!(range.end <= self.len, "{range:?} into {}", self.len);
        if values.is_empty() {
            return Ok(());
        }
        match (&mut self.mem, gpu) {
            #[cfg(feature = "cuda")]
            (Memory::Device(slice), Gpu::Cuda(g)) => {
                g.stream.memcpy_htod(values, &mut slice.slice_mut(range))?;
            }
            (Memory::Host(ptr, _), _) => {
                anyhow::ensure!(!gpu.is_recording(), "{RECORDED_COPY}");
                // SAFETY: the buffer holds the range (asserted); no reference to it
                // exists (kernels run synchronously under the emulator).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        values.as_ptr(),
                        ptr.as_ptr().add(first),
                        values.len(),
                    )
                };
            }
            #[allow(unreachable_patterns)]
            _ => unreachable!("a buffer is used on the device that made it"),
        }
        Ok(())
    }

    /// Values `range`, once the device has computed them.
    pub fn read_range(&self, gpu: &Gpu, range: std::ops::Range<usize>) -> Result<Vec<T>> {
        let mut values = vec![T::default(); range.len()];
        self.read_into(gpu, range.start, &mut values)?;
        Ok(values)
    }

    /// Values `first ..` into `dst` (as many as it holds), once the device has computed
    /// them: a hot loop's read, with no allocation.
    pub fn read_into(&self, gpu: &Gpu, first: usize, dst: &mut [T]) -> Result<()> {
        let range = first..first + dst.len();
        assert!(range.end <= self.len, "{range:?} of {} values", self.len);
        if range.is_empty() {
            return Ok(());
        }
        match (&self.mem, gpu) {
            #[cfg(feature = "cuda")]
            (Memory::Device(slice), Gpu::Cuda(g)) => {
                g.stream.memcpy_dtoh(&slice.slice(range), dst)?;
                g.stream.synchronize()?;
            }
            (Memory::Host(ptr, _), _) => {
                anyhow::ensure!(!gpu.is_recording(), "{RECORDED_COPY}");
                // SAFETY: in bounds (asserted); nothing writes it meanwhile.
                let values = unsafe {
                    std::slice::from_raw_parts(ptr.as_ptr().add(range.start), range.len())
                };
                dst.copy_from_slice(values);
            }
            #[allow(unreachable_patterns)]
            _ => unreachable!("a buffer is used on the device that made it"),
        }
        Ok(())
    }

    /// The first `len` values.
    pub fn read(&self, gpu: &Gpu, len: usize) -> Result<Vec<T>> {
        self.read_range(gpu, 0..len)
    }

    /// Value `i`.
    pub fn read_one(&self, gpu: &Gpu, i: usize) -> Result<T> {
        Ok(self.read_range(gpu, i..i + 1)?[0])
    }

    /// Sets every value to zero (in stream order, like a kernel).
    pub fn fill_zeros(&self, gpu: &Gpu) -> Result<()> {
        let bytes = self.len.max(1) * std::mem::size_of::<T>();
        match (&self.mem, gpu) {
            #[cfg(feature = "cuda")]
            (Memory::Device(_), Gpu::Cuda(g)) => {
                // A raw driver call: it needs the context current on this thread.
                g.stream.context().bind_to_thread()?;
                // SAFETY: the buffer is live and `bytes` long; the memset is queued on
                // the stream every use of the buffer is queued on.
                unsafe { result::memset_d8_async(self.ptr, 0, bytes, g.stream.cu_stream()) }?;
            }
            (Memory::Host(ptr, _), _) => {
                // A memset on the device, which a recording keeps (as a CUDA graph does).
                #[cfg(feature = "cuda-emulator")]
                if super::emulator::record(|| super::emulator::Recorded::Zero {
                    at: ptr.as_ptr().cast(),
                    bytes,
                }) {
                    return Ok(());
                }
                // SAFETY: the buffer is `bytes` long; no reference to it exists.
                unsafe { std::ptr::write_bytes(ptr.as_ptr().cast::<u8>(), 0, bytes) };
            }
            #[allow(unreachable_patterns)]
            _ => unreachable!("a buffer is used on the device that made it"),
        }
        Ok(())
    }
}

/// Host memory a batch's uploads pass through. On CUDA it is pinned, so a copy from it
/// is queued like a kernel (from ordinary memory the driver may first wait for the
/// stream, which would make every step wait for the one before); the host waits only
/// before refilling it, for the previous upload's copies, which ran at the start of
/// the step queued then. Under the emulator uploads are plain copies.
pub struct Staging {
    #[cfg(feature = "cuda")]
    pinned: Option<Pinned>,
    len: usize,
}

/// Pinned host memory, and the event recorded after the copies from it were queued.
#[cfg(feature = "cuda")]
struct Pinned {
    host: PinnedHostSlice<u32>,
    copied: CudaEvent,
}

impl Drop for Staging {
    /// Waits for the last upload's copies before the pinned memory is freed (an engine
    /// dropped after an error mid-step may have them queued still).
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        if let Some(Pinned { copied, .. }) = &self.pinned {
            let _ = copied.synchronize();
        }
    }
}

impl Staging {
    /// Room for `len` values in all, per upload.
    pub fn new(gpu: &Gpu, len: usize) -> Result<Self> {
        match gpu {
            #[cfg(feature = "cuda")]
            Gpu::Cuda(g) => {
                let context = g.stream.context();
                // SAFETY: the values are written before any copy reads them.
                let host = unsafe { context.alloc_pinned::<u32>(len.max(1)) }
                    .with_context(|| format!("allocating {len} pinned host values"))?;
                let copied = context.new_event(None)?;
                Ok(Self {
                    pinned: Some(Pinned { host, copied }),
                    len,
                })
            }
            #[cfg(feature = "cuda-emulator")]
            Gpu::Emulated => Ok(Self {
                #[cfg(feature = "cuda")]
                pinned: None,
                len,
            }),
        }
    }

    /// Copies each part's values to the start of its buffer, in stream order.
    pub fn upload(&mut self, gpu: &Gpu, parts: &mut [(&mut Buf<u32>, &[u32])]) -> Result<()> {
        let total: usize = parts.iter().map(|(_, values)| values.len()).sum();
        assert!(
            total <= self.len,
            "{total} values through staging for {}",
            self.len
        );
        match gpu {
            #[cfg(feature = "cuda")]
            Gpu::Cuda(g) => {
                let Pinned { host, copied } = self.pinned.as_mut().expect("made on CUDA");
                copied.synchronize()?;
                let host = host.as_mut_slice()?;
                let mut at = 0;
                for (buf, values) in parts.iter_mut() {
                    assert!(
                        values.len() <= buf.len,
                        "{} values into {}",
                        values.len(),
                        buf.len
                    );
                    if values.is_empty() {
                        continue;
                    }
                    let region = &mut host[at..at + values.len()];
                    region.copy_from_slice(values);
                    at += values.len();
                    // SAFETY: the buffer holds at least region.len() values; the region
                    // is not written again before `copied` says this copy ran.
                    unsafe { result::memcpy_htod_async(buf.ptr, region, g.stream.cu_stream()) }?;
                }
                copied.record(&g.stream)?;
                Ok(())
            }
            #[cfg(feature = "cuda-emulator")]
            Gpu::Emulated => {
                for (buf, values) in parts.iter_mut() {
                    buf.write(gpu, values)?;
                }
                Ok(())
            }
        }
    }
}
