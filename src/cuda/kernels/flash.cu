// Causal attention without the T x T matrices (flash attention's tiling, Dao et al.
// 2022), in bf16 on the tensor cores through WMMA with f32 sums: the attention of
// Precision::Bf16. The products path (attention.cu + cuBLAS) writes and reads B H T^2
// scores about fourteen times a step; these kernels keep each 16 x 16 tile of scores in
// shared memory and recompute it where it is needed again.
//
// Heads are f32 in global memory, read and written where they are (`HeadView`): in the
// rows the qkv projection writes and the output projection reads (B T rows, heads side
// by side), or split out as (B H, T, d); d a multiple of 16 up to FLASH_MAX_D. Tiles
// are converted to bf16 as they are loaded, which rounds the
// same operands the products path rounds (Q, K for the scores; P, V for the output;
// dY, V; dS, K; dS, Q; P, dY in the backward). A block is FLASH_WARPS warps; each warp
// owns 16 rows (queries, or keys in flash_backward_kv) and the block shares the tiles it
// streams. Element (i, j) of head bh is dropped by the mask of element
// (bh T + i) T + j of the weights, as causal_softmax drops it.
//
// Deterministic: every sum is taken in one order, no atomics (the backward computes dK
// and dV over key tiles and dQ over query tiles in two kernels, each recomputing P).
#include "common.cuh"

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <mma.h>
#endif

using namespace nvcuda;

#define FLASH_WARPS 4
#define FLASH_ROWS (16 * FLASH_WARPS)  // rows a block owns
#define FLASH_MAX_D 64
#define FLASH_MAX_F (FLASH_MAX_D / 16)  // 16-wide column chunks of a head
// A tile of 16 head rows in shared memory: rows TILE_LD(d) values apart, 8 more than d,
// so the 8 rows WMMA reads at once start in 8 different banks (at d apart, 64 bf16 =
// 128 bytes, they would all start in bank 0).
#define TILE_LD(d) ((d) + 8)
#define FLASH_TILE (16 * (FLASH_MAX_D + 8))

// Where the heads of a tensor are (`HeadView` in src/cuda/kernels.rs, field for field):
// row t, column c of head h of sequence b at
//   base + b batch_stride + (h / group) head_stride + t ld + c,
// so the qkv rows' q heads are (T W, d, W, 1), their K/V heads the same from their
// columns with the query heads' group, the attention output's rows (T C, d, C, 1), and
// split heads (H T d, T d, d, 1).
struct HeadView {
    float* base;
    long long batch_stride, head_stride;
    int ld, group;
};

// Head bh's (= b H + h) first row.
__device__ inline float* head_rows(const HeadView& v, long long bh, int H) {
    const long long b = bh / H;
    const int h = (int)(bh % H);
    return v.base + b * v.batch_stride + (long long)(h / v.group) * v.head_stride;
}

// bf16 tensor cores need sm_80 (mma.h declares bf16 fragments only there); built for
// less, the kernels trap rather than lie, and the engine never chooses them
// (plan::Attention::choose reads the architecture build.rs targeted).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define FLASH_UNSUPPORTED 1
#endif

#ifndef FLASH_UNSUPPORTED
typedef __nv_bfloat16 bf16;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> RowsA;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major> ColsA;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> RowsB;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> ColsB;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> Acc;

// dst (16 rows TILE_LD(d) apart, bf16) <- rows row0 .. row0 + 15 of src (T rows of d,
// `ld` apart) f32, zeros past T; the `threads` threads from `first` share the copy.
__device__ inline void load_tile(bf16* dst, const float* src, int ld, int row0, int T, int d,
                                 int first, int threads) {
    for (int e = first; e < 16 * d; e += threads) {
        const int r = row0 + e / d;
        dst[(e / d) * TILE_LD(d) + e % d] =
            __float2bfloat16(r < T ? src[(long long)r * ld + e % d] : 0.0f);
    }
}

