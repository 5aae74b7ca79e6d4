// Residual connections, dropout's backward, biases, scaling, RoPE.
#include "common.cuh"

// out = x + branch * mask (the branch's dropout).
extern "C" __global__ void residual_forward(float* out, const float* x, const float* branch,
                                            long long n, Dropout dropout) {
    FOR_EACH(i, n) { out[i] = x[i] + branch[i] * dropout_scale(dropout, i); }
}

// out = x * mask: dropout applied to x (forward) or to a gradient (backward).
extern "C" __global__ void dropout_apply(float* out, const float* x, long long n,
                                         Dropout dropout) {
    FOR_EACH(i, n) { out[i] = x[i] * dropout_scale(dropout, i); }
}

// out[r][c] += b[c].
extern "C" __global__ void add_bias(float* out, const float* b, int rows, int cols) {
    FOR_EACH(i, (long long)rows * cols) { out[i] += b[i % cols]; }
}

// Rotary positions on the q and k heads of qkv rows (width W), split-halves pairing
// (dimension i turns with i + d/2), by the angle of the row's position (first + row % T);
// sign -1 turns back (the backward). cos and sin are (T_max, d/2) tables.
// dst = src rounded to the nearest bf16 (`bf16_bits`).
extern "C" __global__ void to_bf16(uint16_t* dst, const float* src, long long n) {
    FOR_EACH(i, n) { dst[i] = bf16_bits(src[i]); }
}

extern "C" __global__ void rope(float* qkv, const float* cos_table, const float* sin_table,
                                int rows, int T, int first, const int* first_at,
                                const int* places, int heads, int d, int W, float sign) {
    first = start_of(first, first_at);
    const int half = d / 2;
    FOR_EACH(i, (long long)rows * heads * half) {
        const int k = (int)(i % half);
        const long long rh = i / half;
        const int head = (int)(rh % heads);
        const long long row = rh / heads;
        const long long p = position_of(row, T, first, places);
        float* h = qkv + row * W + (long long)head * d;
        const float c = cos_table[p * half + k], s = sign * sin_table[p * half + k];
        const float x = h[k], y = h[k + half];
        h[k] = x * c - y * s;
        h[k + half] = y * c + x * s;
    }
}
