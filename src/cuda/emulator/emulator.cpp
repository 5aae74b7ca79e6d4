// Runs the engine's CUDA kernels on the CPU (see cuda_shim.h), launched by name with
// cuLaunchKernel's argument convention: args[i] points at parameter i's value.
#include <barrier>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "cuda_shim.h"

#include "../kernels/activation.cu"
#include "../kernels/attention.cu"
#include "../kernels/elementwise.cu"
#include "../kernels/embedding.cu"
#include "../kernels/loss.cu"
#include "../kernels/norm.cu"
#include "../kernels/optim.cu"

thread_local dim3 threadIdx;
thread_local dim3 blockIdx;
dim3 blockDim;
dim3 gridDim;

namespace {

// One warp's lanes meet here to exchange values.
struct Warp {
    std::barrier<> meet{32};
    float floats[32];
    double doubles[32];
};

// The block being run by threads: its barrier and its warps.
struct Block {
    explicit Block(unsigned threads) : meet(threads) {
        for (unsigned w = 0; w < threads / 32; w++) warps.push_back(std::make_unique<Warp>());
    }
    std::barrier<> meet;
    std::vector<std::unique_ptr<Warp>> warps;
};

Block* current_block = nullptr;

Warp& my_warp() { return *current_block->warps[threadIdx.x / 32]; }

template <typename T>
T shuffle_xor(T v, int lane_mask, T* slots) {
    Warp& w = my_warp();
    const unsigned lane = threadIdx.x % 32;
    slots[lane] = v;
    w.meet.arrive_and_wait();
    const T other = slots[lane ^ (unsigned)lane_mask];
    w.meet.arrive_and_wait();
    return other;
}

// A kernel behind the launch convention, and whether its threads meet (barriers or
// shuffles: then each block's threads run concurrently).
struct Kernel {
    const char* name;
    std::function<void(void**)> call;
    bool threads_meet;
};

template <typename... A, size_t... I>
void call_with(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <typename... A>
Kernel entry(const char* name, void (*kernel)(A...), bool threads_meet) {
    return Kernel{name,
                  [kernel](void** args) { call_with(kernel, args, std::index_sequence_for<A...>{}); },
                  threads_meet};
}

const std::vector<Kernel>& kernels() {
    static const std::vector<Kernel> table = {
        entry("embedding_forward", embedding_forward, false),
        entry("embedding_backward_tokens", embedding_backward_tokens, false),
        entry("embedding_backward_positions", embedding_backward_positions, false),
        entry("norm_forward", norm_forward, true),
        entry("norm_apply", norm_apply, false),
        entry("norm_backward_input", norm_backward_input, true),
        entry("norm_backward_params", norm_backward_params, false),
        entry("column_partials", column_partials, false),
        entry("add_column_sums", add_column_sums, false),
        entry("activation_forward", activation_forward, false),
        entry("activation_backward", activation_backward, false),
        entry("residual_forward", residual_forward, false),
        entry("dropout_apply", dropout_apply, false),
        entry("add_bias", add_bias, false),
        entry("scale_in_place", scale_in_place, false),
        entry("rope", rope, false),
        entry("split_heads", split_heads, false),
        entry("merge_heads", merge_heads, false),
        entry("split_rows", split_rows, false),
        entry("merge_head_grads", merge_head_grads, false),
        entry("causal_softmax", causal_softmax, true),
        entry("causal_softmax_backward", causal_softmax_backward, true),
        entry("softmax_cross_entropy", softmax_cross_entropy, true),
        entry("cross_entropy_backward", cross_entropy_backward, false),
        entry("sum_squares", sum_squares, true),
        entry("sum_all", sum_all, true),
        entry("adamw", adamw, false),
    };
    return table;
}

// One launch at a time: the grid, the block and the __shared__ arrays are global.
std::mutex launches;

void run_block(const Kernel& k, void** args, dim3 block) {
    const unsigned n = blockDim.x * blockDim.y * blockDim.z;
    auto thread_at = [&](unsigned t) {
        threadIdx = dim3{t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
        blockIdx = block;
    };
    if (!k.threads_meet) {
        for (unsigned t = 0; t < n; t++) {
            thread_at(t);
            k.call(args);
        }
        return;
    }
    Block sync(n);
    current_block = &sync;
    std::vector<std::thread> threads;
    threads.reserve(n);
    for (unsigned t = 0; t < n; t++) {
        threads.emplace_back([&, t] {
            thread_at(t);
            k.call(args);
            // A thread that has returned no longer holds the others up.
            sync.meet.arrive_and_drop();
            sync.warps[t / 32]->meet.arrive_and_drop();
        });
    }
    for (auto& th : threads) th.join();
    current_block = nullptr;
}

}  // namespace

void __syncthreads() { current_block->meet.arrive_and_wait(); }

float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    return shuffle_xor(v, lane_mask, my_warp().floats);
}

double __shfl_xor_sync(unsigned, double v, int lane_mask) {
    return shuffle_xor(v, lane_mask, my_warp().doubles);
}

// Runs kernel `name` over the grid; 0 when done, 1 for an unknown kernel, 2 for a block
// whose size is not a whole number of warps (the kernels assume whole warps).
extern "C" int tinygpt_emulate_launch(const char* name, const unsigned* grid, const unsigned* block,
                                      void** args) {
    std::lock_guard<std::mutex> lock(launches);
    const Kernel* k = nullptr;
    for (const Kernel& candidate : kernels()) {
        if (std::strcmp(candidate.name, name) == 0) k = &candidate;
    }
    if (k == nullptr) return 1;
    gridDim = dim3{grid[0], grid[1], grid[2]};
    blockDim = dim3{block[0], block[1], block[2]};
    if ((block[0] * block[1] * block[2]) % 32 != 0) return 2;
    for (unsigned z = 0; z < grid[2]; z++)
        for (unsigned y = 0; y < grid[1]; y++)
            for (unsigned x = 0; x < grid[0]; x++) run_block(*k, args, dim3{x, y, z});
    return 0;
}
