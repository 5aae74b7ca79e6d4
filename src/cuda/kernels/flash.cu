// Causal attention without the T x T matrices, FlashAttention-2's way (Dao 2023), in
// bf16 on the tensor cores with f32 sums: the attention of Precision::Bf16. The
// products path (attention.cu + cuBLAS) writes and reads B H T^2 scores about fourteen
// times a step; these kernels keep every tile of scores in registers and recompute it
// where it is needed again.
//
// Heads are f32 in global memory, read and written where they are (`HeadView`): in the
// rows the qkv projection writes and the output projection reads (B T rows, heads side
// by side), or split out as (B H, T, d); d a multiple of 16 up to FLASH_MAX_D. A block
// is FLASH_WARPS warps; each warp owns 16 rows (queries, or keys in flash_backward_kv)
// as fragments in registers, and the block streams the other side's rows through shared
// memory FLASH_STREAM at a time, rounded to bf16 as they are staged. The operands
// rounded are the products path's (Q, K for the scores; V; dY; K, Q for the gradients),
// but for P: the forward rounds P before it is divided by the row's sum (one pass, the
// sum known only at the end), the products path after. Element (i, j) of head bh is
// dropped by the mask of element (bh T + i) T + j of the weights, as causal_softmax
// drops it.
//
// Deterministic: every sum is taken in one order, no atomics. The backward computes dK
// and dV over key tiles and dQ over query tiles in two kernels, each recomputing P:
// FlashAttention-2's single backward adds dQ with atomics, in an order that varies
// from run to run, and an exact resume would not survive it.
#include "common.cuh"

#ifdef __CUDACC__
#include <cuda_bf16.h>
#endif

#define FLASH_WARPS 4
#define FLASH_ROWS (16 * FLASH_WARPS)  // rows a block owns
#define FLASH_MAX_D 64
#define FLASH_MAX_F (FLASH_MAX_D / 16)  // 16-wide column chunks of a head
#define FLASH_MAX_N (FLASH_MAX_D / 8)   // 8-wide column fragments of a head
#define FLASH_STREAM 64                 // rows of the other side a block stages at once
// Staged tiles in shared memory: rows as they are (FLASH_STREAM rows, ROWS_LD apart) or
// transposed (a row per head column, COLS_LD apart). 8 values of padding put the rows
// a warp's fragments read at once in 8 different banks (64 bf16 = 128 bytes apart,
// they would all start in bank 0).
#define ROWS_LD (FLASH_MAX_D + 8)
#define COLS_LD (FLASH_STREAM + 8)
#define ROWS_TILE (FLASH_STREAM * ROWS_LD)
#define COLS_TILE (FLASH_MAX_D * COLS_LD)

// Where the heads of a tensor are (`HeadView` in src/cuda/kernels.rs, field for field):
// row t, column c of head h of sequence b at element
//   b batch_stride + (h / group) head_stride + t ld + c
// from base, so the qkv rows' q heads are (T W, d, W, 1), their K/V heads the same from
// their columns with the query heads' group, the attention output's rows (T C, d, C, 1),
// and split heads (H T d, T d, d, 1). Elements are f32, or bf16 where `bf16` is set (an
// output a bf16 product reads next, rounded as it is written; q, k and v as a bf16
// product wrote them).
struct HeadView {
    float* base;
    long long batch_stride, head_stride;
    int ld, group, bf16;
};

// The element where head bh's (= b H + h) rows start.
__device__ inline long long head_start(const HeadView& v, long long bh, int H) {
    const long long b = bh / H;
    const int h = (int)(bh % H);
    return b * v.batch_stride + (long long)(h / v.group) * v.head_stride;
}

// bf16 tensor cores need sm_80 (mma.sync's bf16 shapes); built for less, the kernels
// trap rather than lie, and the engine never chooses them (plan::Attention::choose
// reads the architecture build.rs targeted).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define FLASH_UNSUPPORTED 1
#endif

#ifndef FLASH_UNSUPPORTED
// Every product goes through PTX's mma.sync.m16n8k16 (bf16 operands, f32 sums), whose
// fragments PTX documents lane by lane, so a tile of scores can be rescaled, masked and
// exponentiated in the registers that hold it and fed back as an operand (WMMA's
// fragments are opaque: the scores would have to go through shared memory). With
// g = lane / 4 and t = lane % 4, a warp holds
//   A (16 x 16): a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1],
//                a[2] = A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8, 2t+9];
//   B (16 x 8):  b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g];
//   D (16 x 8):  d[0], d[1] = D[g][2t, 2t+1], d[2], d[3] = D[g+8][2t, 2t+1];
// each pair of bf16 in one 32-bit word, the lower element in the low half. The emulator
// implements the instruction from the same description (cuda_shim.h). So lane (g, t)
// holds rows g ("lo") and g + 8 ("hi") of every tile the warp owns.
__device__ inline void mma_16x8x16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
#ifdef __CUDACC__
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    emulate_mma_16x8x16(d, a, b);
#endif
}

