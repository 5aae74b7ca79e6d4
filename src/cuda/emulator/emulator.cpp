// Runs the engine's CUDA kernels on the CPU (see cuda_shim.h), launched by name with
// cuLaunchKernel's argument convention: args[i] points at parameter i's value.
//
// A fiber starts on its own stack through ucontext, then switches with _setjmp and
// _longjmp: swapcontext saves and restores the signal mask, a system call at each of
// the thousands of barriers a block meets. Fortified builds check that a long jump
// goes up its own stack, which a switch between stacks never does: off here.
#undef _FORTIFY_SOURCE
#include <setjmp.h>
#include <ucontext.h>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

#include "cuda_shim.h"

#include "../kernels/activation.cu"
#include "../kernels/attention.cu"
#include "../kernels/decode.cu"
#include "../kernels/elementwise.cu"
#include "../kernels/embedding.cu"
#include "../kernels/flash.cu"
#include "../kernels/loss.cu"
#include "../kernels/norm.cu"
#include "../kernels/optim.cu"
#include "../kernels/sample.cu"

dim3 threadIdx;
dim3 blockIdx;
dim3 blockDim;
dim3 gridDim;

namespace {

// A kernel behind the launch convention, and whether its threads meet (barriers or
// shuffles: then a block's threads run as fibers).
struct Kernel {
    const char* name;
    std::function<void(void**)> call;
    bool threads_meet;
    std::vector<size_t> parameter_sizes;
};

template <typename... A, size_t... I>
void call_with(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <typename... A>
Kernel entry(const char* name, void (*kernel)(A...), bool threads_meet) {
    return Kernel{name,
                  [kernel](void** args) { call_with(kernel, args, std::index_sequence_for<A...>{}); },
                  threads_meet,
                  {sizeof(A)...}};
}

const std::vector<Kernel>& kernels() {
    static const std::vector<Kernel> table = {
        entry("embedding_forward", embedding_forward, false),
        entry("embedding_backward_tokens", embedding_backward_tokens, false),
        entry("embedding_backward_positions", embedding_backward_positions, false),
        entry("norm_forward", norm_forward, true),
        entry("residual_norm_forward", residual_norm_forward, true),
        entry("norm_backward", norm_backward, true),
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
        entry("add_bias16", add_bias16, false),
        entry("rope", rope, false),
        entry("to_bf16", to_bf16, false),
        entry("split_heads", split_heads, false),
        entry("merge_heads", merge_heads, false),
        entry("split_rows", split_rows, false),
        entry("merge_head_grads", merge_head_grads, false),
        entry("causal_softmax", causal_softmax, true),
        entry("causal_softmax_backward", causal_softmax_backward, true),
        entry("flash_forward", flash_forward, true),
        entry("flash_backward_sums", flash_backward_sums, true),
        entry("flash_backward_kv", flash_backward_kv, true),
        entry("flash_backward_q", flash_backward_q, true),
        entry("softmax_cross_entropy", softmax_cross_entropy, true),
        entry("cross_entropy_backward", cross_entropy_backward, false),
        entry("sum_squares", sum_squares, true),
        entry("sum_all", sum_all, true),
        entry("clip_to_norm", clip_to_norm, false),
        entry("adamw", adamw, false),
        entry("store_keys_values", store_keys_values, false),
        entry("attend_cached_partial", attend_cached_partial, true),
        entry("attend_cached_combine", attend_cached_combine, true),
        entry("last_rows", last_rows, false),
        entry("sample_tokens", sample_tokens, true),
    };
    return table;
}

// One launch at a time: the grid, the block, the fibers and the __shared__ arrays are
// global.
std::mutex launches;

// What a fiber is doing: ready to run, waiting at a barrier of its warp (__syncwarp, a
// shuffle) or of its block (__syncthreads), or done.
enum class State { Ready, AtWarpBarrier, AtBlockBarrier, Done };

// The fibers of the block being run: one per thread, each on its own stack.
constexpr size_t STACK_BYTES = 64 * 1024;
struct Fiber {
    ucontext_t start;  // where it starts: fiber_main on its stack
    jmp_buf resume;    // where it waits: a barrier
    bool started = false;
    std::vector<char> stack = std::vector<char>(STACK_BYTES);
    dim3 index;
    State state = State::Ready;
};
std::vector<Fiber> fibers;
jmp_buf scheduler;
Fiber* running = nullptr;
const Kernel* kernel = nullptr;
void** kernel_args = nullptr;

// Where every fiber starts: the kernel, for its thread.
void fiber_main() {
    kernel->call(kernel_args);
    running->state = State::Done;
    _longjmp(scheduler, 1);
}

// Runs fiber `f` (running) until it meets a barrier or ends.
__attribute__((noinline)) void resume(Fiber& f) {
    if (_setjmp(scheduler) != 0) return;
    if (!f.started) {
        f.started = true;
        setcontext(&f.start);
    }
    _longjmp(f.resume, 1);
}

// This thread waits at a barrier (`at`) until the threads it meets there arrive. Only
// kernels marked as meeting run as fibers (`threads_meet`); any other would have none
// to meet.
void meet(State at) {
    if (running == nullptr) std::abort();
    running->state = at;
    if (_setjmp(running->resume) == 0) _longjmp(scheduler, 1);
}

dim3 thread_index(unsigned t) {
    return dim3{t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
}

// Releases the barriers every thread has reached: a warp's when all its live threads
// wait at a warp barrier, else the block's when all live threads wait at it. False
// when none can be released (a barrier some thread never reaches: a bug in the kernel).
bool release(unsigned n) {
    bool released = false;
    for (unsigned w = 0; w < n; w += 32) {
        bool all = true, any = false;
        for (unsigned t = w; t < n && t < w + 32; t++) {
            const State s = fibers[t].state;
            if (s == State::Done) continue;
            any = true;
            all = all && s == State::AtWarpBarrier;
        }
        if (!any || !all) continue;
        for (unsigned t = w; t < n && t < w + 32; t++) {
            if (fibers[t].state == State::AtWarpBarrier) fibers[t].state = State::Ready;
        }
        released = true;
    }
    if (released) return true;
    bool all = true;
    for (unsigned t = 0; t < n; t++) {
        const State s = fibers[t].state;
        all = all && (s == State::Done || s == State::AtBlockBarrier);
    }
    if (!all) return false;
    for (unsigned t = 0; t < n; t++) {
        if (fibers[t].state == State::AtBlockBarrier) fibers[t].state = State::Ready;
    }
    return true;
}

void run_block(const Kernel& k, void** args, dim3 block) {
    const unsigned n = blockDim.x * blockDim.y * blockDim.z;
    blockIdx = block;
    if (!k.threads_meet) {
        for (unsigned t = 0; t < n; t++) {
            threadIdx = thread_index(t);
            k.call(args);
        }
        return;
    }
    kernel = &k;
    kernel_args = args;
    if (fibers.size() < n) fibers.resize(n);
    for (unsigned t = 0; t < n; t++) {
        Fiber& f = fibers[t];
        f.index = thread_index(t);
        f.state = State::Ready;
        f.started = false;
        getcontext(&f.start);
        f.start.uc_stack.ss_sp = f.stack.data();
        f.start.uc_stack.ss_size = f.stack.size();
        f.start.uc_link = nullptr;
        makecontext(&f.start, fiber_main, 0);
    }
    // Every ready fiber runs to its next barrier (or its end); then the barriers all
    // their threads have reached open, warps' before the block's, as on a GPU.
    for (;;) {
        for (unsigned t = 0; t < n; t++) {
            Fiber& f = fibers[t];
            if (f.state != State::Ready) continue;
            running = &f;
            threadIdx = f.index;
            resume(f);
        }
        bool live = false;
        for (unsigned t = 0; t < n; t++) live = live || fibers[t].state != State::Done;
        if (!live) break;
        if (!release(n)) std::abort();  // a barrier that can never open
    }
    running = nullptr;
}

// Each warp's lanes exchange values through these.
float warp_floats[1024];
double warp_doubles[1024];

template <typename T>
T shuffle_xor(T v, int lane_mask, T* slots) {
    const unsigned t = threadIdx.x;
    const unsigned partner = (t & ~31u) | ((t % 32) ^ (unsigned)lane_mask);
    slots[t] = v;
    meet(State::AtWarpBarrier);
    const T other = slots[partner];
    meet(State::AtWarpBarrier);
    return other;
}

// Each warp's lanes put their mma fragments here.
uint32_t mma_a[1024][4];
uint32_t mma_b[1024][2];

float bf16_value(uint32_t bits) { return __uint_as_float(bits << 16); }

}  // namespace

void emulate_mma_16x8x16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    const unsigned t = threadIdx.x, warp = t & ~31u, lane = t % 32;
    for (int i = 0; i < 4; i++) mma_a[t][i] = a[i];
    for (int i = 0; i < 2; i++) mma_b[t][i] = b[i];
    meet(State::AtWarpBarrier);
    // A (16 x 16) and B (16 x 8) from the lanes that hold them: lane 4 g + q holds
    // A[g][2q, 2q+1], A[g+8][2q, 2q+1], A[g][2q+8, 2q+9], A[g+8][2q+8, 2q+9] and
    // B[2q, 2q+1][g], B[2q+8, 2q+9][g].
    float A[16][16], B[16][8];
    for (unsigned l = 0; l < 32; l++) {
        const unsigned g = l / 4, q = l % 4;
        const uint32_t* ra = mma_a[warp + l];
        const uint32_t* rb = mma_b[warp + l];
        for (unsigned h = 0; h < 2; h++) {
            const unsigned shift = 16 * h;
            A[g][2 * q + h] = bf16_value((ra[0] >> shift) & 0xffffu);
            A[g + 8][2 * q + h] = bf16_value((ra[1] >> shift) & 0xffffu);
            A[g][2 * q + 8 + h] = bf16_value((ra[2] >> shift) & 0xffffu);
            A[g + 8][2 * q + 8 + h] = bf16_value((ra[3] >> shift) & 0xffffu);
            B[2 * q + h][g] = bf16_value((rb[0] >> shift) & 0xffffu);
            B[2 * q + 8 + h][g] = bf16_value((rb[1] >> shift) & 0xffffu);
        }
    }
    const unsigned g = lane / 4, q = lane % 4;
    for (int i = 0; i < 4; i++) {
        const unsigned row = i < 2 ? g : g + 8, col = 2 * q + (i & 1);
        float sum = d[i];
        for (int k = 0; k < 16; k++) sum += A[row][k] * B[k][col];
        d[i] = sum;
    }
    // No lane may overwrite its fragments before every lane has read them.
    meet(State::AtWarpBarrier);
}

void __syncthreads() { meet(State::AtBlockBarrier); }

void __syncwarp(unsigned) { meet(State::AtWarpBarrier); }

float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    return shuffle_xor(v, lane_mask, warp_floats);
}

