// What every kernel file shares: warp and block reductions, and the dropout mask,
// the same function of (seed, step, micro-batch, site, element) as src/model/dropout.rs.
#pragma once
#include <stdint.h>

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu

struct Add {
    template <typename T>
    __device__ T operator()(T a, T b) const { return a + b; }
};
struct Max {
    __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
    __device__ double operator()(double a, double b) const { return fmax(a, b); }
};

// `op` over the warp's 32 values of `v` (a butterfly), returned to every lane.
template <typename T, typename Op>
__device__ inline T warp_reduce(T v, Op op) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        v = op(v, __shfl_xor_sync(FULL_MASK, v, offset));
    }
    return v;
}

// `op` over the block's values of `v` (blockDim.x a multiple of 32), returned to every
// thread; `identity` stands in for the warps the block lacks. The warps' partials are
// combined in a fixed order: the result does not depend on timing.
template <typename T, typename Op>
__device__ inline T block_reduce(T v, Op op, T identity) {
    __shared__ T partial[32];
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int warps = blockDim.x / WARP_SIZE;
    v = warp_reduce(v, op);
    __syncthreads();  // an earlier call may still be reading `partial`
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : identity;
    return warp_reduce(v, op);
}

__device__ inline float warp_sum(float v) { return warp_reduce(v, Add()); }
__device__ inline double warp_sum_f64(double v) { return warp_reduce(v, Add()); }
__device__ inline float warp_max(float v) { return warp_reduce(v, Max()); }
__device__ inline float block_sum(float v) { return block_reduce(v, Add(), 0.0f); }
__device__ inline double block_sum_f64(double v) { return block_reduce(v, Add(), 0.0); }
__device__ inline float block_max(float v) { return block_reduce(v, Max(), -INFINITY); }

// Philox-4x32-10 (Salmon et al., SC'11), as `philox4x32_10` in src/model/dropout.rs.
__device__ inline uint4 philox4x32_10(uint4 c, uint2 k) {
    const uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
    const uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
    for (int round = 0; round < 10; round++) {
        if (round > 0) {
            k.x += W0;
            k.y += W1;
        }
        const uint32_t hi0 = __umulhi(M0, c.x), lo0 = M0 * c.x;
        const uint32_t hi1 = __umulhi(M1, c.z), lo1 = M1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    }
    return c;
}

// One site's dropout in one pass (`DropoutArgs` in src/cuda/kernels.rs, field for
// field). threshold 0 means no dropout.
struct Dropout {
    uint32_t key0, key1;  // the run's seed, low and high words
    uint32_t site;        // layer << 2 | kind (`Site::code`)
    uint32_t micro, step;
    unsigned long long threshold;  // words below it are dropped: p * 2^32
    float keep;                    // 1 / (1 - p)
    // When not null, micro and step as read from device memory: a training pass
    // replayed from a CUDA graph, whose arguments are fixed when it is recorded.
    const uint32_t* pass;
};

// `d` with its pass read once: kernels call this first, so their loops read micro and
// step from registers rather than through the pointer for every element (a load the
// compiler cannot hoist past the loop's stores).
__device__ inline Dropout pass_read(Dropout d) {
    if (d.pass != nullptr) {
        d.micro = d.pass[0];
        d.step = d.pass[1];
        d.pass = nullptr;
    }
    return d;
}

// What element `element` of the site is multiplied by: 0, or 1 / (1 - p).
__device__ inline float dropout_scale(const Dropout& d, unsigned long long element) {
    if (d.threshold == 0) return 1.0f;
    const uint32_t micro = d.pass != nullptr ? d.pass[0] : d.micro;
    const uint32_t step = d.pass != nullptr ? d.pass[1] : d.step;
    const uint4 counter = make_uint4((uint32_t)(element / 4), d.site, micro, step);
    const uint4 r = philox4x32_10(counter, make_uint2(d.key0, d.key1));
    const uint32_t lane = (uint32_t)(element % 4);
    const uint32_t word = lane == 0 ? r.x : lane == 1 ? r.y : lane == 2 ? r.z : r.w;
    return (unsigned long long)word < d.threshold ? 0.0f : d.keep;
}

// Where rows' positions start: `first`, or the value `first_at` points at when given.
// A decoding step replayed from a CUDA graph reads its position from device memory:
// a graph's arguments are fixed when it is recorded.
__device__ inline int start_of(int first, const int* first_at) {
    return first_at != nullptr ? *first_at : first;
}