// lo and hi rounded to bf16 and packed as a fragment's pair.
__device__ inline uint32_t bf16_pair(float lo, float hi) {
#ifdef __CUDACC__
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
#else
    return (uint32_t)bf16_bits(lo) | ((uint32_t)bf16_bits(hi) << 16);
#endif
}

// The pair of bf16 at p (4-byte aligned) as a fragment's word.
__device__ inline uint32_t pair_at(const uint16_t* p) {
#ifdef __CUDACC__
    return *reinterpret_cast<const uint32_t*>(p);
#else
    return (uint32_t)p[0] | ((uint32_t)p[1] << 16);
#endif
}

// Head bh's rows of a view the kernels read into bf16 fragments and tiles: f32
// elements, rounded as they are read, or bf16 ones (rows a bf16 product wrote): the
// same bf16 values either way.
struct HeadIn {
    const float* f32;
    const uint16_t* bf16;
    int ld;
};

__device__ inline HeadIn head_in(const HeadView& v, long long bh, int H) {
    const long long at = head_start(v, bh, H);
    if (v.bf16) return HeadIn{nullptr, reinterpret_cast<const uint16_t*>(v.base) + at, v.ld};
    return HeadIn{v.base + at, nullptr, v.ld};
}

// Elements col and col + 1 (col even) of a row, as a fragment's pair.
__device__ inline uint32_t pair_of(const HeadIn& h, int row, int col) {
    const long long at = (long long)row * h.ld + col;
    if (h.bf16 != nullptr) return pair_at(h.bf16 + at);
    return bf16_pair(h.f32[at], h.f32[at + 1]);
}

// Element col of a row, as bf16 bits.
__device__ inline uint16_t bits_of(const HeadIn& h, int row, int col) {
    const long long at = (long long)row * h.ld + col;
    return h.bf16 != nullptr ? h.bf16[at] : bf16_bits(h.f32[at]);
}

// A warp's 16 rows from row0 of src (zeros past T) as A fragments, one per 16 head
// columns: the operand it owns for the whole kernel.
__device__ inline void own_rows(uint32_t f[FLASH_MAX_F][4], const HeadIn& src, int row0, int T,
                                int d, int lane) {
    const int g = lane / 4, t = lane % 4;
    auto pair = [&](int row, int col) { return row < T ? pair_of(src, row, col) : 0u; };
#pragma unroll
    for (int c = 0; c < FLASH_MAX_F; c++) {
        if (c < d / 16) {
            f[c][0] = pair(row0 + g, 16 * c + 2 * t);
            f[c][1] = pair(row0 + g + 8, 16 * c + 2 * t);
            f[c][2] = pair(row0 + g, 16 * c + 2 * t + 8);
            f[c][3] = pair(row0 + g + 8, 16 * c + 2 * t + 8);
        }
    }
}

// FLASH_STREAM rows from row0 of src (zeros past T) into shared memory as bf16: as
// they are (`rows`, ROWS_LD apart), transposed (`cols`, COLS_LD apart), or both;
// either may be null. All the block's threads share the copy.
__device__ inline void stage(uint16_t* rows, uint16_t* cols, const HeadIn& src, int row0, int T,
                             int d) {
    for (int e = threadIdx.x; e < FLASH_STREAM * d; e += blockDim.x) {
        const int r = e / d, c = e % d, row = row0 + r;
        const uint16_t x = row < T ? bits_of(src, row, c) : 0;
        if (rows != nullptr) rows[r * ROWS_LD + c] = x;
        if (cols != nullptr) cols[c * COLS_LD + r] = x;
    }
}

// s (16 x FLASH_STREAM, f32) = the warp's rows (A fragments) times the staged rows
// transposed: scores of its queries against the staged keys, and the like.
__device__ inline void products_t(float s[FLASH_STREAM / 8][4], const uint32_t a[FLASH_MAX_F][4],
                                  const uint16_t* rows, int d, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < FLASH_STREAM / 8; j++) {
        s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int c = 0; c < FLASH_MAX_F; c++) {
            if (c < d / 16) {
                const uint16_t* r = rows + (8 * j + g) * ROWS_LD + 16 * c + 2 * t;
                const uint32_t b[2] = {pair_at(r), pair_at(r + 8)};
                mma_16x8x16(s[j], a[c], b);
            }
        }
    }
}

