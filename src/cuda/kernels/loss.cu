// The classifier's softmax and cross-entropy, fused: one block per row of logits.
#include "common.cuh"

// row_loss[r] = -log p[target] of each row of logits (rows x V), and the rows' softmax:
// in place on the logits; or, where `grad16` is given, the gradient of each row's loss
// at its logits, p - onehot(target) unscaled, rounded to bf16 into grad16 (what the
// output layer's bf16 products read: the backward then has nothing left to do here),
// the same numbers as rounding the in-place softmax after `cross_entropy_backward`.
// Two passes over the row: the max and the sum of exponentials together (online: the
// sum is rescaled whenever the max grows), then the probabilities.
// Up to 1024 threads a block (a power of two, from the vocabulary): bounded, as sum_all.
extern "C" __global__ void __launch_bounds__(1024)
    softmax_cross_entropy(float* logits, uint16_t* grad16, float* row_loss,
                          const uint32_t* targets, int rows, int V) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    float* x = logits + (long long)r * V;
    float m = -INFINITY, sum = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        if (x[j] > m) {
            sum = sum * expf(m - x[j]) + 1.0f;
            m = x[j];
        } else {
            sum += expf(x[j] - m);
        }
    }
    const float row_max = block_max(m);
    sum = block_sum(sum * expf(m - row_max));  // a thread with no elements adds 0
    const float target_logit = x[targets[r]];
    __syncthreads();  // every thread has read the target's logit before any write
    if (threadIdx.x == 0) row_loss[r] = logf(sum) - (target_logit - row_max);
    const float inv = 1.0f / sum;
    if (grad16 == nullptr) {
        for (int j = threadIdx.x; j < V; j += blockDim.x) x[j] = expf(x[j] - row_max) * inv;
        return;
    }
    const uint32_t target = targets[r];
    uint16_t* g = grad16 + (long long)r * V;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        // Rounded to f32 before the one is taken away, as when p is stored first.
        const float p = __fmul_rn(expf(x[j] - row_max), inv);
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
