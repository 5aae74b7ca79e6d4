// Just enough of CUDA's device side for the engine's kernels (../kernels/*.cu) to
// compile as C++ and run on the CPU, unchanged. Blocks run one after another; a
// block's threads are fibers on one OS thread, switched only at barriers: __syncwarp
// and each warp shuffle (lanes write, the warp meets, lanes read, it meets again) wait
// for the thread's warp, __syncthreads for its block, as on a GPU. __shared__ arrays
// are one per program (one block runs at a time). A warp's tensor-core product
// (mma.sync) puts its lanes' fragments together at a warp barrier and each lane sums
// its own elements. Exact in what it computes, slow, and only for tests on machines
// without a GPU (feature `cuda-emulator`).
#pragma once
#include <math.h>
#include <stdint.h>

#define __global__
#define __device__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

struct dim3 {
    unsigned x, y, z;
};
struct uint2 {
    uint32_t x, y;
};
struct uint4 {
    uint32_t x, y, z, w;
};
struct float4 {
    float x, y, z, w;
};

inline uint2 make_uint2(uint32_t x, uint32_t y) { return uint2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
    return uint4{x, y, z, w};
}
inline uint32_t __umulhi(uint32_t a, uint32_t b) {
    return (uint32_t)(((uint64_t)a * (uint64_t)b) >> 32);
}

extern dim3 threadIdx;
extern dim3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;

void __syncthreads();
void __syncwarp(unsigned mask = 0xffffffffu);
float __shfl_xor_sync(unsigned mask, float v, int lane_mask);
double __shfl_xor_sync(unsigned mask, double v, int lane_mask);

// PTX's mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 for the calling lane: its
// warp's fragments (the layout flash.cu's mma_16x8x16 describes) put together, this
// lane's four sums of d updated in f32, k in order.
void emulate_mma_16x8x16(float d[4], const uint32_t a[4], const uint32_t b[2]);

inline int min(int a, int b) { return a < b ? a : b; }

// Atomics: a block's threads switch only at barriers, so a plain read-modify-write is
// atomic here. Each returns the old value, as CUDA's do.
template <typename T, typename F>
inline T atomic_update(T* p, F next) {
    const T old = *p;
    *p = next(old);
    return old;
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
    return atomic_update(p, [v](unsigned old) { return old + v; });
}
inline unsigned atomicExch(unsigned* p, unsigned v) {
    return atomic_update(p, [v](unsigned) { return v; });
}
inline int atomicMin(int* p, int v) {
    return atomic_update(p, [v](int old) { return v < old ? v : old; });
}
inline int atomicMax(int* p, int v) {
    return atomic_update(p, [v](int old) { return v > old ? v : old; });
}

inline unsigned __float_as_uint(float f) {
    unsigned u;
    __builtin_memcpy(&u, &f, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}
[[noreturn]] inline void __trap() { __builtin_trap(); }
// A product never fused into a following add (x86-64's baseline has no FMA to fuse into).
inline float __fmul_rn(float a, float b) { return a * b; }
