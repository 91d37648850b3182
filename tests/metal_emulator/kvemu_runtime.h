// Kernel side of the CPU Metal emulator: SIMD-group collectives, barriers, atomics and
// the MSL spellings (address spaces, `using namespace metal`). Included by every compiled
// kernel; the scheduler itself is kvemu_runtime.cpp, built once.
#pragma once

#include <cstring>

#include "kvemu_abi.h"
#include "metal_compat.h"

namespace kvemu {

// Threadgroup memory: each `threadgroup T name[N];` declaration (rewritten by the
// emulator to `auto& name = KVEMU_TG(T[N]);`) gets a fixed place in the runtime's arena,
// which the scheduler poisons before every threadgroup. All threads of a threadgroup see
// the same place; the layout is fixed on first use, as a compiler would fix it.
#include <cstdint>
static size_t tg_used;
inline size_t tg_place(size_t bytes) {  // SIZE_MAX when the 32 KB are exhausted
  size_t off = (tg_used + 15) & ~size_t(15);
  if (off + bytes > kThreadgroupBytes) return SIZE_MAX;
  tg_used = off + bytes;
  return off;
}
template <class T, int Site> inline T& tg_alloc() {  // one place per declaration and type
  static const size_t off = tg_place(sizeof(T));
  if (off == SIZE_MAX) kvemu_fail("threadgroup memory exceeds 32 KB");
  return *reinterpret_cast<T*>(kvemu_threadgroup_memory() + off);
}
#define KVEMU_TG(...) kvemu::tg_alloc<__VA_ARGS__, __COUNTER__>()

// ----------------------------------------------------------------------------- collectives

template <class T> inline T garbage() {
  T t; std::memset(&t, 0xFF, sizeof(T)); return t;
}

enum class Op { Sum, Prod, Max, Min, And, Or, Xor, PrefixInclSum, PrefixExclSum, PrefixInclProd,
                PrefixExclProd, Shuffle, ShuffleDown, ShuffleUp, ShuffleXor, ShuffleRotateDown,
                ShuffleRotateUp, Broadcast, BroadcastFirst, All, Any };

template <class T> inline T get_in(const Lane& f) { T t; std::memcpy(&t, f.in, sizeof(T)); return t; }
template <class T> inline void set_out(Lane& f, const T& t) { std::memcpy(f.out, &t, sizeof(T)); }
inline bool active(const Lane* lanes, int nlanes, int l) {
  return l >= 0 && l < nlanes && lanes[l].state == State::AtSimd;
}

template <class T, Op op> inline T combine(T a, T b) {
  if constexpr (op == Op::Sum || op == Op::PrefixInclSum || op == Op::PrefixExclSum) return a + b;
  else if constexpr (op == Op::Prod || op == Op::PrefixInclProd || op == Op::PrefixExclProd) return a * b;
  else if constexpr (op == Op::Max) return metal::max(a, b);
  else if constexpr (op == Op::Min) return metal::min(a, b);
  else if constexpr (op == Op::And || op == Op::All) return a & b;
  else if constexpr (op == Op::Or || op == Op::Any) return a | b;
  else if constexpr (op == Op::Xor) return a ^ b;
  else return a;
}

template <class T, Op op> void resolve(Lane* lanes, int nlanes) {
  constexpr bool reduce = op == Op::Sum || op == Op::Prod || op == Op::Max || op == Op::Min ||
                          op == Op::And || op == Op::Or || op == Op::Xor || op == Op::All || op == Op::Any;
  constexpr bool prefix = op == Op::PrefixInclSum || op == Op::PrefixExclSum ||
                          op == Op::PrefixInclProd || op == Op::PrefixExclProd;
  if constexpr (reduce) {
    // Pairwise tree over the lanes (what a shuffle-xor reduction on hardware computes).
    T vals[kSimdWidth];
    bool has[kSimdWidth];
    for (int l = 0; l < kSimdWidth; ++l) {
      has[l] = active(lanes, nlanes, l);
      if (has[l]) vals[l] = get_in<T>(lanes[l]);
    }
    for (int step = 1; step < kSimdWidth; step *= 2)
      for (int l = 0; l + step < kSimdWidth; l += 2 * step) {
        if (has[l] && has[l + step]) vals[l] = combine<T, op>(vals[l], vals[l + step]);
        else if (has[l + step]) { vals[l] = vals[l + step]; has[l] = true; }
      }
    for (int l = 0; l < nlanes; ++l) if (active(lanes, nlanes, l)) set_out(lanes[l], vals[0]);
  } else if constexpr (prefix) {
    constexpr bool incl = op == Op::PrefixInclSum || op == Op::PrefixInclProd;
    constexpr bool sum = op == Op::PrefixInclSum || op == Op::PrefixExclSum;
    T acc = T(sum ? 0 : 1);
    for (int l = 0; l < nlanes; ++l) {
      if (!active(lanes, nlanes, l)) continue;
      T v = get_in<T>(lanes[l]);
      if (!incl) set_out(lanes[l], acc);
      acc = combine<T, op>(acc, v);
      if (incl) set_out(lanes[l], acc);
    }
  } else {
    int first = -1;
    for (int l = 0; l < nlanes && first < 0; ++l) if (active(lanes, nlanes, l)) first = l;
    for (int l = 0; l < nlanes; ++l) {
      if (!active(lanes, nlanes, l)) continue;
      uint32_t a = lanes[l].arg;
      int src;
      if constexpr (op == Op::Shuffle || op == Op::Broadcast) src = (int)a;
      else if constexpr (op == Op::ShuffleDown) src = l + (int)a < kSimdWidth ? l + (int)a : l;
      else if constexpr (op == Op::ShuffleUp) src = l >= (int)a ? l - (int)a : l;
      else if constexpr (op == Op::ShuffleXor) src = l ^ (int)a;
      else if constexpr (op == Op::ShuffleRotateDown) src = (l + (int)a) % kSimdWidth;
      else if constexpr (op == Op::ShuffleRotateUp) src = ((l - (int)a) % kSimdWidth + kSimdWidth) % kSimdWidth;
      else src = first;  // BroadcastFirst
      // Reading a lane that is absent or not participating is undefined: poison.
      set_out(lanes[l], active(lanes, nlanes, src) ? get_in<T>(lanes[src]) : garbage<T>());
    }
  }
}

template <Op op, class T> inline T collective(T v, uint32_t arg = 0) {
  static_assert(sizeof(T) <= kSlotBytes, "collective value too large");
  Lane* f = kvemu_current_lane();
  std::memcpy(f->in, &v, sizeof(T));
  f->arg = arg;
  f->resolver = &resolve<T, op>;
  f = kvemu_suspend(State::AtSimd);
  T r;
  std::memcpy(&r, f->out, sizeof(T));
  return r;
}

}  // namespace kvemu

