// The input embedding: token vectors plus position vectors (learned or sinusoidal),
// with dropout; and its backward, deterministic: no atomics.
#include "common.cuh"

// x[r] = (wte[ids[r]] + positions[first + r % T]) * mask: rows are sequences of T
// positions from position `first` (0 in training; the cached length in decoding; read
// from first_at when given: start_of; or each row's own: position_of). positions may be
// null (RoPE). One warp per row: the row's token and position are looked up once.
extern "C" __global__ void embedding_forward(float* x, const uint32_t* ids, const float* wte,
                                             const float* positions, int rows, int T, int first,
                                             const int* first_at, const int* places, int C,
                                             Dropout dropout) {
    dropout = pass_read(dropout);
    const int r = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (r >= rows) return;
    first = start_of(first, first_at);
    const long long at = (long long)r * C;
    const float* token = wte + (long long)ids[r] * C;
    const float* position =
        positions != nullptr ? positions + (long long)position_of(r, T, first, places) * C : nullptr;
    for (int c = lane; c < C; c += WARP_SIZE) {
        float v = token[c];
        if (position != nullptr) v += position[c];
        x[at + c] = v * dropout_scale(dropout, at + c);
    }
}

// dwte[id] += the sum of dx (times the mask) over the rows holding token id. The rows
// come sorted by token on the host: `order` lists rows, token `tokens[u]`'s rows are
// order[starts[u] .. starts[u + 1]], and `starts` has an entry per row and one more, the
// ranges past the distinct tokens empty. One block row per row of the batch (as many as
// there can be distinct tokens, so every batch launches alike), those of empty ranges
// idle; one thread per channel, rows summed in order. Grid: (rows, channel blocks).
extern "C" __global__ void embedding_backward_tokens(float* dwte, const float* dx,
                                                     const uint32_t* tokens,
                                                     const uint32_t* starts,
                                                     const uint32_t* order, int C,
                                                     Dropout dropout) {
    dropout = pass_read(dropout);
    const int u = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C || starts[u] == starts[u + 1]) return;
    float sum = 0.0f;
    for (uint32_t k = starts[u]; k < starts[u + 1]; k++) {
        const long long i = (long long)order[k] * C + c;
        sum += dx[i] * dropout_scale(dropout, i);
    }
    dwte[(long long)tokens[u] * C + c] += sum;
}

// dwpe[t] += the sum over sequences of dx at position t (times the mask).
extern "C" __global__ void embedding_backward_positions(float* dwpe, const float* dx, int B,
                                                        int T, int C, Dropout dropout) {
    dropout = pass_read(dropout);
    FOR_EACH(i, (long long)T * C) {
        const long long t = i / C;
        const int c = (int)(i % C);
        float sum = 0.0f;
        for (int b = 0; b < B; b++) {
            const long long at = ((long long)b * T + t) * C + c;
            sum += dx[at] * dropout_scale(dropout, at);
        }
        dwpe[i] += sum;
    }
}
