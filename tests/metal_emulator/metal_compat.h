// Metal Shading Language compatibility layer for the CPU emulator.
//
// Enough of MSL for `mx.fast.metal_kernel` bodies to compile as C++20: half and
// bfloat with round-to-nearest-even, vector types, metal:: math, SIMD-group
// collectives and threadgroup barriers. Barriers and collectives suspend the calling
// thread (a fiber, see kvemu_runtime.h) so the scheduler can run the others.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;

namespace metal {

// ----------------------------------------------------------------------------- half / bfloat

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// float -> IEEE binary16, round to nearest even (subnormals, overflow to inf, NaN kept quiet).
inline uint16_t float_to_half_bits(float f) {
  uint32_t x = f32_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520 -> inf
  if (ax < 0x38800000u) {                         // below 2^-14: subnormal half
    // value * 2^24 rounded to an integer (RNE) is the subnormal mantissa.
    float v = bits_f32(ax) * 16777216.0f;  // exact (power of two scale)
    float r = std::nearbyint(v);           // default FE_TONEAREST: ties to even
    return sign | (uint16_t)r;
  }
  uint32_t mant = ax & 0x7fffffu;
  uint32_t exp = (ax >> 23) - 127 + 15;
  uint32_t h = (exp << 10) | (mant >> 13);
  uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h += 1;  // carry may bump exponent: fine
  return sign | h;
}

inline float half_bits_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    float v = (float)mant * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));
  return bits_f32(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

inline uint16_t float_to_bfloat_bits(float f) {
  uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);  // quiet NaN
  uint32_t lsb = (x >> 16) & 1u;
  x += 0x7fffu + lsb;
  return (uint16_t)(x >> 16);
}
inline float bfloat_bits_to_float(uint16_t b) { return bits_f32((uint32_t)b << 16); }

template <class Tag>
struct float16_like {
  uint16_t bits;
  float16_like() = default;
  constexpr float16_like(uint16_t b, int) : bits(b) {}
  float16_like(float f) : bits(Tag::encode(f)) {}
  float16_like(double f) : bits(Tag::encode((float)f)) {}
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  float16_like(I i) : bits(Tag::encode((float)i)) {}
  template <class O, std::enable_if_t<!std::is_same_v<O, Tag> && std::is_class_v<typename O::tag_type>, int> = 0>
  explicit float16_like(float16_like<O> o) : bits(Tag::encode((float)o)) {}
  using tag_type = Tag;
  operator float() const { return Tag::decode(bits); }
  float16_like operator-() const { return float16_like((uint16_t)(bits ^ 0x8000u), 0); }
  float16_like operator+() const { return *this; }
};

struct half_tag {
  static uint16_t encode(float f) { return float_to_half_bits(f); }
  static float decode(uint16_t b) { return half_bits_to_float(b); }
};
struct bfloat_tag {
  static uint16_t encode(float f) { return float_to_bfloat_bits(f); }
  static float decode(uint16_t b) { return bfloat_bits_to_float(b); }
};
typedef float16_like<half_tag> half;
typedef float16_like<bfloat_tag> bfloat;

template <class T> struct is_f16 : std::false_type {};
template <class G> struct is_f16<float16_like<G>> : std::true_type {};
template <class T> inline constexpr bool is_f16_v = is_f16<std::remove_cv_t<T>>::value;

// Metal arithmetic: h op h -> h (rounded); h op float -> float; h op int -> h.
// `double` stands for a Metal float literal (MSL has no double).
#define KVEMU_F16_BINOP(OP)                                                              \
  template <class G> inline float16_like<G> operator OP(float16_like<G> a, float16_like<G> b) { \
    return float16_like<G>((float)a OP (float)b);                                       \
  }                                                                                     \
  template <class G, class U, std::enable_if_t<std::is_floating_point_v<U>, int> = 0>    \
  inline float operator OP(float16_like<G> a, U b) { return (float)a OP (float)b; }     \
  template <class G, class U, std::enable_if_t<std::is_floating_point_v<U>, int> = 0>    \
  inline float operator OP(U a, float16_like<G> b) { return (float)a OP (float)b; }     \
  template <class G, class U, std::enable_if_t<std::is_integral_v<U>, int> = 0>         \
  inline float16_like<G> operator OP(float16_like<G> a, U b) { return a OP float16_like<G>(b); } \
  template <class G, class U, std::enable_if_t<std::is_integral_v<U>, int> = 0>         \
  inline float16_like<G> operator OP(U a, float16_like<G> b) { return float16_like<G>(a) OP b; }
