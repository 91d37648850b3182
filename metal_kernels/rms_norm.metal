// RMSNorm, one row per threadgroup: y = x * rsqrt(mean(x^2) + eps) * w.
//
// The same file serves `add_rms_norm`: with ADD_RESIDUAL (defined by the Python side
// in front of this header) the kernel also takes `residual`, writes h = x + residual and
// normalises h, so a block's residual add and the norm after it are one pass.
//
// Template parameters (from metal_kernels/metal.py):
//   T         x, residual and h;
//   W         w and y: result_type(T, weight), so it is at least as wide as T;
//   N_READS   consecutive elements a thread handles per step (the vector width);
//   N_CHUNKS  steps per thread, > 1 when a row is longer than N_READS * threads.
// Every thread keeps its elements in registers (v[]), so x is read once and y written
// once; sums are float32 for every T. Elements past the hidden size D count as 0, so any
// D works, including one that is not a multiple of N_READS.
//
// The text below `//// body` is the kernel body given to mx.fast.metal_kernel, which
// writes the signature (inputs x[, residual], w, eps (0-d); outputs [h,] y).

//// body
threadgroup float partial[32];  // one partial sum per simdgroup (at most 1024 / 32)
threadgroup float inv_rms[1];

const uint row = threadgroup_position_in_grid.x;
const uint lid = thread_position_in_threadgroup.x;
const uint n_threads = threads_per_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint n_sg = simdgroups_per_threadgroup;
const uint D = w_shape[0];
const size_t base = size_t(row) * D;

// 1. read the row once (adding the residual), keep it, sum squares in float32
float v[N_CHUNKS * N_READS];
float sumsq = 0.0f;
for (int c = 0; c < N_CHUNKS; c++) {
  for (int i = 0; i < N_READS; i++) {
    const uint j = (c * n_threads + lid) * N_READS + i;
    float xj = 0.0f;
    if (j < D) {
#if ADD_RESIDUAL
      const T hj = static_cast<T>(static_cast<float>(x[base + j]) +
                                  static_cast<float>(residual[base + j]));
      h[base + j] = hj;
      xj = static_cast<float>(hj);
#else
      xj = static_cast<float>(x[base + j]);
#endif
    }
    v[c * N_READS + i] = xj;
    sumsq += xj * xj;
  }
}

// 2. reduce: within each simdgroup, then across simdgroups through threadgroup memory
sumsq = simd_sum(sumsq);
if (lane == 0) {
  partial[sg] = sumsq;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (sg == 0) {
  const float total = simd_sum(lane < n_sg ? partial[lane] : 0.0f);
  if (lane == 0) {
    inv_rms[0] = metal::precise::rsqrt(total / float(D) + eps);
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const float r = inv_rms[0];

// 3. write y from the kept values: normalise in float32, round to W, scale by w in W
for (int c = 0; c < N_CHUNKS; c++) {
  for (int i = 0; i < N_READS; i++) {
    const uint j = (c * n_threads + lid) * N_READS + i;
    if (j < D) {
      const W normed = static_cast<W>(v[c * N_READS + i] * r);
      y[base + j] = static_cast<W>(static_cast<float>(normed) * static_cast<float>(w[j]));
    }
  }
}
