// LayerNorm and RMSNorm over rows of C, forward and backward, one warp per row.
// LayerNorm: (x - mean) rstd w (+ b); RMSNorm: x rstd w, rstd = 1 / sqrt(mean(x^2) + eps)
// (src/cpu/ops/norm.rs has the same formulas). `rms` picks RMSNorm; mean is then 0.
#include "common.cuh"

// out = norm(x) for row `row` (x its values), by one warp: as f32 (`out`), rounded to
// bf16 for a product (`out16`), or both (`store`); keeps the row's mean and rstd. b may
// be null. Each lane reads only its own columns (lane, lane + 32, ...), so x may have
// just been written by the same lanes.
__device__ inline void norm_row(float* out, uint16_t* out16, float* mean, float* rstd,
                                const float* xr, const float* w, const float* b, int row, int C,
                                float eps, int rms, int lane) {
    float m = 0.0f;
    if (!rms) {
        float sum = 0.0f;
        for (int i = lane; i < C; i += WARP_SIZE) sum += xr[i];
        m = warp_sum(sum) / C;
    }
    float var = 0.0f;
    for (int i = lane; i < C; i += WARP_SIZE) {
        const float d = xr[i] - m;
        var += d * d;
    }
    const float s = 1.0f / sqrtf(warp_sum(var) / C + eps);
    const long long at = (long long)row * C;
    for (int i = lane; i < C; i += WARP_SIZE) {
        store(out, out16, at + i, (xr[i] - m) * s * w[i] + (b != nullptr ? b[i] : 0.0f));
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = s;
    }
}

// out = norm(x) per row; one warp per row (`norm_row`).
extern "C" __global__ void norm_forward(float* out, uint16_t* out16, float* mean, float* rstd,
                                        const float* x, const float* w, const float* b, int rows,
                                        int C, float eps, int rms) {
    const int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) return;
    norm_row(out, out16, mean, rstd, x + (long long)row * C, w, b, row, C, eps, rms, lane);
}

// A residual add and the norm of its result in one pass over each row: res = x +
// (branch + branch_bias) * mask (the branch's dropout, element r C + i, as
// residual_forward draws it), then out = norm(res) as norm_forward. The branch is a
// product's output: f32 (`branch`, rounded to bf16 as read where `round`) or bf16
// (`branch16`), its layer's bias (null for none) added here in f32. One warp per row.
extern "C" __global__ void residual_norm_forward(float* res, float* out, uint16_t* out16,
                                                 float* mean, float* rstd, const float* x,
                                                 const float* branch, const uint16_t* branch16,
                                                 int round, const float* branch_bias,
                                                 Dropout dropout, const float* w, const float* b,
                                                 int rows, int C, float eps, int rms) {
    dropout = pass_read(dropout);
    const int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) return;
    const long long at = (long long)row * C;
    for (int i = lane; i < C; i += WARP_SIZE) {
        float y = load(branch, branch16, round, at + i);
        if (branch_bias != nullptr) y += branch_bias[i];
        res[at + i] = x[at + i] + y * dropout_scale(dropout, at + i);
    }
    norm_row(out, out16, mean, rstd, res + at, w, b, row, C, eps, rms, lane);
}

// The forward's output again from the kept statistics (for the backward of the
// product that reads it), as f32, bf16 or both: norm_row's values. One warp per row, so
// no element divides its index to find its row (a 64-bit division is dozens of
// instructions, more than the element's memory traffic costs).
extern "C" __global__ void norm_apply(float* out, uint16_t* out16, const float* x, const float* w,
                                      const float* b, const float* mean, const float* rstd,
                                      int rows, int C) {
    const int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) return;
    const long long at = (long long)row * C;
    const float m = mean[row], s = rstd[row];
    for (int i = lane; i < C; i += WARP_SIZE) {
        store(out, out16, at + i, (x[at + i] - m) * s * w[i] + (b != nullptr ? b[i] : 0.0f));
    }
}

// dx += d(norm)/dx . dout per row: with xhat = (x - mean) rstd and g = dout w,
// dx += rstd (g - mean(g) - xhat mean(g xhat)); RMSNorm drops the mean(g) term. Where
// dx16 is given, the new dx rounded to bf16 there too (the operand of the bf16
// products that read the residual stream's gradient next). dout is a product's output
// (the norm's output's gradient): f32 (`dout`, rounded as read where `round`) or bf16
// (`dout16`).
extern "C" __global__ void norm_backward_input(float* dx, uint16_t* dx16, const float* dout,
                                               const uint16_t* dout16, int round,
                                               const float* x, const float* w, const float* mean,
                                               const float* rstd, int rows, int C, int rms) {
    const int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) return;
    const long long base = (long long)row * C;
    const float m = mean[row], s = rstd[row];
    float g_sum = 0.0f, gx_sum = 0.0f;
    for (int i = lane; i < C; i += WARP_SIZE) {
        const float g = load(dout, dout16, round, base + i) * w[i];
        g_sum += g;
        gx_sum += g * (x[base + i] - m) * s;
    }
    const float g_mean = rms ? 0.0f : warp_sum(g_sum) / C;
    const float gx_mean = warp_sum(gx_sum) / C;
    for (int i = lane; i < C; i += WARP_SIZE) {
        const float xhat = (x[base + i] - m) * s;
        const float d = load(dout, dout16, round, base + i);
        const float updated = dx[base + i] + s * (d * w[i] - g_mean - xhat * gx_mean);
        dx[base + i] = updated;
        if (dx16 != nullptr) dx16[base + i] = bf16_bits(updated);
    }
}

