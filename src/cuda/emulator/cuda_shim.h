// Just enough of CUDA's device side for the engine's kernels (../kernels/*.cu) to
// compile as C++ and run on the CPU, unchanged. Blocks run one after another; a
// block's threads are fibers on one OS thread, switched only where threads meet:
// __syncthreads, __syncwarp, and each warp shuffle (lanes write, all meet, lanes read, all meet).
// Every kernel's threads pass the same meeting points in the same order (or return),
// which is what makes one round-robin over the fibers a barrier. __shared__ arrays
// are one per program (one block runs at a time). Exact in what it computes, slow, and
// only for tests on machines without a GPU (feature `cuda-emulator`).
#pragma once
#include <math.h>
#include <stdint.h>

#define __global__
#define __device__
#define __shared__ static

struct dim3 {
    unsigned x, y, z;
};
struct uint2 {
    uint32_t x, y;
};
struct uint4 {
    uint32_t x, y, z, w;
};

inline uint2 make_uint2(uint32_t x, uint32_t y) { return uint2{x, y}; }
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
