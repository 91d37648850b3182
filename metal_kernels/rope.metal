// RoPE on the Q and K of one attention call, in one launch (under GQA they have
// different head counts). Also serves single-tensor rope with no K heads (meta[3] = 0).
//
// Grid (in threads): x = feature slot, y = position t, z = batch * (Hq + Hk) heads,
// Q heads first. Slots 0 .. dims/2 - 1 each rotate one pair; slots from dims/2 on each
// copy one of the D - dims features past the rotary part (partial rotary).
// Pairs: rotate-half layout (Hugging Face) (j, j + dims/2); interleaved (`traditional`)
// layout (2j, 2j + 1).
//
// Inputs: q, k (B, H, T, D) read through their strides (they are usually transposed
// views of the projections: no copy); offset (B,) int32 (position of t = 0 per batch
// row); freqs (dims/2,) float32 periods, used when meta[2] != 0; params float32
// [log2(base), scale]; meta int32 [dims, traditional, has_freqs, Hk].
// Outputs q_out, k_out: row-contiguous (B, H, T, D). Angles and products are float32;
// each output is rounded to T once.

// Rotate (or copy) slot j of one row. A template over the input pointer type because
// MLX passes an input smaller than 8 elements in the constant address space.
template <typename T, typename Src>
inline void rope_slot(
    Src src,
    const constant int64_t* strides,
    device T* dst,
    size_t in_row,
    size_t out_row,
    uint j,
    uint dims,
    bool traditional,
    float cos_theta,
    float sin_theta) {
  const uint half_dims = dims / 2;
  if (j < half_dims) {
    const uint i1 = traditional ? 2 * j : j;
    const uint i2 = traditional ? 2 * j + 1 : j + half_dims;
    const float x1 = static_cast<float>(src[in_row + i1 * strides[3]]);
    const float x2 = static_cast<float>(src[in_row + i2 * strides[3]]);
    dst[out_row + i1] = static_cast<T>(x1 * cos_theta - x2 * sin_theta);
    dst[out_row + i2] = static_cast<T>(x1 * sin_theta + x2 * cos_theta);
  } else {
    const uint i = dims + (j - half_dims);
    dst[out_row + i] = src[in_row + i * strides[3]];
  }
}

//// body
const uint dims = uint(meta[0]);
const bool traditional = meta[1] != 0;
const bool has_freqs = meta[2] != 0;
const uint Hk = uint(meta[3]);
const uint Hq = uint(q_shape[1]);
const uint T_len = uint(q_shape[2]);
const uint D = uint(q_shape[3]);

const uint j = thread_position_in_grid.x;
const uint t = thread_position_in_grid.y;
const uint z = thread_position_in_grid.z;
const uint b = z / (Hq + Hk);
const uint head = z % (Hq + Hk);

float cos_theta = 1.0f;
float sin_theta = 0.0f;
if (j < dims / 2) {
  const float inv_freq = has_freqs
      ? 1.0f / freqs[j]
      : metal::exp2(-(float(j) / float(dims / 2)) * params[0]);
  const float theta = float(int(t) + offset[b]) * params[1] * inv_freq;
  cos_theta = metal::cos(theta);
  sin_theta = metal::sin(theta);
}

if (head < Hq) {
  const size_t in_row = b * q_strides[0] + head * q_strides[1] + t * q_strides[2];
  const size_t out_row = ((size_t(b) * Hq + head) * T_len + t) * D;
  rope_slot<T>(q, q_strides, q_out, in_row, out_row, j, dims, traditional, cos_theta, sin_theta);
} else {
  const uint kh = head - Hq;
  const size_t in_row = b * k_strides[0] + kh * k_strides[1] + t * k_strides[2];
  const size_t out_row = ((size_t(b) * Hk + kh) * T_len + t) * D;
  rope_slot<T>(k, k_strides, k_out, in_row, out_row, j, dims, traditional, cos_theta, sin_theta);
}