KVEMU_F16_BINOP(+)
KVEMU_F16_BINOP(-)
KVEMU_F16_BINOP(*)
KVEMU_F16_BINOP(/)
#undef KVEMU_F16_BINOP

#define KVEMU_F16_CMP(OP)                                                               \
  template <class G> inline bool operator OP(float16_like<G> a, float16_like<G> b) {   \
    return (float)a OP (float)b;                                                        \
  }                                                                                     \
  template <class G, class U, std::enable_if_t<std::is_arithmetic_v<U>, int> = 0>       \
  inline bool operator OP(float16_like<G> a, U b) { return (float)a OP (float)b; }      \
  template <class G, class U, std::enable_if_t<std::is_arithmetic_v<U>, int> = 0>       \
  inline bool operator OP(U a, float16_like<G> b) { return (float)a OP (float)b; }
KVEMU_F16_CMP(<)
KVEMU_F16_CMP(>)
KVEMU_F16_CMP(<=)
KVEMU_F16_CMP(>=)
KVEMU_F16_CMP(==)
KVEMU_F16_CMP(!=)
#undef KVEMU_F16_CMP

#define KVEMU_F16_ASSIGN(OP)                                                            \
  template <class G, class U>                                                           \
  inline float16_like<G>& operator OP##=(float16_like<G>& a, U b) {                    \
    a = float16_like<G>((float)a OP (float)b);                                          \
    return a;                                                                           \
  }                                                                                     \
  template <class G, class U, std::enable_if_t<std::is_arithmetic_v<U>, int> = 0>       \
  inline U& operator OP##=(U& a, float16_like<G> b) {                                  \
    a = (U)((float)a OP (float)b);                                                      \
    return a;                                                                           \
  }
KVEMU_F16_ASSIGN(+)
KVEMU_F16_ASSIGN(-)
KVEMU_F16_ASSIGN(*)
KVEMU_F16_ASSIGN(/)
#undef KVEMU_F16_ASSIGN

// ----------------------------------------------------------------------------- vectors
// Components .x .y .z .w (and .r .g .b .a) and v[i]; multi-component swizzles (v.xy) are
// not provided (no kernel here uses them).

template <class T, int N> struct vec_storage;
template <class T> struct vec_storage<T, 2> {
  union { struct { T x, y; }; struct { T r, g; }; T v[2]; };
};
template <class T> struct vec_storage<T, 3> {
  union { struct { T x, y, z; }; struct { T r, g, b; }; T v[4]; };  // MSL: 3-vectors pad to 4
};
template <class T> struct vec_storage<T, 4> {
  union { struct { T x, y, z, w; }; struct { T r, g, b, a; }; T v[4]; };
};

template <class T, int N>
struct alignas(sizeof(T) * (N == 3 ? 4 : N)) vec : vec_storage<T, N> {
  using value_type = T;
  static constexpr int size = N;
  vec() = default;
  template <class U, std::enable_if_t<std::is_arithmetic_v<U> || is_f16_v<U>, int> = 0>
  vec(U s) { for (int i = 0; i < N; ++i) this->v[i] = T(s); }
  template <class U, std::enable_if_t<!std::is_same_v<U, T>, int> = 0>
  explicit vec(const vec<U, N>& o) { for (int i = 0; i < N; ++i) this->v[i] = T(o.v[i]); }
  template <class A, class B, class... R,
            std::enable_if_t<(sizeof...(R) + 2 <= N), int> = 0>
  vec(A a, B b, R... rest) {
    int i = 0;
    put(i, a); put(i, b); (put(i, rest), ...);
  }
  T& operator[](int i) { return this->v[i]; }
  const T& operator[](int i) const { return this->v[i]; }
 private:
  template <class U> void put(int& i, U s) {
    if constexpr (requires { U::size; }) {
      for (int k = 0; k < U::size; ++k) this->v[i++] = T(s.v[k]);
    } else {
      this->v[i++] = T(s);
    }
  }
};

template <class T> struct is_vec : std::false_type {};
template <class T, int N> struct is_vec<vec<T, N>> : std::true_type {};
template <class T> inline constexpr bool is_vec_v = is_vec<std::remove_cv_t<std::remove_reference_t<T>>>::value;

