// The MLP's non-linearity between its two projections, and its backward:
// kind 0 exact GELU, 1 GPT-2's tanh GELU, 2 SwiGLU (rows of fc are gate | up).
#include "common.cuh"

#define GELU 0
#define GELU_TANH 1
#define SWIGLU 2

__device__ inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ inline float gelu(float x, int kind) {
    if (kind == GELU_TANH) {
        const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
        return 0.5f * x * (1.0f + tanhf(u));
    }
    return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f));
}

// d gelu / dx at x.
__device__ inline float gelu_slope(float x, int kind) {
    if (kind == GELU_TANH) {
        const float k = 0.7978845608028654f;
        const float t = tanhf(k * (x + 0.044715f * x * x * x));
        return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * 0.044715f * x * x);
    }
    const float cdf = 0.5f * (1.0f + erff(x * 0.7071067811865476f));
    const float pdf = 0.3989422804014327f * expf(-0.5f * x * x);
    return cdf + x * pdf;
}

// x plus the four bias values of columns 4 i .. 4 i + 3 (mod hidden, a multiple of four):
// read one by one, as a bias sits anywhere in the parameters (no 16-byte alignment).
__device__ inline float4 add_bias4(float4 x, const float* bias, long long i, int hidden) {
    if (bias == nullptr) return x;
    const float* b = bias + (int)((4 * i) % hidden);
    return make_float4(x.x + b[0], x.y + b[1], x.z + b[2], x.w + b[3]);
}

// out (rows x hidden) from fc (rows x hidden, or rows x 2 hidden for SwiGLU) plus the
// layer's bias (`bias`, fc width long; null without one), as f32 (`out`), rounded to
// bf16 for the product that reads it (`out16`), or both. fc is f32 (`fc`, rounded as
// read where `round_fc`) or bf16 (`fc16`): bf16 training keeps the product's output
// rounded, as autocast does, and adds the bias here in f32. GELU's values four an
// access where the buffers allow (`load4`).
extern "C" __global__ void activation_forward(float* out, uint16_t* out16, const float* fc,
                                              const uint16_t* fc16, int round_fc,
                                              const float* bias, int rows, int hidden,
                                              int kind) {
    const long long n = (long long)rows * hidden;
    if (kind != SWIGLU && hidden % 4 == 0 && aligned16(out) && aligned16(out16) &&
        aligned16(fc) && aligned16(fc16)) {
        FOR_EACH(i, n / 4) {
            const float4 x = add_bias4(load4(fc, fc16, round_fc, i), bias, i, hidden);
            const float4 y = make_float4(gelu(x.x, kind), gelu(x.y, kind), gelu(x.z, kind),
                                         gelu(x.w, kind));
            store4(out, out16, i, y);
        }
        return;
    }
    FOR_EACH(i, n) {
        float y;
        if (kind == SWIGLU) {
            const long long r = i / hidden;
            const int c = (int)(i % hidden);
            const long long at = r * 2 * hidden + c;
            float gate = load(fc, fc16, round_fc, at), up = load(fc, fc16, round_fc, at + hidden);
            if (bias != nullptr) gate += bias[c], up += bias[hidden + c];
            y = gate * sigmoid(gate) * up;
        } else {
            const float x = load(fc, fc16, round_fc, i);
            y = gelu(bias != nullptr ? x + bias[i % hidden] : x, kind);
        }
        store(out, out16, i, y);
    }
}

// dfc from dout (rows x hidden), written (not accumulated): as f32 (`dfc`), rounded to
// bf16 for the products that read it (`dfc16`), or both. fc and its bias as in
// `activation_forward`; dout f32 (`dout`, rounded as read where `round_dout`) or bf16
// (`dout16`). GELU's four an access where the buffers allow.
extern "C" __global__ void activation_backward(float* dfc, uint16_t* dfc16, const float* fc,
                                               const uint16_t* fc16, int round_fc,
                                               const float* bias, const float* dout,
                                               const uint16_t* dout16, int round_dout,
                                               int rows, int hidden, int kind) {
    const long long n = (long long)rows * hidden;
    if (kind != SWIGLU && hidden % 4 == 0 && aligned16(dfc) && aligned16(dfc16) &&
        aligned16(fc) && aligned16(fc16) && aligned16(dout) && aligned16(dout16)) {
        FOR_EACH(i, n / 4) {
            const float4 x = add_bias4(load4(fc, fc16, round_fc, i), bias, i, hidden);
            const float4 g = load4(dout, dout16, round_dout, i);
            const float4 d = make_float4(g.x * gelu_slope(x.x, kind), g.y * gelu_slope(x.y, kind),
                                         g.z * gelu_slope(x.z, kind), g.w * gelu_slope(x.w, kind));
            store4(dfc, dfc16, i, d);
        }
        return;
    }
    FOR_EACH(i, n) {
        const float g = load(dout, dout16, round_dout, i);
        if (kind == SWIGLU) {
            const long long r = i / hidden;
            const int c = (int)(i % hidden);
            const long long at = r * 2 * hidden + c;
            float gate = load(fc, fc16, round_fc, at), up = load(fc, fc16, round_fc, at + hidden);
            if (bias != nullptr) gate += bias[c], up += bias[hidden + c];
            const float sig = sigmoid(gate);
            store(dfc, dfc16, at, g * up * sig * (1.0f + gate * (1.0f - sig)));
            store(dfc, dfc16, at + hidden, g * gate * sig);
        } else {
            const float x = load(fc, fc16, round_fc, i);
            store(dfc, dfc16, i, g * gelu_slope(bias != nullptr ? x + bias[i % hidden] : x, kind));
        }
    }
}
