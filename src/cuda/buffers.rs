//! Device buffers the engine owns for its whole life, each with its address.

use std::sync::Arc;

use anyhow::{Context, Result};
use candle_core::cuda::cudarc::driver::{
    result, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits,
};

/// `len` values of T on the device (at least one, so every buffer has an address).
pub struct Buf<T> {
    slice: CudaSlice<T>,
    ptr: u64,
    len: usize,
}

impl<T: DeviceRepr + ValidAsZeroBits + Copy> Buf<T> {
    pub fn zeros(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        let slice = stream
            .alloc_zeros::<T>(len.max(1))
            .with_context(|| format!("allocating {len} values on the GPU"))?;
        let ptr = slice.device_ptr(stream).0;
        Ok(Self { slice, ptr, len })
    }

    pub fn from_host(stream: &Arc<CudaStream>, values: &[T]) -> Result<Self> {
        let mut buf = Self::zeros(stream, values.len())?;
        buf.write(stream, values)?;
        Ok(buf)
    }

    pub fn len(&self) -> usize {
        self.len
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
    pub fn write(&mut self, stream: &Arc<CudaStream>, values: &[T]) -> Result<()> {
        assert!(
            values.len() <= self.len,
            "{} values into {}",
            values.len(),
            self.len
        );
        if values.is_empty() {
            return Ok(());
        }
        stream.memcpy_htod(values, &mut self.slice.slice_mut(..values.len()))?;
        Ok(())
    }

    /// The first `len` values, once the stream has computed them.
    pub fn read(&self, stream: &Arc<CudaStream>, len: usize) -> Result<Vec<T>> {
        assert!(len <= self.len, "{len} values of {}", self.len);
        if len == 0 {
            return Ok(Vec::new());
        }
        let values = stream.clone_dtoh(&self.slice.slice(..len))?;
        stream.synchronize()?;
        Ok(values)
    }

    /// Value `i`, once the stream has computed it.
    pub fn read_one(&self, stream: &Arc<CudaStream>, i: usize) -> Result<T> {
        assert!(i < self.len, "value {i} of {}", self.len);
        let value = stream.clone_dtoh(&self.slice.slice(i..i + 1))?;
        stream.synchronize()?;
        Ok(value[0])
    }

    /// Sets every value to zero (in stream order, like a kernel).
    pub fn fill_zeros(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let bytes = self.slice.len() * std::mem::size_of::<T>();
        // SAFETY: the buffer is live and `bytes` long; the memset is queued on the
        // stream every use of the buffer is queued on.
        unsafe { result::memset_d8_async(self.ptr, 0, bytes, stream.cu_stream()) }?;
        Ok(())
    }
}