// acc (16 x d, f32) += p (16 x FLASH_STREAM, as products_t leaves it) times the staged
// rows, read through their transposed copy `cols`. Two of p's 8-column fragments (16 c
// .. 16 c + 15) are, pair for pair, the A fragment of those 16 columns: p goes from
// accumulator to operand without leaving the registers.
__device__ inline void accumulate(float acc[FLASH_MAX_N][4], const float p[FLASH_STREAM / 8][4],
                                  const uint16_t* cols, int d, int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int c = 0; c < FLASH_STREAM / 16; c++) {
        const uint32_t a[4] = {bf16_pair(p[2 * c][0], p[2 * c][1]),
                               bf16_pair(p[2 * c][2], p[2 * c][3]),
                               bf16_pair(p[2 * c + 1][0], p[2 * c + 1][1]),
                               bf16_pair(p[2 * c + 1][2], p[2 * c + 1][3])};
#pragma unroll
        for (int n = 0; n < FLASH_MAX_N; n++) {
            if (n < d / 8) {
                const uint16_t* r = cols + (8 * n + g) * COLS_LD + 16 * c + 2 * t;
                const uint32_t b[2] = {pair_at(r), pair_at(r + 8)};
                mma_16x8x16(acc[n], a, b);
            }
        }
    }
}

// The warp's 16 rows from row0 of head bh of `dst` (rows past T left alone) <- acc, rows
// g times scale_lo, rows g + 8 times scale_hi: as f32, or rounded to bf16 for a bf16 view.
__device__ inline void store_rows(const HeadView& dst, long long bh, int H,
                                  const float acc[FLASH_MAX_N][4], int row0, int T, int d,
                                  float scale_lo, float scale_hi, int lane) {
    const int g = lane / 4, t = lane % 4;
    const int lo = row0 + g, hi = row0 + g + 8;
    const long long start = head_start(dst, bh, H);
    auto put = [&](int row, int col, float value) {
        const long long at = start + (long long)row * dst.ld + col;
        if (dst.bf16) reinterpret_cast<uint16_t*>(dst.base)[at] = bf16_bits(value);
        else dst.base[at] = value;
    };
#pragma unroll
    for (int n = 0; n < FLASH_MAX_N; n++) {
        if (n < d / 8) {
            const int col = 8 * n + 2 * t;
            if (lo < T) {
                put(lo, col, acc[n][0] * scale_lo);
                put(lo, col + 1, acc[n][1] * scale_lo);
            }
            if (hi < T) {
                put(hi, col, acc[n][2] * scale_hi);
                put(hi, col + 1, acc[n][3] * scale_hi);
            }
        }
    }
}