#define KVEMU_VEC_BINOP(OP)                                                              \
  template <class T, int N> inline vec<T, N> operator OP(const vec<T, N>& a, const vec<T, N>& b) { \
    vec<T, N> r; for (int i = 0; i < N; ++i) r.v[i] = T(a.v[i] OP b.v[i]); return r;     \
  }                                                                                      \
  template <class T, int N, class U, std::enable_if_t<!is_vec_v<U>, int> = 0>            \
  inline vec<T, N> operator OP(const vec<T, N>& a, U b) {                                \
    vec<T, N> r; for (int i = 0; i < N; ++i) r.v[i] = T(a.v[i] OP T(b)); return r;      \
  }                                                                                      \
  template <class T, int N, class U, std::enable_if_t<!is_vec_v<U>, int> = 0>            \
  inline vec<T, N> operator OP(U a, const vec<T, N>& b) {                                \
    vec<T, N> r; for (int i = 0; i < N; ++i) r.v[i] = T(T(a) OP b.v[i]); return r;      \
  }                                                                                      \
  template <class T, int N, class U>                                                     \
  inline vec<T, N>& operator OP##=(vec<T, N>& a, const U& b) { a = a OP b; return a; }
KVEMU_VEC_BINOP(+)
KVEMU_VEC_BINOP(-)
KVEMU_VEC_BINOP(*)
KVEMU_VEC_BINOP(/)
#undef KVEMU_VEC_BINOP
template <class T, int N> inline vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r; for (int i = 0; i < N; ++i) r.v[i] = -a.v[i]; return r;
}

#define KVEMU_VEC_TYPES(T, NAME) \
  typedef vec<T, 2> NAME##2;     \
  typedef vec<T, 3> NAME##3;     \
  typedef vec<T, 4> NAME##4;
KVEMU_VEC_TYPES(float, float)
KVEMU_VEC_TYPES(half, half)
KVEMU_VEC_TYPES(bfloat, bfloat)
KVEMU_VEC_TYPES(int, int)
KVEMU_VEC_TYPES(uint, uint)
KVEMU_VEC_TYPES(short, short)
KVEMU_VEC_TYPES(ushort, ushort)
KVEMU_VEC_TYPES(bool, bool)
#undef KVEMU_VEC_TYPES

// ----------------------------------------------------------------------------- math

template <class T> using mathf_t = std::conditional_t<std::is_same_v<T, double>, float, T>;

#define KVEMU_UNARY(NAME, EXPR)                                                   \
  inline float NAME(float x) { return EXPR; }                                     \
  inline float NAME(double x) { return NAME((float)x); }                          \
  template <class G> inline float16_like<G> NAME(float16_like<G> h) {             \
    return float16_like<G>(NAME((float)h));                                       \
  }                                                                               \
  template <class T, int N> inline vec<T, N> NAME(const vec<T, N>& a) {           \
    vec<T, N> r; for (int i = 0; i < N; ++i) r.v[i] = NAME(a.v[i]); return r;     \
  }
KVEMU_UNARY(rsqrt, 1.0f / std::sqrt(x))
KVEMU_UNARY(sqrt, std::sqrt(x))
KVEMU_UNARY(exp, std::exp(x))
KVEMU_UNARY(exp2, std::exp2(x))
KVEMU_UNARY(log, std::log(x))
KVEMU_UNARY(log2, std::log2(x))
KVEMU_UNARY(sin, std::sin(x))
KVEMU_UNARY(cos, std::cos(x))
KVEMU_UNARY(tan, std::tan(x))
KVEMU_UNARY(tanh, std::tanh(x))
KVEMU_UNARY(floor, std::floor(x))
KVEMU_UNARY(ceil, std::ceil(x))
KVEMU_UNARY(round, std::round(x))
KVEMU_UNARY(rint, std::nearbyint(x))
KVEMU_UNARY(trunc, std::trunc(x))
KVEMU_UNARY(fabs, std::fabs(x))
KVEMU_UNARY(fract, x - std::floor(x))
KVEMU_UNARY(recip, 1.0f / x)
#undef KVEMU_UNARY

template <class T> inline T abs(T x) {
  if constexpr (is_vec_v<T>) { T r; for (int i = 0; i < T::size; ++i) r.v[i] = abs(x.v[i]); return r; }
  else if constexpr (std::is_integral_v<T>) return x < 0 ? -x : x;
  else return T(std::fabs((float)x));
}

template <class T> inline bool isnan(T x) { return std::isnan((float)x); }
template <class T> inline bool isinf(T x) { return std::isinf((float)x); }
template <class T> inline bool isfinite(T x) { return std::isfinite((float)x); }

template <class T> inline T kvemu_pow(T a, T b) {
  if constexpr (is_vec_v<T>) { T r; for (int i = 0; i < T::size; ++i) r.v[i] = kvemu_pow(a.v[i], b.v[i]); return r; }
  else return T(std::pow((float)a, (float)b));
}
template <class A, class B> inline auto pow(A a, B b) { using T = mathf_t<decltype(a + b)>; return kvemu_pow<T>(T(a), T(b)); }
template <class A, class B> inline auto powr(A a, B b) { return pow(a, b); }

