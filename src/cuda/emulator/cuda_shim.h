// Just enough of CUDA's device side for the engine's kernels (../kernels/*.cu) to
// compile as C++ and run on the CPU, unchanged. Blocks run one after another; a
// block's threads are fibers on one OS thread, switched only at barriers: __syncwarp
// and each warp shuffle (lanes write, the warp meets, lanes read, it meets again) wait
// for the thread's warp, __syncthreads for its block, as on a GPU. __shared__ arrays
// are one per program (one block runs at a time). WMMA's fragments hold their whole
// 16 x 16 tile in every thread (the work is the same, 32 times over). Exact in what it
// computes, slow, and only for tests on machines without a GPU (feature
// `cuda-emulator`).
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

// bf16: the top half of an f32, rounded to nearest even (as __float2bfloat16 does).
struct __nv_bfloat16 {
    uint16_t bits;
};
inline __nv_bfloat16 __float2bfloat16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(uint16_t)((u >> 16) | 0x40)};
    u += 0x7fffu + ((u >> 16) & 1u);
    return __nv_bfloat16{(uint16_t)(u >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 h) {
    const uint32_t u = (uint32_t)h.bits << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

// WMMA's 16 x 16 x 16 tiles: a fragment is its tile as f32 values, (row, column) of the
// matrix it stands for; loads convert, products sum in f32.
namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
    static constexpr int num_elements = 256;
    float x[256];
};

inline float value_of(float v) { return v; }
inline float value_of(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename Use, typename T>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, row_major>& f, const T* p, unsigned ldm) {
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) f.x[r * 16 + c] = value_of(p[r * ldm + c]);
}
template <typename Use, typename T>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, col_major>& f, const T* p, unsigned ldm) {
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) f.x[r * 16 + c] = value_of(p[c * ldm + r]);
}
template <typename F>
void fill_fragment(F& f, float v) {
    for (float& x : f.x) x = v;
}
template <typename A, typename B>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const A& a, const B& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
    float out[256];
    for (int r = 0; r < 16; r++)
        for (int col = 0; col < 16; col++) {
            float sum = c.x[r * 16 + col];
            for (int k = 0; k < 16; k++) sum += a.x[r * 16 + k] * b.x[k * 16 + col];
            out[r * 16 + col] = sum;
        }
    for (int e = 0; e < 256; e++) d.x[e] = out[e];
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t layout) {
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) {
            const float v = f.x[r * 16 + c];
            if (layout == mem_row_major) p[r * ldm + c] = v;
            else p[c * ldm + r] = v;
        }
}
}  // namespace wmma
}  // namespace nvcuda
