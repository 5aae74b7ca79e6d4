// Choosing each sequence's next token where its logits are, so that one id a sequence
// crosses to the host instead of a row of V logits: src/generate/sample.rs's sampler,
// step for step, one block per sequence. In order: the vocabulary's padding masked,
// the repetition penalty, then the argmax (greedy), or weights e^((l - max) / T) and
// one draw with the host's uniform `u`: in id order when every token is a candidate,
// else over the most likely tokens (top-k, top-p) sorted as the host sorts them.
//
// The host draws `u` from the sequence's own seeded generator, so a seed gives the
// same draws on every device. The sums here are added in another order than the
// host's and expf is not the host's exp_approx (both ~1e-7), so a draw within rounding
// of a boundary between two tokens may fall on the other one, and two kept candidates
// whose weights are within rounding of each other may be ordered the other way (tested:
// no draw moved over 520 draws of 13 settings, and boundaries decided as the host's).
#include "common.cuh"

#define SAMPLE_THREADS 1024

// How to choose (`SamplingArgs` in src/cuda/kernels.rs, field for field).
struct Sampling {
    double top_p;           // keep the smallest set reaching this probability; 1: all
    float inv_temperature;  // 1 / T
    float penalty;          // repetition penalty; 1: none
    int top_k;              // keep the k most likely; 0: all
    int greedy;             // 1: the argmax, no draw
};

// Inclusive prefix sums at the end of each thread's share (see scan_shares).
__shared__ double share_ends[SAMPLE_THREADS];

// The range [begin, end) of n values that this thread's share is: contiguous shares,
// in thread order, so that walking one share continues the scan's order.
__device__ inline void share_of(int n, int* begin, int* end) {
    const int per = (n + (int)blockDim.x - 1) / (int)blockDim.x;
    *begin = min(n, (int)threadIdx.x * per);
    *end = min(n, *begin + per);
}

// Scans the non-negative `values` (a functor of the index) over the block: each thread
// sums its share in f64, the shares' sums are scanned into share_ends. Returns the
// total to every thread.
template <typename Values>
__device__ double scan_shares(const Values& values, int n) {
    int begin, end;
    share_of(n, &begin, &end);
    double mine = 0.0;
    for (int j = begin; j < end; j++) mine += values(j);
    __syncthreads();  // an earlier scan may still be reading share_ends
    share_ends[threadIdx.x] = mine;
    __syncthreads();
    for (int offset = 1; offset < (int)blockDim.x; offset <<= 1) {
        const double add = (int)threadIdx.x >= offset ? share_ends[threadIdx.x - offset] : 0.0;
        __syncthreads();
        share_ends[threadIdx.x] += add;
        __syncthreads();
    }
    return share_ends[blockDim.x - 1];
}

__device__ inline bool passes(double sum, double target, bool reach) {
    return reach ? sum >= target : sum > target;
}

// After scan_shares over the same values: the first j whose inclusive prefix sum passes
// `target` (reaches it when `reach`, else exceeds it), or -1. Only a value above zero
// is ever returned. The thread whose share the target falls in walks it.
template <typename Values>
__device__ int first_past(const Values& values, int n, double target, bool reach) {
    __shared__ int found;
    if (threadIdx.x == 0) found = 0x7fffffff;
    __syncthreads();
    int begin, end;
    share_of(n, &begin, &end);
    const double before = threadIdx.x == 0 ? 0.0 : share_ends[threadIdx.x - 1];
    if (passes(share_ends[threadIdx.x], target, reach) && !passes(before, target, reach)) {
        double sum = before;
        int pick = -1;
        for (int j = begin; j < end; j++) {
            const float v = values(j);
            if (v <= 0.0f) continue;
            pick = j;  // the last positive so far: where rounding ends the walk short
            sum += v;
            if (passes(sum, target, reach)) break;
        }
        // Rounding can let two shares claim the target: the first wins.
        if (pick >= 0) atomicMin(&found, pick);
    }
    __syncthreads();
    const int result = found;
    __syncthreads();  // every thread has read `found` before a next call resets it
    return result == 0x7fffffff ? -1 : result;
}

// The last index whose value is above zero (-1 if none).
template <typename Values>
__device__ int last_positive(const Values& values, int n) {
    __shared__ int last;
    if (threadIdx.x == 0) last = -1;
    __syncthreads();
    int mine = -1;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        if (values(j) > 0.0f) mine = j;
    }
    if (mine >= 0) atomicMax(&last, mine);
    __syncthreads();
    const int result = last;
    __syncthreads();
    return result;
}