template <class T> inline T kvemu_min(T a, T b) {
  if constexpr (is_vec_v<T>) { T r; for (int i = 0; i < T::size; ++i) r.v[i] = kvemu_min(a.v[i], b.v[i]); return r; }
  else if constexpr (std::is_integral_v<T>) return b < a ? b : a;
  else return T(std::fmin((float)a, (float)b));
}
template <class T> inline T kvemu_max(T a, T b) {
  if constexpr (is_vec_v<T>) { T r; for (int i = 0; i < T::size; ++i) r.v[i] = kvemu_max(a.v[i], b.v[i]); return r; }
  else if constexpr (std::is_integral_v<T>) return a < b ? b : a;
  else return T(std::fmax((float)a, (float)b));
}
template <class T> inline T min(T a, T b) { return kvemu_min<mathf_t<T>>(a, b); }
template <class T> inline T max(T a, T b) { return kvemu_max<mathf_t<T>>(a, b); }
template <class T> inline T fmin(T a, T b) { return kvemu_min<T>(a, b); }
template <class T> inline T fmax(T a, T b) { return kvemu_max<T>(a, b); }
template <class T, class L, class H> inline T clamp(T x, L lo, H hi) { return min(max(x, T(lo)), T(hi)); }
template <class T> inline T saturate(T x) { return clamp(x, 0, 1); }
template <class A, class B, class C> inline auto fma(A a, B b, C c) {
  using T = mathf_t<std::common_type_t<decltype(a * b), C>>;
  if constexpr (is_vec_v<T>) { T r; for (int i = 0; i < T::size; ++i) r.v[i] = std::fma((float)T(a).v[i], (float)T(b).v[i], (float)T(c).v[i]); return r; }
  else return T(std::fma((float)a, (float)b, (float)c));
}
template <class T, class S> inline T mix(T x, T y, S a) { return x + (y - x) * a; }
template <class T> inline T select(T a, T b, bool c) { return c ? b : a; }
template <class T> inline T sign(T x) { return T(x > T(0) ? 1.0f : (x < T(0) ? -1.0f : 0.0f)); }
template <class T> inline T copysign(T x, T y) { return T(std::copysign((float)x, (float)y)); }
inline float sincos(float x, float& c) { c = std::cos(x); return std::sin(x); }
template <class T, int N> inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = a.v[0] * b.v[0];
  for (int i = 1; i < N; ++i) s = s + a.v[i] * b.v[i];
  return s;
}
template <class To, class From> inline To as_type(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  To t; std::memcpy(&t, &f, sizeof(To)); return t;
}

template <class T> struct numeric_limits : std::numeric_limits<T> {};
template <class G> struct numeric_limits<float16_like<G>> {
  static float16_like<G> infinity() { return float16_like<G>(INFINITY); }
  static float16_like<G> quiet_NaN() { return float16_like<G>(NAN); }
  static float16_like<G> max() {
    return std::is_same_v<G, half_tag> ? float16_like<G>((uint16_t)0x7bffu, 0) : float16_like<G>((uint16_t)0x7f7fu, 0);
  }
  static float16_like<G> lowest() { return -max(); }
  static float16_like<G> min() {
    return std::is_same_v<G, half_tag> ? float16_like<G>((uint16_t)0x0400u, 0) : float16_like<G>((uint16_t)0x0080u, 0);
  }
  static float16_like<G> epsilon() {
    return std::is_same_v<G, half_tag> ? float16_like<G>((uint16_t)0x1400u, 0) : float16_like<G>((uint16_t)0x3c00u, 0);
  }
};

template <class A, class B> inline auto divide(A a, B b) { return a / b; }

// precise:: and fast:: spell the same functions (fast-math accuracy is not emulated).
#define KVEMU_MATH_USING                                                                   \
  using metal::abs; using metal::clamp; using metal::cos; using metal::divide;            \
  using metal::exp; using metal::exp2; using metal::fabs; using metal::fma;               \
  using metal::log; using metal::log2; using metal::max; using metal::min;                \
  using metal::pow; using metal::powr; using metal::rsqrt; using metal::sin;              \
  using metal::sincos; using metal::sqrt; using metal::tan; using metal::tanh;            \
  using metal::floor; using metal::ceil; using metal::round; using metal::trunc;
namespace precise { KVEMU_MATH_USING }
namespace fast { KVEMU_MATH_USING }
#undef KVEMU_MATH_USING
}  // namespace metal
