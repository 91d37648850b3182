// The emulator's scheduler: threadgroups one at a time, GPU threads as fibers.
//
// Each GPU thread of a threadgroup is a fiber (ucontext to start, _setjmp/_longjmp to
// switch, so no signal-mask syscall per switch). A fiber runs until it reaches a
// threadgroup barrier or a SIMD-group collective, or returns; then the next one runs.
// A collective completes once every live lane of its 32-lane simdgroup waits at one; a
// barrier once every live thread of the threadgroup waits at one. Threadgroup memory
// starts as 0xFF bytes (NaN for float types) in every threadgroup, so a thread that
// reads what no thread wrote yet gets a wrong answer. Built once, shared by all kernels.
#include <algorithm>
#include <csetjmp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sys/mman.h>
#include <ucontext.h>
#include <vector>

#include "kvemu_abi.h"

namespace kvemu {
namespace {

constexpr size_t kStackBytes = 64 * 1024;
constexpr size_t kGuardBytes = 4096;  // a no-access page below each stack: overflow faults

struct Fiber {
  jmp_buf jb;
  ucontext_t uc;
  char* stack;
  bool started;
};

struct Runtime {
  std::vector<Lane> lanes = std::vector<Lane>(kMaxThreads);
  std::vector<Fiber> fibers = std::vector<Fiber>(kMaxThreads);
  char* stacks = nullptr;
  int current = -1;
  bool cooperative = true;
  jmp_buf sched;
  Kernel kernel{};
  char err[512] = {0};
  bool failed = false;
  alignas(64) char tg_memory[kThreadgroupBytes];
};
Runtime RT;

void fiber_main() {
  RT.kernel.run(RT.kernel.ctx, RT.lanes[RT.current].ids);
  RT.lanes[RT.current].state = State::Done;
  _longjmp(RT.sched, 1);
}

}  // namespace

extern "C" char* kvemu_threadgroup_memory() { return RT.tg_memory; }

extern "C" Lane* kvemu_current_lane() {
  if (RT.current < 0) kvemu_fail("SIMD collective or barrier outside a kernel");
  return &RT.lanes[RT.current];
}

extern "C" void kvemu_fail(const char* msg) {
  std::snprintf(RT.err, sizeof(RT.err), "%s", msg);
  RT.failed = true;
  if (RT.current >= 0) {  // back to the scheduler, which reports the error
    RT.lanes[RT.current].state = State::Done;
    _longjmp(RT.sched, 1);
  }
  std::fprintf(stderr, "kvemu: %s\n", msg);
  std::abort();
}

extern "C" Lane* kvemu_suspend(State s) {
  if (!RT.cooperative) kvemu_fail("kernel reached a barrier or SIMD collective in a non-cooperative launch");
  int me = RT.current;
  RT.lanes[me].state = s;
  if (!_setjmp(RT.fibers[me].jb)) _longjmp(RT.sched, 1);
  return &RT.lanes[me];
}


// order: 0 sequential (thread index order), 1 reversed, 2 shuffled (seeded, reshuffled
// every round; threadgroups also visited in shuffled order).
extern "C" int kvemu_run_grid(Kernel k, const unsigned grid[3], const unsigned tg_in[3], int order,
                              unsigned long long seed, int cooperative, char* err, int errlen) {
  RT.kernel = k;
  RT.failed = false;
  RT.err[0] = 0;
  RT.cooperative = cooperative != 0;
  unsigned tg[3];
  for (int d = 0; d < 3; ++d) tg[d] = std::min(tg_in[d], grid[d]);  // as MLX clamps group dims
  for (int d = 0; d < 3; ++d)
    if (grid[d] == 0 || tg[d] == 0) { if (errlen) err[0] = 0; return 0; }
  unsigned long long tg_threads = (unsigned long long)tg[0] * tg[1] * tg[2];
  if (tg_threads > kMaxThreads) {
    std::snprintf(err, errlen, "Thread group size (%llu) is greater than  the maximum allowed threads per threadgroup (%d).",
                  tg_threads, kMaxThreads);
    return 1;
  }
  if (cooperative && !RT.stacks) {
    RT.stacks = (char*)mmap(nullptr, (kStackBytes + kGuardBytes) * kMaxThreads, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (RT.stacks == MAP_FAILED) { RT.stacks = nullptr; std::snprintf(err, errlen, "cannot map fiber stacks"); return 1; }
    for (int i = 0; i < kMaxThreads; ++i) {
      char* slot = RT.stacks + i * (kStackBytes + kGuardBytes);
      mprotect(slot, kGuardBytes, PROT_NONE);
      RT.fibers[i].stack = slot + kGuardBytes;
      getcontext(&RT.fibers[i].uc);  // once: makecontext below re-targets it per thread
    }
  }
  unsigned ngroups[3];
  for (int d = 0; d < 3; ++d) ngroups[d] = (grid[d] + tg[d] - 1) / tg[d];
  std::vector<unsigned long long> groups((unsigned long long)ngroups[0] * ngroups[1] * ngroups[2]);
  for (size_t i = 0; i < groups.size(); ++i) groups[i] = i;
  std::mt19937_64 rng(seed);
  if (order == 2) std::shuffle(groups.begin(), groups.end(), rng);
  if (order == 1) std::reverse(groups.begin(), groups.end());
  std::vector<int> perm;

  for (unsigned long long g : groups) {
    unsigned gp[3] = {(unsigned)(g % ngroups[0]), (unsigned)(g / ngroups[0] % ngroups[1]),
                      (unsigned)(g / ngroups[0] / ngroups[1])};
    unsigned sz[3];  // the last threadgroup along an axis is partial (dispatchThreads)
    for (int d = 0; d < 3; ++d) sz[d] = std::min(tg[d], grid[d] - gp[d] * tg[d]);
    int n = (int)(sz[0] * sz[1] * sz[2]);
    std::memset(RT.tg_memory, 0xFF, kThreadgroupBytes);
    for (int i = 0; i < n; ++i) {
      Ids& id = RT.lanes[i].ids;
      unsigned lx = i % sz[0], ly = i / sz[0] % sz[1], lz = i / sz[0] / sz[1];
      id.thread_position_in_threadgroup = metal::uint3(lx, ly, lz);
      id.thread_position_in_grid = metal::uint3(gp[0] * tg[0] + lx, gp[1] * tg[1] + ly, gp[2] * tg[2] + lz);
      id.threads_per_threadgroup = metal::uint3(sz[0], sz[1], sz[2]);
      id.threadgroup_position_in_grid = metal::uint3(gp[0], gp[1], gp[2]);
      id.threadgroups_per_grid = metal::uint3(ngroups[0], ngroups[1], ngroups[2]);
      id.threads_per_grid = metal::uint3(grid[0], grid[1], grid[2]);
      id.grid_size = id.threads_per_grid;
      id.dispatch_threads_per_threadgroup = metal::uint3(tg[0], tg[1], tg[2]);
      id.grid_origin = metal::uint3(0u, 0u, 0u);
      id.thread_index_in_threadgroup = i;
      id.thread_index_in_simdgroup = i % kSimdWidth;
      id.simdgroup_index_in_threadgroup = i / kSimdWidth;
      id.simdgroups_per_threadgroup = (n + kSimdWidth - 1) / kSimdWidth;
      id.dispatch_simdgroups_per_threadgroup = (unsigned)((tg_threads + kSimdWidth - 1) / kSimdWidth);
      id.threads_per_simdgroup = kSimdWidth;
      id.thread_execution_width = kSimdWidth;
      id.thread_index_in_quadgroup = i % 4;
      id.quadgroup_index_in_threadgroup = i / 4;
      id.quadgroups_per_threadgroup = (n + 3) / 4;
      id.dispatch_quadgroups_per_threadgroup = (unsigned)((tg_threads + 3) / 4);
    }
    perm.resize(n);
    for (int i = 0; i < n; ++i) perm[i] = order == 1 ? n - 1 - i : i;
    if (!cooperative) {  // nothing can suspend: plain calls, in the chosen order
      if (order == 2) std::shuffle(perm.begin(), perm.end(), rng);
      for (int i : perm) {
        RT.current = i;
        if (!_setjmp(RT.sched)) k.run(k.ctx, RT.lanes[i].ids);
        RT.current = -1;
        if (RT.failed) { std::snprintf(err, errlen, "%s", RT.err); return 1; }
      }
      continue;
    }
    for (int i = 0; i < n; ++i) {
      RT.lanes[i].state = State::Runnable;
      Fiber& f = RT.fibers[i];
      f.started = false;
      f.uc.uc_stack.ss_sp = f.stack;
      f.uc.uc_stack.ss_size = kStackBytes;
      f.uc.uc_link = nullptr;
      makecontext(&f.uc, fiber_main, 0);
    }
    for (;;) {
      if (order == 2) std::shuffle(perm.begin(), perm.end(), rng);
      for (int i : perm) {
        if (RT.lanes[i].state != State::Runnable) continue;
        RT.current = i;
        if (!_setjmp(RT.sched)) {
          if (!RT.fibers[i].started) {
            RT.fibers[i].started = true;
            ucontext_t here;
            swapcontext(&here, &RT.fibers[i].uc);
          } else {
            _longjmp(RT.fibers[i].jb, 1);
          }
        }
        RT.current = -1;
        if (RT.failed) { std::snprintf(err, errlen, "%s", RT.err); return 1; }
      }
      bool all_done = true, progressed = false;
      for (int i = 0; i < n; ++i) all_done &= RT.lanes[i].state == State::Done;
      if (all_done) break;
      for (int s = 0; s * kSimdWidth < n; ++s) {
        Lane* lanes = &RT.lanes[s * kSimdWidth];
        int nl = std::min(kSimdWidth, n - s * kSimdWidth);
        bool waiting = false, ready = true;
        Resolver r = nullptr;
        for (int l = 0; l < nl; ++l) {
          State st = lanes[l].state;
          if (st == State::AtSimd) {
            if (r && r != lanes[l].resolver) {
              std::snprintf(err, errlen, "lanes of simdgroup %d wait at different SIMD collectives", s);
              return 1;
            }
            r = lanes[l].resolver; waiting = true;
          } else if (st != State::Done) {
            ready = false;
          }
        }
        if (waiting && ready) {
          r(lanes, nl);
          for (int l = 0; l < nl; ++l) if (lanes[l].state == State::AtSimd) lanes[l].state = State::Runnable;
          progressed = true;
        }
      }
      if (progressed) continue;
      bool barrier = true;
      for (int i = 0; i < n; ++i) barrier &= RT.lanes[i].state == State::AtBarrier || RT.lanes[i].state == State::Done;
      if (!barrier) {
        std::snprintf(err, errlen, "deadlock: threads wait at a barrier while lanes of their simdgroup wait at a SIMD collective");
        return 1;
      }
      for (int i = 0; i < n; ++i) if (RT.lanes[i].state == State::AtBarrier) RT.lanes[i].state = State::Runnable;
    }
  }
  if (errlen) err[0] = 0;
  return 0;
}

}  // namespace kvemu