// A row of weights, by token id.
struct ById {
    const float* w;
    __device__ float operator()(int i) const { return w[i]; }
};

// Candidates as keys that order them the host's way, most likely first: the weight's
// bits above (weights are >= 0, so their bits order as they do), the id's complement
// below (the smaller id first among equal weights). Every key is distinct.
__device__ inline unsigned long long key_of(float w, int id) {
    return ((unsigned long long)__float_as_uint(w) << 32) | (0xffffffffu - (unsigned)id);
}
__device__ inline float weight_of(unsigned long long key) {
    return __uint_as_float((unsigned)(key >> 32));
}
__device__ inline unsigned id_of(unsigned long long key) {
    return 0xffffffffu - (unsigned)(key & 0xffffffffu);
}

// Sorted keys, by rank.
struct ByRank {
    const unsigned long long* keys;
    __device__ float operator()(int j) const { return weight_of(keys[j]); }
};

// The m-th largest key (m >= 1) of the row's n tokens: a radix select, 8 bits a pass
// from the top, counting the keys that still match the digits chosen so far.
__device__ unsigned long long mth_largest_key(const float* w, int n, int m) {
    __shared__ unsigned counts[256];
    __shared__ unsigned long long chosen;
    __shared__ unsigned rank_left;
    unsigned long long prefix = 0, mask = 0;
    unsigned rank = (unsigned)m;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += blockDim.x) counts[d] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const unsigned long long k = key_of(w[i], i);
            if ((k & mask) == prefix) atomicAdd(&counts[(k >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int d = 255;
            while (d > 0 && counts[d] < rank) rank -= counts[d--];
            chosen = prefix | ((unsigned long long)d << shift);
            rank_left = rank;
        }
        __syncthreads();
        prefix = chosen;
        rank = rank_left;
        mask |= 255ull << shift;
        __syncthreads();  // every thread has read `chosen` before the next pass
    }
    return prefix;
}

// The m most likely tokens' keys into keys[0, m), most likely first: gathered above
// the m-th largest key, then a bitonic sort over the next power of two (padded with
// key 0, which sorts last).
__device__ void sort_most_likely(unsigned long long* keys, const float* w, int n, int m) {
    __shared__ unsigned gathered;
    const unsigned long long least = mth_largest_key(w, n, m);
    if (threadIdx.x == 0) gathered = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const unsigned long long k = key_of(w[i], i);
        if (k >= least) keys[atomicAdd(&gathered, 1u)] = k;
    }
    int size = 1;
    while (size < m) size <<= 1;
    for (int j = m + threadIdx.x; j < size; j += blockDim.x) keys[j] = 0;
    __syncthreads();
    for (int span = 2; span <= size; span <<= 1) {
        for (int stride = span / 2; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < size; i += blockDim.x) {
                const int partner = i ^ stride;
                if (partner <= i) continue;
                const unsigned long long a = keys[i], b = keys[partner];
                const bool descending = (i & span) == 0;
                if (descending ? a < b : a > b) {
                    keys[i] = b;
                    keys[partner] = a;
                }
            }
            __syncthreads();
        }
    }
}

// The index of the largest value, the first if tied, as the host's argmax: a NaN
// never wins, except at index 0, which the host starts from and nothing beats then.
__device__ int argmax(const float* x, int n) {
    __shared__ float best_value[SAMPLE_THREADS];
    __shared__ int best_index[SAMPLE_THREADS];
    float value = -INFINITY;
    int index = n;  // none yet: any real index is smaller
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = isnan(x[i]) ? -INFINITY : x[i];
        if (v > value || (index == n && v == value)) {
            value = v;
            index = i;
        }
    }
    best_value[threadIdx.x] = value;
    best_index[threadIdx.x] = index;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half >>= 1) {
        if ((int)threadIdx.x < half) {
            const float v = best_value[threadIdx.x + half];
            const int i = best_index[threadIdx.x + half];
            if (v > best_value[threadIdx.x] ||
                (v == best_value[threadIdx.x] && i < best_index[threadIdx.x])) {
                best_value[threadIdx.x] = v;
                best_index[threadIdx.x] = i;
            }
        }
        __syncthreads();
    }
    return best_index[0] < n && !isnan(x[0]) ? best_index[0] : 0;
}

