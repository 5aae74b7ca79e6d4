// The parts of causal self-attention around its batched matrix products (which
// cuBLAS does): heads out of and back into rows, the causal softmax with its dropout,
// and the softmax's backward. Heads are laid out (B, H, T, d) for the products; the
// weights (B, H, T, T), the layout of their dropout mask.
#include "common.cuh"

// q, k, v (B, H, T, d) from qkv rows (B T, W = (H + 2 Hkv) d): each query head gets
// its group's K/V head (grouped heads are copied out to every head of the group).
extern "C" __global__ void split_heads(float* q, float* k, float* v, const float* qkv, int B,
                                       int T, int H, int Hkv, int d) {
    const int W = (H + 2 * Hkv) * d;
    const int group = H / Hkv;
    FOR_EACH(i, (long long)B * H * T * d) {
        const int c = (int)(i % d);
        const long long t = (i / d) % T;
        const int h = (int)((i / ((long long)d * T)) % H);
        const long long b = i / ((long long)d * T * H);
        const float* row = qkv + (b * T + t) * W;
        const int kv = h / group;
        q[i] = row[h * d + c];
        k[i] = row[H * d + kv * d + c];
        v[i] = row[H * d + Hkv * d + kv * d + c];
    }
}

// y rows (B T, H d), heads side by side, from heads (B, H, T, d).
extern "C" __global__ void merge_heads(float* y, const float* heads, int B, int T, int H, int d) {
    FOR_EACH(i, (long long)B * T * H * d) {
        const int c = (int)(i % ((long long)H * d));
        const long long bt = i / ((long long)H * d);
        const long long b = bt / T, t = bt % T;
        const int h = c / d;
        y[i] = heads[((b * H + h) * T + t) * d + (c % d)];
    }
}

// The inverse of `merge_heads`: heads (B, H, T, d) from rows (B T, H d).
extern "C" __global__ void split_rows(float* heads, const float* y, int B, int T, int H, int d) {
    FOR_EACH(i, (long long)B * H * T * d) {
        const int c = (int)(i % d);
        const long long t = (i / d) % T;
        const int h = (int)((i / ((long long)d * T)) % H);
        const long long b = i / ((long long)d * T * H);
        heads[i] = y[(b * T + t) * (long long)H * d + h * d + c];
    }
}

// The backward of `split_heads`: dqkv rows from dq, dk, dv (B, H, T, d); a K/V head's
// gradient is the sum over the query heads of its group, added in head order.
extern "C" __global__ void merge_head_grads(float* dqkv, const float* dq, const float* dk,
                                            const float* dv, int B, int T, int H, int Hkv,
                                            int d) {
    const int W = (H + 2 * Hkv) * d;
    const int group = H / Hkv;
    FOR_EACH(i, (long long)B * T * W) {
        const int col = (int)(i % W);
        const long long bt = i / W;
        const long long b = bt / T, t = bt % T;
        const int c = col % d;
        if (col < H * d) {
            const int h = col / d;
            dqkv[i] = dq[((b * H + h) * T + t) * d + c];
            continue;
        }
        const bool is_k = col < (H + Hkv) * d;
        const int kv = (is_k ? col - H * d : col - (H + Hkv) * d) / d;
        const float* src = is_k ? dk : dv;
        float sum = 0.0f;
        for (int g = 0; g < group; g++) {
            const int h = kv * group + g;
            sum += src[((b * H + h) * T + t) * d + c];
        }
        dqkv[i] = sum;
    }
}

// In place on scores (B H rows of T x T, already scaled by 1 / sqrt(d)): the causal
// softmax of each row (zeros above the diagonal), times the dropout mask of the
// weights. One warp per row.
extern "C" __global__ void causal_softmax(float* att, int BH, int T, Dropout dropout) {
    dropout = pass_read(dropout);
    const long long row = blockIdx.x * (long long)(blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= (long long)BH * T) return;
    const int i = (int)(row % T);  // the query's position: it sees keys 0 ..= i
    float* s = att + row * T;
    float m = -INFINITY;
    for (int j = lane; j <= i; j += WARP_SIZE) m = fmaxf(m, s[j]);
    m = warp_max(m);
    float sum = 0.0f;
    for (int j = lane; j <= i; j += WARP_SIZE) sum += expf(s[j] - m);
    const float inv = 1.0f / warp_sum(sum);
    for (int j = lane; j < T; j += WARP_SIZE) {
        s[j] = j <= i ? expf(s[j] - m) * inv * dropout_scale(dropout, row * T + j) : 0.0f;
    }
}

// In place on datt (the gradient of the dropped weights P * mask), given P: with
// dP = datt * mask, dS = P (dP - sum_j P_j dP_j) per row. One warp per row.
extern "C" __global__ void causal_softmax_backward(float* datt, const float* p, int BH, int T,
                                                   Dropout dropout) {
    dropout = pass_read(dropout);
    const long long row = blockIdx.x * (long long)(blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= (long long)BH * T) return;
    const int i = (int)(row % T);
    float* g = datt + row * T;
    const float* pr = p + row * T;
    // dP in place first (each element's mask drawn once), then the row's dot product.
    float dot = 0.0f;
    for (int j = lane; j <= i; j += WARP_SIZE) {
        g[j] *= dropout_scale(dropout, row * T + j);
        dot += pr[j] * g[j];
    }
    dot = warp_sum(dot);
    for (int j = lane; j < T; j += WARP_SIZE) {
        g[j] = j <= i ? pr[j] * (g[j] - dot) : 0.0f;
    }
}