double __shfl_xor_sync(unsigned, double v, int lane_mask) {
    return shuffle_xor(v, lane_mask, warp_doubles);
}

// Runs kernel `name` over the grid; 0 when done, 1 for an unknown kernel, 2 for a block
// that is not a whole number of warps or over 1024 threads (the kernels assume both),
// 3 for another number of arguments than the kernel's parameters, 100 + i when
// argument i's size is not its parameter's.
extern "C" int tinygpt_emulate_launch(const char* name, const unsigned* grid, const unsigned* block,
                                      void** args, const size_t* sizes, size_t count) {
    std::lock_guard<std::mutex> lock(launches);
    const Kernel* k = nullptr;
    for (const Kernel& candidate : kernels()) {
        if (std::strcmp(candidate.name, name) == 0) k = &candidate;
    }
    if (k == nullptr) return 1;
    if (count != k->parameter_sizes.size()) return 3;
    for (size_t i = 0; i < count; i++) {
        if (sizes[i] != k->parameter_sizes[i]) return 100 + (int)i;
    }
    // One-dimensional blocks of whole warps: the shuffles index lanes by threadIdx.x.
    const unsigned threads = block[0] * block[1] * block[2];
    if (threads % 32 != 0 || threads > 1024 || block[1] != 1 || block[2] != 1) return 2;
    gridDim = dim3{grid[0], grid[1], grid[2]};
    blockDim = dim3{block[0], block[1], block[2]};
    for (unsigned z = 0; z < grid[2]; z++)
        for (unsigned y = 0; y < grid[1]; y++)
            for (unsigned x = 0; x < grid[0]; x++) run_block(*k, args, dim3{x, y, z});
    return 0;
}
