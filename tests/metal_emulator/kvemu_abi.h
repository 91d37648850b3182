// What compiled kernels and the emulator's scheduler (kvemu_runtime.cpp) share.
#pragma once

#include <cstddef>
#include <cstdint>

#include "metal_compat.h"

namespace kvemu {

constexpr int kSimdWidth = 32;
constexpr int kMaxThreads = 1024;
constexpr size_t kSlotBytes = 64;  // largest value a collective carries
constexpr size_t kThreadgroupBytes = 32768;  // Apple GPUs' threadgroup memory

enum class State { Runnable, AtBarrier, AtSimd, Done };

// Every thread-position attribute MLX may put in a signature, for one thread.
struct Ids {
  metal::uint3 thread_position_in_grid, thread_position_in_threadgroup, threads_per_threadgroup,
      threadgroup_position_in_grid, threadgroups_per_grid, threads_per_grid, grid_size,
      dispatch_threads_per_threadgroup, grid_origin;
  uint thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup,
      simdgroups_per_threadgroup, threads_per_simdgroup, thread_execution_width,
      thread_index_in_quadgroup, quadgroup_index_in_threadgroup, quadgroups_per_threadgroup,
      dispatch_simdgroups_per_threadgroup, dispatch_quadgroups_per_threadgroup;
};

struct Lane;
// Completes one SIMD collective for the lanes of a simdgroup (knows the value type).
using Resolver = void (*)(Lane* lanes, int nlanes);

struct Lane {
  State state;
  Resolver resolver;  // the collective this lane waits at (type and operation)
  uint32_t arg;       // its lane / delta / mask argument
  alignas(16) unsigned char in[kSlotBytes];
  alignas(16) unsigned char out[kSlotBytes];
  Ids ids;
};

struct Kernel {
  void (*run)(void* ctx, const Ids& ids);
  void* ctx;
};

#define KVEMU_API __attribute__((visibility("default")))
extern "C" {
KVEMU_API Lane* kvemu_current_lane();
// The threadgroup memory arena (kThreadgroupBytes), 0xFF bytes at each threadgroup start.
KVEMU_API char* kvemu_threadgroup_memory();
// Park the current thread in state `s`; returns its lane when the scheduler resumes it.
KVEMU_API Lane* kvemu_suspend(State s);
[[noreturn]] KVEMU_API void kvemu_fail(const char* msg);
// order: 0 sequential, 1 reversed, 2 shuffled with `seed`. Returns 0, or 1 and `err`.
KVEMU_API int kvemu_run_grid(Kernel k, const unsigned grid[3], const unsigned tg[3], int order,
                             unsigned long long seed, int cooperative, char* err, int errlen);
}

}  // namespace kvemu