__device__ inline void zero(float acc[FLASH_MAX_N][4]) {
#pragma unroll
    for (int n = 0; n < FLASH_MAX_N; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

// Element i of a lane's 16 x FLASH_STREAM tile: 0, 1 in row g, 2, 3 in row g + 8, at
// column 8 j + 2 t + (i & 1).
__device__ inline int column_of(int j, int i, int lane) { return 8 * j + 2 * (lane % 4) + (i & 1); }

#define LOG2E 1.4426950408889634f
#endif  // FLASH_UNSUPPORTED

// out = dropped softmax(Q Kᵀ scale, causal) V per head (H query heads a sequence), and
// lse (B H, T) = each row's log-sum-exp of its scaled scores, which the backward needs.
// Grid (ceil(T / 64), B H); FLASH_WARPS warps, each owning 16 queries. One pass over
// the keys (K staged as it is, V transposed): each warp's scores, its rows' running
// maxima and sums, and its output's sums stay in registers; the sums are rescaled as a
// row's maximum grows and divided by the row's sum at the end. Exponentials in base 2,
// the scale folded in. The output is f32, or bf16 (a bf16 view) for the product that
// reads it.
extern "C" __global__ void flash_forward(HeadView out, float* lse, HeadView q, HeadView k,
                                         HeadView v, int T, int d, int H, float scale,
                                         Dropout dropout) {
#ifdef FLASH_UNSUPPORTED
    __trap();
#else
    dropout = pass_read(dropout);
    __shared__ __align__(16) uint16_t ks[ROWS_TILE];
    __shared__ __align__(16) uint16_t vt[COLS_TILE];
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const long long bh = blockIdx.y;
    const HeadIn qh = head_in(q, bh, H), kh = head_in(k, bh, H), vh = head_in(v, bh, H);
    const int block0 = blockIdx.x * FLASH_ROWS, row0 = block0 + 16 * warp;
    const int last = min(block0 + FLASH_ROWS, T) - 1;  // the block's last query
    const bool active = row0 < T;
    const int lo = row0 + lane / 4, hi = lo + 8;
    const float to_base2 = scale * LOG2E;

    uint32_t qf[FLASH_MAX_F][4];
    own_rows(qf, qh, row0, T, d, lane);
    // The output's sums; the rows' running maxima (base 2, scaled) and this lane's share
    // of their sums (the row's 4 lanes add theirs at the end).
    float o[FLASH_MAX_N][4];
    zero(o);
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;

    for (int key0 = 0; key0 <= last; key0 += FLASH_STREAM) {
        __syncthreads();  // every warp is done with the previous keys
        stage(ks, nullptr, kh, key0, T, d);
        stage(nullptr, vt, vh, key0, T, d);
        __syncthreads();
        if (!active || key0 > row0 + 15) continue;

        float s[FLASH_STREAM / 8][4];
        products_t(s, qf, ks, d, lane);
        // Scaled to base 2, keys after a row's query (and rows past T) to -inf; each
        // row's maximum over the tile, from the 4 lanes that hold its columns.
        float max_lo = -INFINITY, max_hi = -INFINITY;
#pragma unroll
        for (int j = 0; j < FLASH_STREAM / 8; j++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int row = i < 2 ? lo : hi, key = key0 + column_of(j, i, lane);
                const float x = key <= row && row < T ? s[j][i] * to_base2 : -INFINITY;
                s[j][i] = x;
                if (i < 2) max_lo = fmaxf(max_lo, x);
                else max_hi = fmaxf(max_hi, x);
            }
        }
        for (int other = 1; other < 4; other *= 2) {
            max_lo = fmaxf(max_lo, __shfl_xor_sync(FULL_MASK, max_lo, other));
            max_hi = fmaxf(max_hi, __shfl_xor_sync(FULL_MASK, max_hi, other));
        }
        const float new_lo = fmaxf(m_lo, max_lo), new_hi = fmaxf(m_hi, max_hi);
        // A row that has seen no key yet has nothing to rescale (and -inf - -inf is NaN).
        const float keep_lo = m_lo == -INFINITY ? 0.0f : exp2f(m_lo - new_lo);
        const float keep_hi = m_hi == -INFINITY ? 0.0f : exp2f(m_hi - new_hi);
        m_lo = new_lo;
        m_hi = new_hi;
        // P = 2^(x - max): its sums before dropout, then the dropped P in place.
        float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
        for (int j = 0; j < FLASH_STREAM / 8; j++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int row = i < 2 ? lo : hi, key = key0 + column_of(j, i, lane);
                const float x = s[j][i];
                const float p = x == -INFINITY ? 0.0f : exp2f(x - (i < 2 ? m_lo : m_hi));
                if (i < 2) sum_lo += p;
                else sum_hi += p;
                const unsigned long long element = (unsigned long long)(bh * T + row) * T + key;
                s[j][i] = p == 0.0f ? 0.0f : p * dropout_scale(dropout, element);
            }
        }
        l_lo = l_lo * keep_lo + sum_lo;
        l_hi = l_hi * keep_hi + sum_hi;
#pragma unroll
        for (int n = 0; n < FLASH_MAX_N; n++) {
            o[n][0] *= keep_lo;
            o[n][1] *= keep_lo;
            o[n][2] *= keep_hi;
            o[n][3] *= keep_hi;
        }
        accumulate(o, s, vt, d, lane);
    }
    if (!active) return;
    for (int other = 1; other < 4; other *= 2) {
        l_lo += __shfl_xor_sync(FULL_MASK, l_lo, other);
        l_hi += __shfl_xor_sync(FULL_MASK, l_hi, other);
    }
    store_rows(out, bh, H, o, row0, T, d, 1.0f / l_lo, 1.0f / l_hi, lane);
    // The log-sum-exp in natural units: max + log(sum), both from base 2.
    const float ln2 = 0.6931471805599453f;
    if (lane % 4 == 0 && lo < T) lse[bh * T + lo] = (m_lo + log2f(l_lo)) * ln2;
    if (lane % 4 == 0 && hi < T) lse[bh * T + hi] = (m_hi + log2f(l_hi)) * ln2;
#endif
}

