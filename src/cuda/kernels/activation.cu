// The MLP's non-linearity between its two projections, and its backward:
// kind 0 exact GELU, 1 GPT-2's tanh GELU, 2 SwiGLU (rows of fc are gate | up).
#include "common.cuh"

#define GELU 0
#define GELU_TANH 1
#define SWIGLU 2

__device__ inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// out (rows x hidden) from fc (rows x hidden, or rows x 2 hidden for SwiGLU), as f32
// (`out`), rounded to bf16 for the product that reads it (`out16`), or both.
extern "C" __global__ void activation_forward(float* out, uint16_t* out16, const float* fc,
                                              int rows, int hidden, int kind) {
    FOR_EACH(i, (long long)rows * hidden) {
        float y;
        if (kind == SWIGLU) {
            const long long r = i / hidden;
            const int c = (int)(i % hidden);
            const float gate = fc[r * 2 * hidden + c], up = fc[r * 2 * hidden + hidden + c];
            y = gate * sigmoid(gate) * up;
        } else if (kind == GELU_TANH) {
            const float x = fc[i];
            const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
            y = 0.5f * x * (1.0f + tanhf(u));
        } else {
            const float x = fc[i];
            y = 0.5f * x * (1.0f + erff(x * 0.7071067811865476f));
        }
        store(out, out16, i, y);
    }
}

// dfc from dout (rows x hidden), written (not accumulated): as f32 (`dfc`), rounded to
// bf16 for the products that read it (`dfc16`), or both.
extern "C" __global__ void activation_backward(float* dfc, uint16_t* dfc16, const float* fc,
                                               const float* dout, int rows, int hidden,
                                               int kind) {
    FOR_EACH(i, (long long)rows * hidden) {
        const float g = dout[i];
        if (kind == SWIGLU) {
            const long long r = i / hidden;
            const int c = (int)(i % hidden);
            const long long at = r * 2 * hidden + c;
            const float gate = fc[at], up = fc[at + hidden];
            const float sig = sigmoid(gate);
            store(dfc, dfc16, at, g * up * sig * (1.0f + gate * (1.0f - sig)));
            store(dfc, dfc16, at + hidden, g * gate * sig);
        } else if (kind == GELU_TANH) {
            const float x = fc[i];
            const float k = 0.7978845608028654f;
            const float t = tanhf(k * (x + 0.044715f * x * x * x));
            const float slope =
                0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * 0.044715f * x * x);
            store(dfc, dfc16, i, g * slope);
        } else {
            const float x = fc[i];
            const float cdf = 0.5f * (1.0f + erff(x * 0.7071067811865476f));
            const float pdf = 0.3989422804014327f * expf(-0.5f * x * x);
            store(dfc, dfc16, i, g * (cdf + x * pdf));
        }
    }
}