// Row r's sequence and position. Rows are sequences of T positions from `first`; or,
// where `places` is given, each row says its own: places[2 r] its sequence,
// places[2 r + 1] its position (a server's pass: rows of many sequences, each at its
// own position).
__device__ inline long long sequence_of(long long r, int T, const int* places) {
    return places != nullptr ? places[2 * r] : r / T;
}
__device__ inline int position_of(long long r, int T, int first, const int* places) {
    return places != nullptr ? places[2 * r + 1] : first + (int)(r % T);
}

// x rounded to the nearest bf16 (ties to even; NaN stays NaN), as bits: what
// `__float2bfloat16` gives, written out so any architecture compiles it.
__device__ inline uint16_t bf16_bits(float x) {
    const uint32_t u = __float_as_uint(x);
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u)
                                           : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// The f32 value of bf16 bits.
__device__ inline float bf16_value(uint16_t b) { return __uint_as_float((uint32_t)b << 16); }

// Element i of an input held as f32 (`x`; rounded to bf16 as it is read where `round`:
// what an f32 buffer stands in for when bf16 products round on the fly) or as bf16
// (`x16`): exactly one of the two is given (`In` in src/cuda/kernels.rs).
__device__ inline float load(const float* x, const uint16_t* x16, int round, long long i) {
    if (x16 != nullptr) return bf16_value(x16[i]);
    return round ? bf16_value(bf16_bits(x[i])) : x[i];
}

// Element i of an output kept as f32 (`out`), rounded to bf16 for a product that reads
// it (`out16`), or both: either may be null.
__device__ inline void store(float* out, uint16_t* out16, long long i, float v) {
    if (out != nullptr) out[i] = v;
    if (out16 != nullptr) out16[i] = bf16_bits(v);
}

// Elementwise kernels move four values an access (one 16-byte load of f32, one 8-byte
// store of bf16) where every buffer they touch is 16-byte aligned (device allocations
// are; a view into a buffer may not be) and the count is a multiple of four.
__device__ inline bool aligned16(const void* p) {
    return p == nullptr || ((unsigned long long)p & 15u) == 0;
}
__device__ inline float4 load4(const float* p, long long i) {
#ifdef __CUDACC__
    return reinterpret_cast<const float4*>(p)[i];
#else
    return make_float4(p[4 * i], p[4 * i + 1], p[4 * i + 2], p[4 * i + 3]);
#endif
}
// Four values at 4 i of an input, as `load` (16-byte aligned, see `aligned16`).
__device__ inline float4 load4(const float* x, const uint16_t* x16, int round, long long i) {
    if (x16 != nullptr) {
#ifdef __CUDACC__
        const uint2 w = reinterpret_cast<const uint2*>(x16)[i];
#else
        const uint2 w = make_uint2((uint32_t)x16[4 * i] | ((uint32_t)x16[4 * i + 1] << 16),
                                   (uint32_t)x16[4 * i + 2] | ((uint32_t)x16[4 * i + 3] << 16));
#endif
        return make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xffff0000u),
                           __uint_as_float(w.y << 16), __uint_as_float(w.y & 0xffff0000u));
    }
    float4 v = load4(x, i);
    if (round) {
        v = make_float4(bf16_value(bf16_bits(v.x)), bf16_value(bf16_bits(v.y)),
                        bf16_value(bf16_bits(v.z)), bf16_value(bf16_bits(v.w)));
    }
    return v;
}
// Four values at 4 i of an output kept as f32, rounded to bf16, or both (as `store`).
__device__ inline void store4(float* out, uint16_t* out16, long long i, float4 v) {
    if (out != nullptr) {
#ifdef __CUDACC__
        reinterpret_cast<float4*>(out)[i] = v;
#else
        out[4 * i] = v.x, out[4 * i + 1] = v.y, out[4 * i + 2] = v.z, out[4 * i + 3] = v.w;
#endif
    }
    if (out16 != nullptr) {
        const uint32_t lo = (uint32_t)bf16_bits(v.x) | ((uint32_t)bf16_bits(v.y) << 16);
        const uint32_t hi = (uint32_t)bf16_bits(v.z) | ((uint32_t)bf16_bits(v.w) << 16);
#ifdef __CUDACC__
        reinterpret_cast<uint2*>(out16)[i] = make_uint2(lo, hi);
#else
        out16[4 * i] = (uint16_t)lo, out16[4 * i + 1] = (uint16_t)(lo >> 16);
        out16[4 * i + 2] = (uint16_t)hi, out16[4 * i + 3] = (uint16_t)(hi >> 16);
#endif
    }
}

// A grid-stride loop over n elements.
#define FOR_EACH(i, n) \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (long long)(n); \
         i += (long long)gridDim.x * blockDim.x)