// dsum (B H, T) = each row's dY . Y over its head's d columns, from the merged (B T, H d)
// layouts: the D_i = sum_j P_ij dP_ij of the softmax's backward. dY and Y are f32 (rounded
// to bf16 as read where `round_dy`, `round_y`) or bf16 (`dy16`, `y16`), as
// FlashAttention-2 reads them in bf16. One warp per row.
extern "C" __global__ void flash_backward_sums(float* dsum, const float* dy, const uint16_t* dy16,
                                               int round_dy, const float* y, const uint16_t* y16,
                                               int round_y, int B, int T, int H, int d) {
    const long long row = blockIdx.x * (long long)(blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= (long long)B * H * T) return;
    const int t = (int)(row % T), h = (int)(row / T % H);
    const long long b = row / T / H;
    const long long at = (b * T + t) * H * d + (long long)h * d;
    float sum = 0.0f;
    for (int c = lane; c < d; c += WARP_SIZE) {
        sum += load(dy, dy16, round_dy, at + c) * load(y, y16, round_y, at + c);
    }
    sum = warp_sum(sum);
    if (lane == 0) dsum[row] = sum;
}


// dK, dV per query head (their group's sum is the caller's) from Q, K, V, dY (the heads'
// output gradient), lse and dsum: each warp owns 16 keys (K and V as fragments) and
// walks the queries at or after them, FLASH_STREAM at a time (Q and dY staged as they
// are and transposed). Per tile, in registers: Sᵀ = K Qᵀ, dPᵀ = V dYᵀ, then
// Pdᵀ = Pᵀ * mask and dSᵀ = Pᵀ (dPᵀ * mask - D); dV += Pdᵀ dY, dK += scale dSᵀ Q.
// Grid (ceil(T / 64), B H); FLASH_WARPS warps.
extern "C" __global__ void flash_backward_kv(HeadView dk, HeadView dv, HeadView q, HeadView k,
                                             HeadView v, HeadView dy, const float* lse,
                                             const float* dsum, int T, int d, int H, float scale,
                                             Dropout dropout) {
#ifdef FLASH_UNSUPPORTED
    __trap();
#else
    dropout = pass_read(dropout);
    __shared__ __align__(16) uint16_t qs[ROWS_TILE];
    __shared__ __align__(16) uint16_t qt[COLS_TILE];
    __shared__ __align__(16) uint16_t dys[ROWS_TILE];
    __shared__ __align__(16) uint16_t dyt[COLS_TILE];
    __shared__ float tile_lse[FLASH_STREAM], tile_dsum[FLASH_STREAM];
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const long long bh = blockIdx.y;
    const HeadIn qh = head_in(q, bh, H), kh = head_in(k, bh, H), vh = head_in(v, bh, H);
    const HeadIn dyh = head_in(dy, bh, H);
    const int block0 = blockIdx.x * FLASH_ROWS, key0 = block0 + 16 * warp;
    const bool active = key0 < T;
    const int lo = key0 + lane / 4, hi = lo + 8;
    const float to_base2 = scale * LOG2E;

    uint32_t kf[FLASH_MAX_F][4], vf[FLASH_MAX_F][4];
    own_rows(kf, kh, key0, T, d, lane);
    own_rows(vf, vh, key0, T, d, lane);
    float acc_k[FLASH_MAX_N][4], acc_v[FLASH_MAX_N][4];
    zero(acc_k);
    zero(acc_v);
    for (int query0 = block0; query0 < T; query0 += FLASH_STREAM) {
        __syncthreads();  // every warp is done with the previous queries
        stage(qs, qt, qh, query0, T, d);
        stage(dys, dyt, dyh, query0, T, d);
        if (threadIdx.x < FLASH_STREAM) {
            const int i = query0 + threadIdx.x;
            tile_lse[threadIdx.x] = i < T ? lse[bh * T + i] * LOG2E : 0.0f;
            tile_dsum[threadIdx.x] = i < T ? dsum[bh * T + i] : 0.0f;
        }
        __syncthreads();
        if (!active || query0 + FLASH_STREAM - 1 < key0) continue;

        float s[FLASH_STREAM / 8][4], dp[FLASH_STREAM / 8][4];
        products_t(s, kf, qs, d, lane);
        products_t(dp, vf, dys, d, lane);
#pragma unroll
        for (int j = 0; j < FLASH_STREAM / 8; j++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int key = i < 2 ? lo : hi, col = column_of(j, i, lane), query = query0 + col;
                float pd = 0.0f, ds = 0.0f;
                if (key <= query && query < T) {
                    const float p = exp2f(s[j][i] * to_base2 - tile_lse[col]);
                    const unsigned long long element = (unsigned long long)(bh * T + query) * T + key;
                    const float keep = dropout_scale(dropout, element);
                    pd = p * keep;
                    ds = p * (dp[j][i] * keep - tile_dsum[col]);
                }
                s[j][i] = pd;
                dp[j][i] = ds;
            }
        }
        accumulate(acc_v, s, dyt, d, lane);
        accumulate(acc_k, dp, qt, d, lane);
    }
    if (active) {
        store_rows(dk, bh, H, acc_k, key0, T, d, scale, scale, lane);
        store_rows(dv, bh, H, acc_v, key0, T, d, 1.0f, 1.0f, lane);
    }