// ----------------------------------------------------------------------------- MSL surface

namespace metal {
enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags((unsigned)a | (unsigned)b); }
inline void threadgroup_barrier(mem_flags = mem_flags::mem_none) { kvemu::kvemu_suspend(kvemu::State::AtBarrier); }
// A simdgroup barrier is a collective over the lanes that carries no value.
inline void simdgroup_barrier(mem_flags = mem_flags::mem_none) { kvemu::collective<kvemu::Op::BroadcastFirst>(0); }

#define KVEMU_SIMD(NAME, OP) \
  template <class T> inline T NAME(T v) { return kvemu::collective<kvemu::Op::OP>(v); }
KVEMU_SIMD(simd_sum, Sum)
KVEMU_SIMD(simd_product, Prod)
KVEMU_SIMD(simd_max, Max)
KVEMU_SIMD(simd_min, Min)
KVEMU_SIMD(simd_and, And)
KVEMU_SIMD(simd_or, Or)
KVEMU_SIMD(simd_xor, Xor)
KVEMU_SIMD(simd_prefix_inclusive_sum, PrefixInclSum)
KVEMU_SIMD(simd_prefix_exclusive_sum, PrefixExclSum)
KVEMU_SIMD(simd_prefix_inclusive_product, PrefixInclProd)
KVEMU_SIMD(simd_prefix_exclusive_product, PrefixExclProd)
KVEMU_SIMD(simd_broadcast_first, BroadcastFirst)
#undef KVEMU_SIMD
#define KVEMU_SIMD_ARG(NAME, OP) \
  template <class T> inline T NAME(T v, ushort a) { return kvemu::collective<kvemu::Op::OP>(v, a); }
KVEMU_SIMD_ARG(simd_shuffle, Shuffle)
KVEMU_SIMD_ARG(simd_shuffle_down, ShuffleDown)
KVEMU_SIMD_ARG(simd_shuffle_up, ShuffleUp)
KVEMU_SIMD_ARG(simd_shuffle_xor, ShuffleXor)
KVEMU_SIMD_ARG(simd_shuffle_rotate_down, ShuffleRotateDown)
KVEMU_SIMD_ARG(simd_shuffle_rotate_up, ShuffleRotateUp)
KVEMU_SIMD_ARG(simd_broadcast, Broadcast)
#undef KVEMU_SIMD_ARG
inline bool simd_all(bool v) { return kvemu::collective<kvemu::Op::All>(v); }
inline bool simd_any(bool v) { return kvemu::collective<kvemu::Op::Any>(v); }

// Atomics: one OS thread runs every GPU thread, so plain loads and stores are atomic.
enum memory_order { memory_order_relaxed };
template <class T> struct atomic { T value; };
template <class T> inline void atomic_store_explicit(atomic<T>* a, T v, memory_order) { a->value = v; }
template <class T> inline T atomic_load_explicit(const atomic<T>* a, memory_order) { return a->value; }
template <class T> inline T atomic_exchange_explicit(atomic<T>* a, T v, memory_order) { T o = a->value; a->value = v; return o; }
template <class T> inline T atomic_fetch_add_explicit(atomic<T>* a, T v, memory_order) { T o = a->value; a->value = o + v; return o; }
template <class T> inline T atomic_fetch_sub_explicit(atomic<T>* a, T v, memory_order) { T o = a->value; a->value = o - v; return o; }
template <class T> inline T atomic_fetch_max_explicit(atomic<T>* a, T v, memory_order) { T o = a->value; a->value = max(o, v); return o; }
template <class T> inline T atomic_fetch_min_explicit(atomic<T>* a, T v, memory_order) { T o = a->value; a->value = min(o, v); return o; }
}  // namespace metal

using namespace metal;
typedef metal::half float16_t;
typedef metal::bfloat bfloat16_t;

// Address spaces are one flat memory here. `threadgroup` declarations were rewritten to
// KVEMU_TG by the emulator before compiling; the remaining uses are pointer types.
#define device
#define constant
#define thread
#define threadgroup
#define kernel
#define METAL_FUNC inline
