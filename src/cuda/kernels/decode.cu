// What only decoding has: keys and values kept per position, and attention of new rows
// over them. Rows are `batch` sequences of T new positions, from position `first` (or
// the value at first_at: start_of), or rows that each say their sequence and position
// (places: sequence_of, position_of); the cache holds (batch, block, Hkv d) keys and as
// many values.
#include "common.cuh"

// Copies each row's key and value heads out of its qkv row into its sequence's slot
// at its position.
extern "C" __global__ void store_keys_values(float* keys, float* values, const float* qkv,
                                             int rows, int T, int first, const int* first_at,
                                             const int* places, int C, int kv, int W, int block) {
    first = start_of(first, first_at);
    FOR_EACH(i, (long long)rows * kv) {
        const long long r = i / kv;
        const int j = (int)(i % kv);
        const long long slot =
            (sequence_of(r, T, places) * block + position_of(r, T, first, places)) * kv + j;
        keys[slot] = qkv[r * W + C + j];
        values[slot] = qkv[r * W + C + kv + j];
    }
}

// Attention of each new row over its sequence's cache, split over positions as
// flash-decoding does, so that a single row (a batch-1 step) still spreads over many
// blocks: each block takes one (row, query head) and one chunk of CACHED_CHUNK cached
// positions, and leaves that chunk's softmax unnormalised (its max, its sum of
// exponentials, its weighted sum of values); attend_cached_combine rescales the
// chunks to the row's max and divides by the total.
#define CACHED_CHUNK 64

// partial (rows H, splits, d + 2): per chunk, sum_p e^(s_p - m) v_p, then m, then
// sum_p e^(s_p - m), with s_p = q k_p / sqrt(d). Grid (rows H, splits); chunks past the
// row's position are skipped (the combine reads only the chunks it has).
extern "C" __global__ void attend_cached_partial(float* partial, const float* qkv,
                                                 const float* keys, const float* values,
                                                 int rows, int T, int first,
                                                 const int* first_at, const int* places, int H,
                                                 int Hkv, int d, int block, int splits) {
    first = start_of(first, first_at);
    const long long rh = blockIdx.x;  // (row, query head)
    const int split = blockIdx.y;
    const long long r = rh / H;
    const int h = (int)(rh % H);
    const int pos = position_of(r, T, first, places);  // the row sees 0 ..= pos
    const int begin = split * CACHED_CHUNK;
    if (r >= rows || begin > pos) return;  // the same for every thread of the block
    const int end = min(pos + 1, begin + CACHED_CHUNK);
    const int kv = Hkv * d;
    const int W = (H + 2 * Hkv) * d;
    const float* q = qkv + r * W + h * d;
    const long long base = sequence_of(r, T, places) * block * (long long)kv + (h / (H / Hkv)) * d;
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int warps = blockDim.x / WARP_SIZE;
    const float scale = 1.0f / sqrtf((float)d);

    // Scores: a warp a position, its lanes across the head (reads of whole rows).
    __shared__ float w[CACHED_CHUNK];
    for (int p = begin + warp; p < end; p += warps) {
        const float* k = keys + base + (long long)p * kv;
        float dot = 0.0f;
        for (int c = lane; c < d; c += WARP_SIZE) dot += q[c] * k[c];
        dot = warp_sum(dot);
        if (lane == 0) w[p - begin] = dot * scale;
    }
    __syncthreads();
    float m = -INFINITY;
    for (int j = threadIdx.x; j < end - begin; j += blockDim.x) m = fmaxf(m, w[j]);
    m = block_max(m);  // its barriers also order the scores' writes before these reads
    float sum = 0.0f;
    for (int j = threadIdx.x; j < end - begin; j += blockDim.x) {
        w[j] = expf(w[j] - m);
        sum += w[j];
    }
    sum = block_sum(sum);
    float* out = partial + (rh * splits + split) * (long long)(d + 2);
    // A thread a value of the head: reads of whole value rows.
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < end - begin; j++) acc += w[j] * values[base + (long long)(begin + j) * kv + c];
        out[c] = acc;
    }
    if (threadIdx.x == 0) {
        out[d] = m;
        out[d + 1] = sum;
    }
}

// out (rows, H d) = each (row, query head)'s chunks combined: one warp each.
extern "C" __global__ void attend_cached_combine(float* out, const float* partial, int rows,
                                                 int T, int first, const int* first_at,
                                                 const int* places, int H, int d, int splits) {
    first = start_of(first, first_at);
    const long long warp = blockIdx.x * (long long)(blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (warp >= (long long)rows * H) return;
    const int pos = position_of(warp / H, T, first, places);
    const int chunks = pos / CACHED_CHUNK + 1;
    const float* in = partial + warp * splits * (long long)(d + 2);
    float m = -INFINITY;
    for (int s = lane; s < chunks; s += WARP_SIZE) m = fmaxf(m, in[s * (d + 2) + d]);
    m = warp_max(m);
    float total = 0.0f;
    for (int s = lane; s < chunks; s += WARP_SIZE) {
        total += in[s * (d + 2) + d + 1] * expf(in[s * (d + 2) + d] - m);
    }
    const float inv = 1.0f / warp_sum(total);
    float* o = out + warp * d;  // row r, head h: (r H + h) d
    for (int c = lane; c < d; c += WARP_SIZE) {
        float acc = 0.0f;
        for (int s = 0; s < chunks; s++) {
            acc += in[s * (d + 2) + c] * expf(in[s * (d + 2) + d] - m);
        }
        o[c] = acc * inv;
    }
}

// dst[b] = src[b T + T - 1]: each sequence's last row (width C); or, where `picks` is
// given, src[picks[b]]: the rows a server's pass wants logits of.
extern "C" __global__ void last_rows(float* dst, const float* src, int batch, int T, int C,
                                     const int* picks) {
    FOR_EACH(i, (long long)batch * C) {
        const long long b = i / C;
        const int c = (int)(i % C);
        const long long row = picks != nullptr ? picks[b] : b * T + T - 1;
        dst[i] = src[row * C + c];
    }
}