#endif
}

// dQ = scale sum over keys of dS K: each warp owns 16 queries (Q and dY as fragments)
// and walks the keys at or before them, FLASH_STREAM at a time (K staged as it is and
// transposed, V as it is). Per tile, in registers: S = Q Kᵀ, dP = dY Vᵀ, then
// dS = P (dP * mask - D); dQ += dS K. Grid (ceil(T / 64), B H); FLASH_WARPS warps.
extern "C" __global__ void flash_backward_q(HeadView dq, HeadView q, HeadView k, HeadView v,
                                            HeadView dy, const float* lse, const float* dsum,
                                            int T, int d, int H, float scale, Dropout dropout) {
#ifdef FLASH_UNSUPPORTED
    __trap();
#else
    dropout = pass_read(dropout);
    __shared__ __align__(16) uint16_t ks[ROWS_TILE];
    __shared__ __align__(16) uint16_t kt[COLS_TILE];
    __shared__ __align__(16) uint16_t vs[ROWS_TILE];
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const long long bh = blockIdx.y;
    const HeadIn qh = head_in(q, bh, H), kh = head_in(k, bh, H), vh = head_in(v, bh, H);
    const int block0 = blockIdx.x * FLASH_ROWS, row0 = block0 + 16 * warp;
    const int last = min(block0 + FLASH_ROWS, T) - 1;
    const bool active = row0 < T;
    const int lo = row0 + lane / 4, hi = lo + 8;
    const float to_base2 = scale * LOG2E;
    const float lse_lo = lo < T ? lse[bh * T + lo] * LOG2E : 0.0f;
    const float lse_hi = hi < T ? lse[bh * T + hi] * LOG2E : 0.0f;
    const float dsum_lo = lo < T ? dsum[bh * T + lo] : 0.0f;
    const float dsum_hi = hi < T ? dsum[bh * T + hi] : 0.0f;

    uint32_t qf[FLASH_MAX_F][4], dyf[FLASH_MAX_F][4];
    own_rows(qf, qh, row0, T, d, lane);
    own_rows(dyf, head_in(dy, bh, H), row0, T, d, lane);
    float acc[FLASH_MAX_N][4];
    zero(acc);
    for (int key0 = 0; key0 <= last; key0 += FLASH_STREAM) {
        __syncthreads();  // every warp is done with the previous keys
        stage(ks, kt, kh, key0, T, d);
        stage(vs, nullptr, vh, key0, T, d);
        __syncthreads();
        if (!active || key0 > row0 + 15) continue;

        float s[FLASH_STREAM / 8][4], dp[FLASH_STREAM / 8][4];
        products_t(s, qf, ks, d, lane);
        products_t(dp, dyf, vs, d, lane);
#pragma unroll
        for (int j = 0; j < FLASH_STREAM / 8; j++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int row = i < 2 ? lo : hi, key = key0 + column_of(j, i, lane);
                float ds = 0.0f;
                if (key <= row && row < T) {
                    const float p = exp2f(s[j][i] * to_base2 - (i < 2 ? lse_lo : lse_hi));
                    const unsigned long long element = (unsigned long long)(bh * T + row) * T + key;
                    const float keep = dropout_scale(dropout, element);
                    ds = p * (dp[j][i] * keep - (i < 2 ? dsum_lo : dsum_hi));
                }
                s[j][i] = ds;
            }
        }
        accumulate(acc, s, kt, d, lane);
    }
    if (active) store_rows(dq, bh, H, acc, row0, T, d, scale, scale, lane);
#endif
}
