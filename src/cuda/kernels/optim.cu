// The optimiser over the flat buffers: the global gradient norm (deterministic, in
// f64) and AdamW in one launch.
#include "common.cuh"

// partials[block] = the sum of x^2 over the block's grid-stride share, in f64.
extern "C" __global__ void sum_squares(double* partials, const float* x, long long n) {
    double sum = 0.0;
    FOR_EACH(i, n) { sum += (double)x[i] * (double)x[i]; }
    sum = block_sum_f64(sum);
    if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

// out[0] = the sum of n f64 values (one block), f32 values when `x32` is set; added to
// what out[0] holds when `accumulate` is set (the loss of several forwards, summed on
// the device until the host reads it). Launched with 1024 threads: the bound tells
// nvcc, so it never spends more registers a thread than 1024 threads can have (without
// it the launch may fail with "too many resources requested").
extern "C" __global__ void __launch_bounds__(1024)
    sum_all(double* out, const double* x, const float* x32, int n, int accumulate) {
    double sum = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sum += x32 != nullptr ? (double)x32[i] : x[i];
    sum = block_sum_f64(sum);
    if (threadIdx.x == 0) out[0] = accumulate ? out[0] + sum : sum;
}

// Gradient clipping decided on the device, so the host never waits for the norm:
// x *= max_norm / (norm + 1e-6) when the norm (sqrt of *norm_sq, from sum_squares) is
// above max_norm, as optim::clip_scale (a NaN norm clips nothing; the host sees it when
// it reads the norm).
extern "C" __global__ void clip_to_norm(float* x, long long n, const double* norm_sq,
                                        double max_norm) {
    const double norm = sqrt(*norm_sq);
    if (!(norm > max_norm)) return;
    const float s = (float)(max_norm / (norm + 1e-6));
    FOR_EACH(i, n) { x[i] *= s; }
}

// AdamW over the parameters: m, v <- moving averages of g, g^2;
// p <- p * shrink - lr * m_hat / (sqrt(v_hat) + eps), where shrink applies only to the
// tensors that decay; and, where `copy16` is given, p rounded to bf16 there too (the
// copy bf16 products read). A block per chunk of one tensor (`adamw_chunks` in
// src/cuda/kernels.rs): chunks[2 b] is block b's first value, chunks[2 b + 1] its
// length with bit 32 set where its tensor decays, so no value looks its tensor up.
extern "C" __global__ void adamw(float* params, uint16_t* copy16, const float* grads, float* m,
                                 float* v, const unsigned long long* chunks, float b1, float b2,
                                 float inv_bc1, float inv_bc2, float lr, float eps,
                                 float shrink) {
    const unsigned long long first = chunks[2 * blockIdx.x];
    const unsigned long long info = chunks[2 * blockIdx.x + 1];
    const int len = (int)(info & 0xffffffffu);
    const float s = (info >> 32) != 0 ? shrink : 1.0f;
    for (int e = threadIdx.x; e < len; e += blockDim.x) {
        const unsigned long long i = first + e;
        const float g = grads[i];
        const float mi = b1 * m[i] + (1.0f - b1) * g;
        const float vi = b2 * v[i] + (1.0f - b2) * g * g;
        m[i] = mi;
        v[i] = vi;
        const float p = params[i] * s - lr * (mi * inv_bc1) / (sqrtf(vi * inv_bc2) + eps);
        params[i] = p;
        if (copy16 != nullptr) copy16[i] = bf16_bits(p);
    }
}