// Columns a lane sums in the one-pass backward: rows up to 32 NORM_LANE_COLS wide
// (1,536) take it, wider ones norm_backward_input and norm_backward_params.
#define NORM_LANE_COLS 48

// The norm's whole backward in one pass over the rows: warp v of the grid's V takes
// rows v, v + V, v + 2V, ...; for each, dx += as norm_backward_input (the same sums in
// the same order), and its lane's columns of dout xhat and dout added to sums in
// registers, written at the end to partials[v][0 .. C] and partials[v][C .. 2C]
// (`add_column_sums` then adds the V rows in order: deterministic). dx16 as in
// norm_backward_input.
extern "C" __global__ void norm_backward(float* dx, uint16_t* dx16, float* partials,
                                         const float* dout, const uint16_t* dout16, int round,
                                         const float* x, const float* w, const float* mean,
                                         const float* rstd, int rows, int C, int rms) {
    const int warps = gridDim.x * (blockDim.x / WARP_SIZE);
    const int v = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    float dw[NORM_LANE_COLS], db[NORM_LANE_COLS];
#pragma unroll
    for (int j = 0; j < NORM_LANE_COLS; j++) dw[j] = db[j] = 0.0f;
    for (int row = v; row < rows; row += warps) {
        const long long base = (long long)row * C;
        const float m = mean[row], s = rstd[row];
        float g_sum = 0.0f, gx_sum = 0.0f;
#pragma unroll
        for (int j = 0; j < NORM_LANE_COLS; j++) {
            const int i = lane + WARP_SIZE * j;
            if (i < C) {
                const float g = load(dout, dout16, round, base + i) * w[i];
                g_sum += g;
                gx_sum += g * (x[base + i] - m) * s;
            }
        }
        const float g_mean = rms ? 0.0f : warp_sum(g_sum) / C;
        const float gx_mean = warp_sum(gx_sum) / C;
#pragma unroll
        for (int j = 0; j < NORM_LANE_COLS; j++) {
            const int i = lane + WARP_SIZE * j;
            if (i < C) {
                const float d = load(dout, dout16, round, base + i), xhat = (x[base + i] - m) * s;
                const float updated = dx[base + i] + s * (d * w[i] - g_mean - xhat * gx_mean);
                dx[base + i] = updated;
                if (dx16 != nullptr) dx16[base + i] = bf16_bits(updated);
                dw[j] += d * xhat;
                db[j] += d;
            }
        }
    }
    float* p = partials + (long long)v * 2 * C;
#pragma unroll
    for (int j = 0; j < NORM_LANE_COLS; j++) {
        const int i = lane + WARP_SIZE * j;
        if (i < C) {
            p[i] = dw[j];
            p[C + i] = db[j];
        }
    }
}

// The gain's and bias's gradients in two steps, deterministic: each block row j sums
// rows j, j + R, j + 2R, ... (R = gridDim.y) of dout xhat and of dout into
// partials[j][0 .. C] and partials[j][C .. 2C]; `add_column_sums` adds the R partials.
extern "C" __global__ void norm_backward_params(float* partials, const float* dout,
                                                const uint16_t* dout16, int round,
                                                const float* x, const float* mean,
                                                const float* rstd, int rows, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float dw = 0.0f, db = 0.0f;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const long long i = (long long)r * C + c;
        const float d = load(dout, dout16, round, i);
        dw += d * (x[i] - mean[r]) * rstd[r];
        db += d;
    }
    float* p = partials + (long long)blockIdx.y * 2 * C;
    p[c] = dw;
    p[C + c] = db;
}

// Each block row j sums rows j, j + R, ... of x (rows x C: f32 `x`, rounded as read where
// `round`, or bf16 `x16`) into partials[j][0 .. C].
extern "C" __global__ void column_partials(float* partials, const float* x, const uint16_t* x16,
                                           int round, int rows, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float sum = 0.0f;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) sum += load(x, x16, round, (long long)r * C + c);
    partials[(long long)blockIdx.y * C + c] = sum;
}

// dst[c] += the sum of partials[j][c] over j < parts (rows `stride` apart), in order.
extern "C" __global__ void add_column_sums(float* dst, const float* partials, int parts,
                                           int stride, int count) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= count) return;
    float sum = 0.0f;
    for (int j = 0; j < parts; j++) sum += partials[(long long)j * stride + c];
    dst[c] += sum;
}
