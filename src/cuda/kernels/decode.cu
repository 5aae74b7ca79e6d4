// What only decoding has: keys and values kept per position, and attention of new rows
// over them. Rows are `batch` sequences of T new positions, from position `first`; the
// cache holds (batch, block, Hkv d) keys and as many values.
#include "common.cuh"

// Copies each row's key and value heads out of its qkv row into its sequence's slot
// at its position.
extern "C" __global__ void store_keys_values(float* keys, float* values, const float* qkv,
                                             int rows, int T, int first, int C, int kv, int W,
                                             int block) {
    FOR_EACH(i, (long long)rows * kv) {
        const long long r = i / kv;
        const int j = (int)(i % kv);
        const long long slot = ((r / T) * block + first + r % T) * kv + j;
        keys[slot] = qkv[r * W + C + j];
        values[slot] = qkv[r * W + C + kv + j];
    }
}

// One warp per (row, query head): the row's query attends over its sequence's cached
// keys up to its own position (softmax(q k / sqrt(d)) v), into out (rows, H d).
// scores: (rows, H, block) work space.
extern "C" __global__ void attend_cached(float* out, float* scores, const float* qkv,
                                         const float* keys, const float* values, int rows, int T,
                                         int first, int H, int Hkv, int d, int block) {
    const long long warp = blockIdx.x * (long long)(blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (warp >= (long long)rows * H) return;
    const long long r = warp / H;
    const int h = (int)(warp % H);
    const int kv_head = h / (H / Hkv);
    const int kv = Hkv * d;
    const int W = (H + 2 * Hkv) * d;
    const int pos = first + (int)(r % T);  // the row's position: it sees 0 ..= pos
    const float* q = qkv + r * W + h * d;
    const long long base = (r / T) * block * kv + kv_head * d;
    float* s = scores + warp * block;
    const float scale = 1.0f / sqrtf((float)d);
    float m = -INFINITY;
    for (int p = lane; p <= pos; p += WARP_SIZE) {
        const float* k = keys + base + (long long)p * kv;
        float dot = 0.0f;
        for (int c = 0; c < d; c++) dot += q[c] * k[c];
        s[p] = dot * scale;
        m = fmaxf(m, s[p]);
    }
    m = warp_max(m);
    float sum = 0.0f;
    for (int p = lane; p <= pos; p += WARP_SIZE) {
        s[p] = expf(s[p] - m);
        sum += s[p];
    }
    const float inv = 1.0f / warp_sum(sum);
    __syncwarp();
    float* o = out + r * H * d + h * d;
    for (int c = lane; c < d; c += WARP_SIZE) {
        float acc = 0.0f;
        for (int p = 0; p <= pos; p++) acc += s[p] * values[base + (long long)p * kv + c];
        o[c] = acc * inv;
    }
}

// dst[b] = src[b T + T - 1]: each sequence's last row (width C).
extern "C" __global__ void last_rows(float* dst, const float* src, int batch, int T, int C) {
    FOR_EACH(i, (long long)batch * C) {
        const long long b = i / C;
        const int c = (int)(i % C);
        dst[i] = src[(b * T + T - 1) * C + c];
    }
}