// The max and the sum over the 16 lanes of each half-warp (shuffles within a half).
__device__ inline float half_warp_max(float v) {
    for (int o = 8; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ inline float half_warp_sum(float v) {
    for (int o = 8; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The block's next 16 keys, K (and V, when `vs` is set) into shared memory, once every
// warp is done with the previous ones. All the block's threads call it.
__device__ inline void next_keys(bf16* ks, bf16* vs, const float* k, int ldk, const float* v,
                                 int ldv, int key0, int T, int d) {
    __syncthreads();
    load_tile(ks, k, ldk, key0, T, d, threadIdx.x, blockDim.x);
    if (vs != nullptr) load_tile(vs, v, ldv, key0, T, d, threadIdx.x, blockDim.x);
    __syncthreads();
}

// Every fragment of `acc` to zero.
__device__ inline void zero(Acc* acc) {
#pragma unroll
    for (int f = 0; f < FLASH_MAX_F; f++) wmma::fill_fragment(acc[f], 0.0f);
}

// s (16 x 16, f32, row-major) <- a times b transposed, each 16 rows of d (tiles):
// scores of a tile of queries against a tile of keys (or dY against V).
__device__ inline void tile_product_t(float* s, const bf16* a, const bf16* b, int d) {
    Acc acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int f = 0; f < d / 16; f++) {
        RowsA fa;
        ColsB fb;
        wmma::load_matrix_sync(fa, a + f * 16, TILE_LD(d));
        wmma::load_matrix_sync(fb, b + f * 16, TILE_LD(d));
        wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(s, acc, 16, wmma::mem_row_major);
}

// Rows row0 .. row0 + 15 of dst (T rows of d, `ld` apart) f32 <- acc[0 .. d/16) (16 x
// 16 each) times `scale`, through `stage` (16 x 16 f32); one warp.
__device__ inline void store_rows(float* dst, int ld, Acc* acc, float* stage, int row0, int T,
                                  int d, float scale, int lane) {
#pragma unroll
    for (int f = 0; f < FLASH_MAX_F; f++) {
        if (f < d / 16) {
            wmma::store_matrix_sync(stage, acc[f], 16, wmma::mem_row_major);
            __syncwarp();
            for (int e = lane; e < 256; e += WARP_SIZE) {
                const int r = row0 + e / 16;
                if (r < T) dst[(long long)r * ld + f * 16 + e % 16] = stage[e] * scale;
            }
            __syncwarp();
        }
    }
}

#endif  // FLASH_UNSUPPORTED

// out = dropped softmax(Q Kᵀ scale, causal) V per head (H query heads a sequence), and
// lse (B H, T) = each row's log-sum-exp of its scaled scores, which the backward needs.
// Grid (ceil(T / 64), B H); FLASH_WARPS warps. Two passes over the keys: the rows'
// maxima and sums first, then P exactly normalised, so the output accumulates on the
// tensor cores with no rescaling.
extern "C" __global__ void flash_forward(HeadView out, float* lse, HeadView q, HeadView k,
                                         HeadView v, int T, int d, int H, float scale,
                                         Dropout dropout) {
#ifdef FLASH_UNSUPPORTED
    __trap();
#else
    __shared__ __align__(32) bf16 qs[FLASH_WARPS][FLASH_TILE];
    __shared__ __align__(32) bf16 ks[FLASH_TILE];
    __shared__ __align__(32) bf16 vs[FLASH_TILE];
    __shared__ __align__(32) float s[FLASH_WARPS][256];
    __shared__ __align__(32) bf16 p[FLASH_WARPS][256];
    __shared__ float row_lse[FLASH_WARPS][16];
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const long long bh = blockIdx.y;
    const float *qh = head_rows(q, bh, H), *kh = head_rows(k, bh, H), *vh = head_rows(v, bh, H);
    const int block0 = blockIdx.x * FLASH_ROWS, row0 = block0 + 16 * warp;
    const int last = min(block0 + FLASH_ROWS, T) - 1;  // the block's last query
    const bool active = row0 < T;

    load_tile(qs[warp], qh, q.ld, row0, T, d, lane, WARP_SIZE);
    // Pass 1: each row's running max and sum. Lane l reads elements l + 32 r of a tile
    // (rows 2 r + l / 16, column l % 16: consecutive lanes, consecutive words, no bank
    // conflicts), so a row's 16 columns are one half-warp, reduced by shuffles, and
    // lane l keeps the statistics of rows 2 r + l / 16.
    float m[8], l[8];
#pragma unroll
    for (int r = 0; r < 8; r++) m[r] = -INFINITY, l[r] = 0.0f;
    for (int key0 = 0; key0 <= last; key0 += 16) {
        next_keys(ks, nullptr, kh, k.ld, nullptr, 0, key0, T, d);
        if (!active || key0 > row0 + 15) continue;
        tile_product_t(s[warp], qs[warp], ks, d);
        __syncwarp();
#pragma unroll
        for (int r = 0; r < 8; r++) {
            const int e = lane + WARP_SIZE * r, i = row0 + e / 16, j = key0 + e % 16;
            const float x = i < T && j <= i ? s[warp][e] * scale : -INFINITY;
            const float m_new = fmaxf(m[r], half_warp_max(x));
            // exp(-inf) is 0 while a row has seen no key; -inf - -inf must not become NaN.
            const float sum = half_warp_sum(x == -INFINITY ? 0.0f : expf(x - m_new));
            const float rescale = m[r] == -INFINITY ? 0.0f : expf(m[r] - m_new);
            l[r] = l[r] * rescale + sum;
            m[r] = m_new;
        }
        __syncwarp();
    }
#pragma unroll
    for (int r = 0; r < 8; r++) {
        const int row = 2 * r + lane / 16, i = row0 + row;
        if (lane % 16 == 0) {
            const float value = m[r] + logf(l[r]);
            row_lse[warp][row] = value;
            if (active && i < T) lse[bh * T + i] = value;
        }
    }
    __syncwarp();

    // Pass 2: O = sum over key tiles of P V.
    Acc acc[FLASH_MAX_F];
    zero(acc);
    for (int key0 = 0; key0 <= last; key0 += 16) {
        next_keys(ks, vs, kh, k.ld, vh, v.ld, key0, T, d);
        if (!active || key0 > row0 + 15) continue;
        tile_product_t(s[warp], qs[warp], ks, d);
        __syncwarp();
        for (int e = lane; e < 256; e += WARP_SIZE) {
            const int i = row0 + e / 16, j = key0 + e % 16;
            float w = 0.0f;
            if (i < T && j <= i) {
                w = expf(s[warp][e] * scale - row_lse[warp][e / 16]) *
                    dropout_scale(dropout, (unsigned long long)(bh * T + i) * T + j);
            }
            p[warp][e] = __float2bfloat16(w);
        }
        __syncwarp();
#pragma unroll
        for (int f = 0; f < FLASH_MAX_F; f++) {
            if (f < d / 16) {
                RowsA fp;
                RowsB fv;
                wmma::load_matrix_sync(fp, p[warp], 16);
                wmma::load_matrix_sync(fv, vs + f * 16, TILE_LD(d));
                wmma::mma_sync(acc[f], fp, fv, acc[f]);
            }
        }
        __syncwarp();
    }
    if (active) store_rows(head_rows(out, bh, H), out.ld, acc, s[warp], row0, T, d, 1.0f, lane);
#endif
}

// dsum (B H, T) = each row's dY . Y over its head's d columns, from the merged (B T, H d)
// layouts: the D_i = sum_j P_ij dP_ij of the softmax's backward. One warp per row.
extern "C" __global__ void flash_backward_sums(float* dsum, const float* dy, const float* y,
                                               int B, int T, int H, int d) {
    const long long row = blockIdx.x * (long long)(blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= (long long)B * H * T) return;
    const int t = (int)(row % T), h = (int)(row / T % H);
    const long long b = row / T / H;
    const long long at = (b * T + t) * H * d + (long long)h * d;
    float sum = 0.0f;
    for (int c = lane; c < d; c += WARP_SIZE) sum += dy[at + c] * y[at + c];
    sum = warp_sum(sum);
    if (lane == 0) dsum[row] = sum;
}

#ifndef FLASH_UNSUPPORTED
// A warp's 16 x 16 tiles in the backward: the scores S = Q Kᵀ (unscaled) and
// dP = dY Vᵀ in f32, then the dropped weights Pd = P * mask and dS = P (dP * mask - D)
// in bf16 for the tensor cores.
struct BackwardTiles {
    __align__(32) float s[256];
    __align__(32) float dp[256];
    __align__(32) bf16 pd[256];
    __align__(32) bf16 ds[256];
};

// The tiles of head bh for 16 queries from query0 (qs, dys) against 16 keys from key0
// (ks, vs), each query's lse and D in row_lse, row_dsum. One warp.
__device__ inline void backward_tiles(BackwardTiles& t, const bf16* qs, const bf16* dys,
                                      const bf16* ks, const bf16* vs, const float* row_lse,
                                      const float* row_dsum, long long bh, int query0,
                                      int key0, int T, int d, float scale,
                                      const Dropout& dropout, int lane) {
    tile_product_t(t.s, qs, ks, d);
    tile_product_t(t.dp, dys, vs, d);
    __syncwarp();
    for (int e = lane; e < 256; e += WARP_SIZE) {
        const int i = query0 + e / 16, j = key0 + e % 16;
        float w = 0.0f, g = 0.0f;
        if (i < T && j <= i) {
            const float prob = expf(t.s[e] * scale - row_lse[e / 16]);
            const float keep = dropout_scale(dropout, (unsigned long long)(bh * T + i) * T + j);
            w = prob * keep;
            g = prob * (t.dp[e] * keep - row_dsum[e / 16]);
        }
        t.pd[e] = __float2bfloat16(w);
        t.ds[e] = __float2bfloat16(g);
    }
    __syncwarp();
}

#endif  // FLASH_UNSUPPORTED

// dK, dV per query head (their group's sum is the caller's) from Q, K, V, dY (the heads'
// output gradient), lse and dsum: each warp owns 16 keys and walks the query tiles at or
// after them; dV = sum Pdᵀ dY, dK = scale sum dSᵀ Q. Grid (ceil(T / 64), B H);
// FLASH_WARPS warps.
extern "C" __global__ void flash_backward_kv(HeadView dk, HeadView dv, HeadView q, HeadView k,
                                             HeadView v, HeadView dy, const float* lse,
                                             const float* dsum, int T, int d, int H, float scale,
                                             Dropout dropout) {
#ifdef FLASH_UNSUPPORTED
    __trap();
#else
    __shared__ __align__(32) bf16 ks[FLASH_WARPS][FLASH_TILE];
    __shared__ __align__(32) bf16 vs[FLASH_WARPS][FLASH_TILE];
    __shared__ __align__(32) bf16 qs[FLASH_TILE];
    __shared__ __align__(32) bf16 dys[FLASH_TILE];
    __shared__ float tile_lse[16], tile_dsum[16];
    __shared__ BackwardTiles tiles[FLASH_WARPS];
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const long long bh = blockIdx.y;
    const float *qh = head_rows(q, bh, H), *kh = head_rows(k, bh, H), *vh = head_rows(v, bh, H);
    const float* dyh = head_rows(dy, bh, H);
    const int block0 = blockIdx.x * FLASH_ROWS, key0 = block0 + 16 * warp;
    const bool active = key0 < T;

    load_tile(ks[warp], kh, k.ld, key0, T, d, lane, WARP_SIZE);
    load_tile(vs[warp], vh, v.ld, key0, T, d, lane, WARP_SIZE);
    Acc acc_k[FLASH_MAX_F], acc_v[FLASH_MAX_F];
    zero(acc_k);
    zero(acc_v);
    for (int query0 = block0; query0 < T; query0 += 16) {
        __syncthreads();
        load_tile(qs, qh, q.ld, query0, T, d, threadIdx.x, blockDim.x);
        load_tile(dys, dyh, dy.ld, query0, T, d, threadIdx.x, blockDim.x);
        if (threadIdx.x < 16) {
            const int i = query0 + threadIdx.x;
            tile_lse[threadIdx.x] = i < T ? lse[bh * T + i] : 0.0f;
            tile_dsum[threadIdx.x] = i < T ? dsum[bh * T + i] : 0.0f;
        }
        __syncthreads();
        if (!active || query0 + 15 < key0) continue;
        BackwardTiles& t = tiles[warp];
        backward_tiles(t, qs, dys, ks[warp], vs[warp], tile_lse, tile_dsum, bh, query0, key0, T, d,
                       scale, dropout, lane);
        ColsA fpd, fds;  // Pdᵀ and dSᵀ: (keys, queries)
        wmma::load_matrix_sync(fpd, t.pd, 16);
        wmma::load_matrix_sync(fds, t.ds, 16);
#pragma unroll
        for (int f = 0; f < FLASH_MAX_F; f++) {
            if (f < d / 16) {
                RowsB fdy, fq;
                wmma::load_matrix_sync(fdy, dys + f * 16, TILE_LD(d));
                wmma::load_matrix_sync(fq, qs + f * 16, TILE_LD(d));
                wmma::mma_sync(acc_v[f], fpd, fdy, acc_v[f]);
                wmma::mma_sync(acc_k[f], fds, fq, acc_k[f]);
            }
        }
        __syncwarp();
    }
    if (active) {
        store_rows(head_rows(dk, bh, H), dk.ld, acc_k, tiles[warp].s, key0, T, d, scale, lane);
        store_rows(head_rows(dv, bh, H), dv.ld, acc_v, tiles[warp].s, key0, T, d, 1.0f, lane);
    }
#endif
}

// dQ = scale sum over key tiles of dS K: each warp owns 16 queries and walks the key
// tiles at or before them. Grid (ceil(T / 64), B H); FLASH_WARPS warps.
extern "C" __global__ void flash_backward_q(HeadView dq, HeadView q, HeadView k, HeadView v,
                                            HeadView dy, const float* lse, const float* dsum,
                                            int T, int d, int H, float scale, Dropout dropout) {
#ifdef FLASH_UNSUPPORTED
    __trap();
#else
    __shared__ __align__(32) bf16 qs[FLASH_WARPS][FLASH_TILE];
    __shared__ __align__(32) bf16 dys[FLASH_WARPS][FLASH_TILE];
    __shared__ __align__(32) bf16 ks[FLASH_TILE];
    __shared__ __align__(32) bf16 vs[FLASH_TILE];
    __shared__ float row_lse[FLASH_WARPS][16], row_dsum[FLASH_WARPS][16];
    __shared__ BackwardTiles tiles[FLASH_WARPS];
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const long long bh = blockIdx.y;
    const float *qh = head_rows(q, bh, H), *kh = head_rows(k, bh, H), *vh = head_rows(v, bh, H);
    const int block0 = blockIdx.x * FLASH_ROWS, row0 = block0 + 16 * warp;
    const int last = min(block0 + FLASH_ROWS, T) - 1;
    const bool active = row0 < T;

    load_tile(qs[warp], qh, q.ld, row0, T, d, lane, WARP_SIZE);
    load_tile(dys[warp], head_rows(dy, bh, H), dy.ld, row0, T, d, lane, WARP_SIZE);
    if (lane < 16) {
        const int i = row0 + lane;
        row_lse[warp][lane] = i < T ? lse[bh * T + i] : 0.0f;
        row_dsum[warp][lane] = i < T ? dsum[bh * T + i] : 0.0f;
    }
    Acc acc[FLASH_MAX_F];
    zero(acc);
    for (int key0 = 0; key0 <= last; key0 += 16) {
        next_keys(ks, vs, kh, k.ld, vh, v.ld, key0, T, d);
        if (!active || key0 > row0 + 15) continue;
        BackwardTiles& t = tiles[warp];
        backward_tiles(t, qs[warp], dys[warp], ks, vs, row_lse[warp], row_dsum[warp], bh, row0,
                       key0, T, d, scale, dropout, lane);
        RowsA fds;
        wmma::load_matrix_sync(fds, t.ds, 16);
#pragma unroll
        for (int f = 0; f < FLASH_MAX_F; f++) {
            if (f < d / 16) {
                RowsB fk;
                wmma::load_matrix_sync(fk, ks + f * 16, TILE_LD(d));
                wmma::mma_sync(acc[f], fds, fk, acc[f]);
            }
        }
        __syncwarp();
    }
    if (active) store_rows(head_rows(dq, bh, H), dq.ld, acc, tiles[warp].s, row0, T, d, scale, lane);
#endif
}
