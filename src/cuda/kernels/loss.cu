// The classifier's softmax and cross-entropy, fused: one block per row of logits.
#include "common.cuh"

// row_loss[r] = -log p[target] of each row of logits (rows x V), and the rows' softmax:
// in place on the logits; or, where `grad16` is given, the gradient of each row's loss
// at its logits, p - onehot(target) unscaled, rounded to bf16 into grad16 (what the
// output layer's bf16 products read: the backward then has nothing left to do here),
// the same numbers as rounding the in-place softmax after `cross_entropy_backward`.
// The logits are f32 (`logits`), or bf16 (`logits16`, which grad16 may overwrite in
// place: each value is read by the thread that writes it, the target's before a
// barrier). With `round`, f32 logits are rounded to bf16 as they are read: bf16
// training's loss is the loss of bf16 logits (as autocast's is), whichever buffer its
// output layer wrote.
// Two passes over the row: the max and the sum of exponentials together (online: the
// sum is rescaled whenever the max grows), then the probabilities.
// Up to 1024 threads a block (a power of two, from the vocabulary): bounded, as sum_all.
extern "C" __global__ void __launch_bounds__(1024)
    softmax_cross_entropy(float* logits, const uint16_t* logits16, uint16_t* grad16,
                          float* row_loss, const uint32_t* targets, int rows, int V,
                          int round) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const long long at = (long long)r * V;
    float* x = logits16 == nullptr ? logits + at : nullptr;
    auto logit = [&](int j) {
        if (logits16 != nullptr) return __uint_as_float((uint32_t)logits16[at + j] << 16);
        return round ? __uint_as_float((uint32_t)bf16_bits(x[j]) << 16) : x[j];
    };
    float m = -INFINITY, sum = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float v = logit(j);
        if (v > m) {
            sum = sum * expf(m - v) + 1.0f;
            m = v;
        } else {
            sum += expf(v - m);
        }
    }
    const float row_max = block_max(m);
    sum = block_sum(sum * expf(m - row_max));  // a thread with no elements adds 0
    const float target_logit = logit((int)targets[r]);
    __syncthreads();  // every thread has read the target's logit before any write
    if (threadIdx.x == 0) row_loss[r] = logf(sum) - (target_logit - row_max);
    const float inv = 1.0f / sum;
    if (grad16 == nullptr) {
        for (int j = threadIdx.x; j < V; j += blockDim.x) x[j] = expf(logit(j) - row_max) * inv;
        return;
    }
    const uint32_t target = targets[r];
    uint16_t* g = grad16 + at;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        // Rounded to f32 before the one is taken away, as when p is stored first.
        const float p = __fmul_rn(expf(logit(j) - row_max), inv);
        g[j] = bf16_bits((uint32_t)j == target ? p - 1.0f : p);
    }
}

// In place on probabilities: p - onehot(target), the gradient of each row's loss at
// its logits, unscaled: the scale (1 / rows, times the backward's) goes into the two
// products that read it, so this touches one value a row instead of rows x V.
extern "C" __global__ void cross_entropy_backward(float* probs, const uint32_t* targets,
                                                  int rows, int V) {
    FOR_EACH(r, rows) { probs[r * V + targets[r]] -= 1.0f; }
}
