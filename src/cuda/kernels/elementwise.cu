// Residual connections, dropout's backward, biases, scaling, RoPE.
#include "common.cuh"

// out = x + branch * mask (the branch's dropout).
extern "C" __global__ void residual_forward(float* out, const float* x, const float* branch,
                                            long long n, Dropout dropout) {
    dropout = pass_read(dropout);
    FOR_EACH(i, n) { out[i] = x[i] + branch[i] * dropout_scale(dropout, i); }
}

// out = x * mask: dropout applied to x (forward) or to a gradient (backward).
extern "C" __global__ void dropout_apply(float* out, const float* x, long long n,
                                         Dropout dropout) {
    dropout = pass_read(dropout);
    FOR_EACH(i, n) { out[i] = x[i] * dropout_scale(dropout, i); }
}

// out[r][c] += b[c]. One warp per row (no element divides its index).
extern "C" __global__ void add_bias(float* out, const float* b, int rows, int cols) {
    const int r = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (r >= rows) return;
    float* row = out + (long long)r * cols;
    for (int c = lane; c < cols; c += WARP_SIZE) row[c] += b[c];
}

// out16[r][c] = bf16(out16[r][c] + b[c]): a bias added to rows a product wrote in bf16
// (rounded again), where cuBLASLt cannot add it before rounding. One warp per row.
extern "C" __global__ void add_bias16(uint16_t* out16, const float* b, int rows, int cols) {
    const int r = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (r >= rows) return;
    uint16_t* row = out16 + (long long)r * cols;
    for (int c = lane; c < cols; c += WARP_SIZE) row[c] = bf16_bits(bf16_value(row[c]) + b[c]);
}

// dst = src rounded to the nearest bf16 (`bf16_bits`).
extern "C" __global__ void to_bf16(uint16_t* dst, const float* src, long long n) {
    FOR_EACH(i, n) { dst[i] = bf16_bits(src[i]); }
}

// Rotary positions on the q and k heads of qkv rows (width W), split-halves pairing
// (dimension i turns with i + d/2), by the angle of the row's position (first + row % T);
// sign -1 turns back (the backward). cos and sin are (T_max, d/2) tables. One warp per
// row, its position looked up once.
extern "C" __global__ void rope(float* qkv, const float* cos_table, const float* sin_table,
                                int rows, int T, int first, const int* first_at,
                                const int* places, int heads, int d, int W, float sign) {
    const int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) return;
    first = start_of(first, first_at);
    const int half = d / 2;
    const long long p = position_of(row, T, first, places);
    const float *cos_row = cos_table + p * half, *sin_row = sin_table + p * half;
    float* r = qkv + (long long)row * W;
    for (int head = 0; head < heads; head++) {
        float* h = r + (long long)head * d;
        for (int k = lane; k < half; k += WARP_SIZE) {
            const float c = cos_row[k], s = sign * sin_row[k];
            const float x = h[k], y = h[k + half];
            h[k] = x * c - y * s;
            h[k + half] = y * c + x * s;
        }
    }
}