// chosen[b] = sequence b's next token from its logits (batch, V) and its uniform draw
// uniforms[b]. The repetition penalty looks at context (batch, stride) [0, context_len).
// Ids from text_vocab on are padding no text maps to: never chosen.
// Work space: weights (batch, V); keys (batch, V rounded up to a power of two);
// seen (batch, V), all zero, left zero. One block of SAMPLE_THREADS per sequence.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_tokens(unsigned* chosen, float* weights,
                                         unsigned long long* keys, unsigned* seen,
                                         const float* logits, const unsigned* context,
                                         int context_len, int stride, const double* uniforms,
                                         int V, int text_vocab, Sampling s) {
    const int b = blockIdx.x;
    float* w = weights + (long long)b * V;
    const float* l = logits + (long long)b * V;
    for (int i = threadIdx.x; i < V; i += blockDim.x) w[i] = i < text_vocab ? l[i] : -INFINITY;
    __syncthreads();

    // Each distinct token of the context once: the first thread to mark it.
    if (s.penalty != 1.0f) {
        unsigned* marks = seen + (long long)b * V;
        const unsigned* ids = context + (long long)b * stride;
        for (int p = threadIdx.x; p < context_len; p += blockDim.x) {
            const unsigned id = ids[p];
            if (id < (unsigned)V && atomicExch(&marks[id], 1u) == 0u) {
                w[id] = w[id] > 0.0f ? w[id] / s.penalty : w[id] * s.penalty;
            }
        }
        __syncthreads();
        for (int p = threadIdx.x; p < context_len; p += blockDim.x) {
            if (ids[p] < (unsigned)V) marks[ids[p]] = 0u;
        }
    }
    __syncthreads();

    if (s.greedy) {
        const int best = argmax(w, V);
        if (threadIdx.x == 0) chosen[b] = (unsigned)best;
        return;
    }
    float m = -INFINITY;
    for (int i = threadIdx.x; i < V; i += blockDim.x) m = fmaxf(m, w[i]);
    m = block_max(m);
    // As the host's exp_approx: exactly 0 for a masked token, at least e^-87 for any
    // other (so rounding's fallbacks pick among the same tokens).
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float x = (w[i] - m) * s.inv_temperature;
        w[i] = w[i] == -INFINITY ? 0.0f : expf(x < -87.0f ? -87.0f : x);
    }
    __syncthreads();
    const double u = uniforms[b];
    const ById by_id{w};
    const int limit = s.top_k == 0 ? V : min(s.top_k, V);

    if (limit == V && s.top_p >= 1.0) {
        // Every token a candidate: where u falls among the weights laid end to end.
        const double total = scan_shares(by_id, V);
        int pick = first_past(by_id, V, u * total, false);
        if (pick < 0) pick = last_positive(by_id, V);
        if (pick < 0) pick = 0;  // no weight is a number above zero (NaN logits): as the host
        if (threadIdx.x == 0) chosen[b] = (unsigned)pick;
        return;
    }

    // The most likely prefix, grown by fours from 64 until it holds the nucleus.
    const double sum = s.top_p < 1.0 ? scan_shares(by_id, V) : 0.0;
    int padded = 1;  // V rounded up to a power of two
    while (padded < V) padded <<= 1;
    unsigned long long* row_keys = keys + (long long)b * padded;
    const ByRank by_rank{row_keys};
    int sorted = s.top_p < 1.0 ? min(limit, 64) : limit;
    int keep;
    for (;;) {
        sort_most_likely(row_keys, w, V, sorted);
        if (s.top_p >= 1.0) {
            keep = sorted;
            break;
        }
        scan_shares(by_rank, sorted);
        const int last = first_past(by_rank, sorted, s.top_p * sum, true);
        if (last >= 0) {
            keep = last + 1;
            break;
        }
        if (sorted == limit) {
            keep = limit;
            break;
        }
        sorted = min(4 * sorted, limit);
    }
    const double kept = scan_shares(by_rank, keep);
    int pick = first_past(by_rank, keep, u * kept, false);
    if (pick < 0) pick = last_positive(by_rank, keep);
    if (pick < 0) pick = 0;  // no candidate has weight: the most likely
    if (threadIdx.x == 0) chosen[b] = id_of(row_keys[pick]);
}
