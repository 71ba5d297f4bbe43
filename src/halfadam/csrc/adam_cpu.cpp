// halfadam's hand-written CPU kernel: one Adam/AdamW step over a list of parameters whose state lives in
// a bucket's flat buffers, in one call (the "cpp" implementation).
//
// The equations are halfadam.functional's, term for term and in the same order of operations
// (halfadam.functional.adam_elementwise_ with tensor coefficients, halfadam.functional.sync_master_);
// it is compiled with -ffp-contract=off so no multiply-add is fused into one rounding. Per element,
// with c = the coefficients of halfadam.functional.adam_coefficients:
//
//   g  = float(grad) [* grad_scale]
//   w  = master, or p where p != round(master)            (master sync; w = p for float32 params;
//        "!=" also where the two are zeros of opposite sign: halfadam.functional.written)
//   g  = g + c.l2 * w            (decay "l2")   |   w = w * c.decay_factor   (otherwise)
//   m  = m + (g - m) * c.one_minus_beta1
//   v  = v * c.beta2 + (g * c.one_minus_beta2) * g
//   d  = sqrt(v) + c.eps   (optimized_update)  |   d = sqrt(v) / c.sqrt_bias_correction2 + c.eps
//   w  = w - (m / d) * c.step_size
//   master = w;  p = round(w)   (round to nearest even, as Tensor.copy_)
//
// State encodings (halfadam.encodings is their specification; the functions named there are mirrored
// here bit for bit): the master is fp32 ("master_weight") or split ("master_hi" int8, "master_lo"
// uint8, "master_tie" uint8 per 128-element block: encodings._split_decode / _split_encode_); each
// moment is float32 or bfloat16 (decoded exactly, encoded by stochastic rounding with
// encodings._random_bits' hash of the element's position in its parameter, the step and a salt).
// Gradients are float32 or the parameter's dtype (adam_step converts any other floating dtype).
//
// Work is split over torch's intra-op threads (at::parallel_for) by 128-element blocks across the list.
// Each element is read and written once, in one loop: 8 lanes at a time with AVX2 (F16C converts
// float16, integer ops round bfloat16), one at a time for the tail and on other CPUs.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define HALFADAM_AVX2 1
#endif

namespace {

constexpr int64_t GRAIN = 32768;  // elements per thread task (at::internal::GRAIN_SIZE)

// ---------------------------------------------------------------- lanes: one float, or 8 (AVX2)
// The update is written once (adam_lanes) for a lane type V: float for tails and machines without
// AVX2, V8 (8 floats in a __m256) otherwise. Loads convert a parameter's or gradient's dtype to
// float32, stores round float32 to it (nearest even, as Tensor.copy_).
inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
// float32 -> bfloat16 bits, round to nearest even, nan -> 0x7FC0 (c10::BFloat16's rule)
inline uint16_t bf16_bits(float f) {
  const uint32_t u = float_to_bits(f);
  return f != f ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float load1(const float* p) { return *p; }
inline float load1(const at::BFloat16* p) { return bits_to_float(static_cast<uint32_t>(p->x) << 16); }
inline float load1(const at::Half* p) { return c10::detail::fp16_ieee_to_fp32_value(p->x); }
inline void store1(float* p, float x) { *p = x; }
inline void store1(at::BFloat16* p, float x) { p->x = bf16_bits(x); }
inline void store1(at::Half* p, float x) { p->x = c10::detail::fp16_ieee_from_fp32_value(x); }
template <typename P> inline float round1(float x) { P r; store1(&r, x); return load1(&r); }
inline float select1(bool take_b, float a, float b) { return take_b ? b : a; }
// halfadam.functional.written: another value, nan on either side, or a zero of the other sign
inline bool written1(float p, float r) { return p != r || std::signbit(p) != std::signbit(r); }

#ifdef HALFADAM_AVX2
struct V8 {
  __m256 x;
  V8() = default;
  V8(__m256 v) : x(v) {}
  explicit V8(float f) : x(_mm256_set1_ps(f)) {}
};
inline V8 operator+(V8 a, V8 b) { return _mm256_add_ps(a.x, b.x); }
inline V8 operator-(V8 a, V8 b) { return _mm256_sub_ps(a.x, b.x); }
inline V8 operator*(V8 a, V8 b) { return _mm256_mul_ps(a.x, b.x); }
inline V8 operator/(V8 a, V8 b) { return _mm256_div_ps(a.x, b.x); }
inline V8 sqrt(V8 a) { return _mm256_sqrt_ps(a.x); }

// float32 bits + 0x7FFF + the lowest kept bit: its upper 16 bits are the bfloat16 rounded to nearest
// even (c10::BFloat16's rule) for every non-nan value
inline __m256i bf16_round_up8(__m256i u) {
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
}
// round(v) to P as 8 x 16 bits (bfloat16: nan -> 0x7FC0), and 16-bit values back to float32
inline __m128i half_bits8(at::BFloat16, V8 v) {
  __m256i r = _mm256_srli_epi32(bf16_round_up8(_mm256_castps_si256(v.x)), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v.x, v.x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline __m128i half_bits8(at::Half, V8 v) { return _mm256_cvtps_ph(v.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V8 widen8(at::BFloat16, __m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline V8 widen8(at::Half, __m128i h) { return _mm256_cvtph_ps(h); }

inline V8 load8(const float* p) { return _mm256_loadu_ps(p); }
template <typename P>
inline V8 load8(const P* p) { return widen8(P(), _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store8(float* p, V8 v) { _mm256_storeu_ps(p, v.x); }
template <typename P>
inline void store8(P* p, V8 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), half_bits8(P(), v)); }
// halfadam.functional.written per lane (all bits set where true): another value (nan on either side:
// the unordered compare) or a zero of the other sign (the sign bits differ)
inline V8 written8(V8 p, V8 r) {
  const __m256i sign = _mm256_srai_epi32(_mm256_xor_si256(_mm256_castps_si256(p.x), _mm256_castps_si256(r.x)), 31);
  return _mm256_or_ps(_mm256_cmp_ps(p.x, r.x, _CMP_NEQ_UQ), _mm256_castsi256_ps(sign));
}
// The master-sync test, written(p, round(w)), per lane.
template <typename P> inline V8 stale8(V8 p, V8 w) { return written8(p, widen8(P(), half_bits8(P(), w))); }
template <> inline V8 stale8<float>(V8 p, V8 w) { return written8(p, w); }
template <> inline V8 stale8<at::BFloat16>(V8 p, V8 w) {
  // round(w) kept in float32 bits (no packing); a nan w is stale whatever those bits are
  const __m256i r = _mm256_and_si256(bf16_round_up8(_mm256_castps_si256(w.x)),
                                     _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm256_or_ps(written8(p, _mm256_castsi256_ps(r)).x, _mm256_cmp_ps(w.x, w.x, _CMP_UNORD_Q));
}
// +-0, nan or +-inf: no split remainder is kept over them (encodings._split_decode)
inline V8 no_remainder8(V8 p) {
  const __m256i e = _mm256_and_si256(_mm256_castps_si256(p.x), _mm256_set1_epi32(0x7F800000));
  return _mm256_or_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_set1_epi32(0x7F800000))),
                      _mm256_cmp_ps(p.x, _mm256_setzero_ps(), _CMP_EQ_OQ));
}
inline V8 select8(V8 take_b, V8 a, V8 b) { return _mm256_blendv_ps(a.x, b.x, take_b.x); }
#endif

using std::sqrt;

template <typename V>
struct Coefficients {
  V decay_factor, l2, step_size, sqrt_bias_correction2, one_minus_beta1, beta2, one_minus_beta2, eps, grad_scale;
  explicit Coefficients(const float* c)
      : decay_factor(c[0]), l2(c[1]), step_size(c[2]), sqrt_bias_correction2(c[3]), one_minus_beta1(c[4]),
        beta2(c[5]), one_minus_beta2(c[6]), eps(c[7]), grad_scale(c[8]) {}
};

// halfadam.functional.adam_elementwise_, one lane (or 8) at a time
template <bool L2, bool OPTIMIZED, typename V>
inline void adam_lanes(V& w, V g, V& m, V& v, const Coefficients<V>& c) {
  if (L2) g = g + c.l2 * w; else w = w * c.decay_factor;
  m = m + (g - m) * c.one_minus_beta1;
  v = v * c.beta2 + (g * c.one_minus_beta2) * g;
  const V d = OPTIMIZED ? sqrt(v) + c.eps : sqrt(v) / c.sqrt_bias_correction2 + c.eps;
  w = w - (m / d) * c.step_size;
}

// ---------------------------------------------------------------- state encodings (halfadam.encodings)
enum class Master { kNone, kFp32, kSplit };
constexpr int64_t BLOCK = 128;  // encodings.BLOCK

// encodings._random_bits of an element's position x with the seed folded in:
// seed_term = (step * 0x27D4EB2F + salt) mod 2**32
inline uint32_t hash1(uint32_t x, uint32_t seed_term) {
  uint32_t h = x ^ seed_term;
  h = (h ^ (h >> 16)) * 0x7FEB352Du;
  h = (h ^ (h >> 15)) * 0x2C1B3C6Du;
  h = (h ^ (h >> 16)) * 0x297A2D39u;
  return h ^ (h >> 15);
}
// encodings._encode_moment_ for bfloat16: add 16 random bits below bf16's, truncate
// (position: the element's index in its parameter)
inline void store_moment1(float* p, float x, uint32_t, uint32_t) { *p = x; }
inline void store_moment1(at::BFloat16* p, float x, uint32_t seed_term, uint32_t position) {
  const uint32_t u = float_to_bits(x);
  p->x = static_cast<uint16_t>((u + (hash1(position, seed_term) >> 16)) >> 16);
}
// encodings._fp16_ulp: 2**(max(e, -14) - 10) for |x| in [2**e, 2**(e+1)), from x's float32 bits
inline float fp16_ulp1(float x) {
  const int32_t e = std::max<int32_t>(static_cast<int32_t>((float_to_bits(x) >> 23) & 0xFF), 127 - 14);
  return bits_to_float(static_cast<uint32_t>(e - 10) << 23);
}
// encodings._split_decode for one element, before the master-sync check: p + remainder r
inline float split_decode1(at::BFloat16, float p, int32_t r) {
  return bits_to_float(float_to_bits(p) + static_cast<uint32_t>(r));
}
inline float split_decode1(at::Half, float p, int32_t r) {
  return p + static_cast<float>(r) * (fp16_ulp1(p) * (1.0f / 65536.0f));
}
// encodings._split_remainder of w over its rounding rounded (a float32 holding the fp16/bf16 value)
inline int32_t split_remainder1(at::BFloat16, float w, float rounded) {
  return static_cast<int32_t>(float_to_bits(w) - float_to_bits(rounded));
}
inline int32_t split_remainder1(at::Half, float w, float rounded) {
  if (!std::isfinite(rounded)) return 0;
  return static_cast<int32_t>(std::nearbyint((w - rounded) / fp16_ulp1(rounded) * 65536.0f));
}

#ifdef HALFADAM_AVX2
inline __m256i hash8(__m256i x, __m256i seed_term) {
  __m256i h = _mm256_xor_si256(x, seed_term);
  h = _mm256_mullo_epi32(_mm256_xor_si256(h, _mm256_srli_epi32(h, 16)), _mm256_set1_epi32(0x7FEB352D));
  h = _mm256_mullo_epi32(_mm256_xor_si256(h, _mm256_srli_epi32(h, 15)), _mm256_set1_epi32(0x2C1B3C6D));
  h = _mm256_mullo_epi32(_mm256_xor_si256(h, _mm256_srli_epi32(h, 16)), _mm256_set1_epi32(0x297A2D39));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
}
inline void store_moment8(float* p, V8 x, __m256i, __m256i) { store8(p, x); }
inline void store_moment8(at::BFloat16* p, V8 x, __m256i seed_term, __m256i positions) {
  const __m256i u = _mm256_castps_si256(x.x);
  const __m256i t = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_srli_epi32(hash8(positions, seed_term), 16)), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1)));
}
inline V8 fp16_ulp8(V8 x) {
  __m256i e = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x.x), 23), _mm256_set1_epi32(0xFF));
  e = _mm256_max_epi32(e, _mm256_set1_epi32(127 - 14));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(10)), 23));
}
inline V8 split_decode8(at::BFloat16, V8 p, __m256i r) {
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p.x), r));
}
inline V8 split_decode8(at::Half, V8 p, __m256i r) {
  return p + V8(_mm256_cvtepi32_ps(r)) * (fp16_ulp8(p) * V8(1.0f / 65536.0f));
}
inline __m256i split_remainder8(at::BFloat16, V8 w, V8 rounded) {
  return _mm256_sub_epi32(_mm256_castps_si256(w.x), _mm256_castps_si256(rounded.x));
}
inline __m256i split_remainder8(at::Half, V8 w, V8 rounded) {
  const V8 q = (w - rounded) / fp16_ulp8(rounded) * V8(65536.0f);
  const __m256i r = _mm256_cvtps_epi32(_mm256_round_ps(q.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // finite: exponent bits not all ones
  const __m256i exp_bits = _mm256_and_si256(_mm256_castps_si256(rounded.x), _mm256_set1_epi32(0x7F800000));
  const __m256i nonfinite = _mm256_cmpeq_epi32(exp_bits, _mm256_set1_epi32(0x7F800000));
  return _mm256_andnot_si256(nonfinite, r);
}
#endif

struct Item {
  void* param;
  const void* grad;
  int64_t numel;
  int64_t offset;  // into the flat state buffers (a multiple of BLOCK with a split master)
};

struct Step {
  float* master;            // fp32 master weights (Master::kFp32)
  int8_t* master_hi;        // split master (Master::kSplit): remainder bytes and per-block tie lane + 1
  uint8_t* master_lo;
  uint8_t* master_tie;
  void* exp_avg;            // float32 or bfloat16 (MA), float32 or bfloat16 (MV)
  void* exp_avg_sq;
  float c[9];               // adam_coefficients, then the gradient scale (1 without one: g * 1 == g exactly)
  uint32_t seed_exp_avg, seed_exp_avg_sq;  // hash seeds of the bfloat16 moments' stochastic rounding
};

// Elements a..b (a a multiple of BLOCK) of one parameter. P: the parameter's dtype, G: the gradient's,
// MS: how the master is kept (kNone: the parameter, float32, is the weight), MA / MV: exp_avg's and
// exp_avg_sq's dtypes.
template <typename P, typename G, Master MS, typename MA, typename MV, bool L2, bool OPTIMIZED>
void run(const Step& s, const Item& it, int64_t a, int64_t b) {
  P* param = static_cast<P*>(it.param);
  const G* grad = static_cast<const G*>(it.grad);
  MA* m = static_cast<MA*>(s.exp_avg) + it.offset;
  MV* v = static_cast<MV*>(s.exp_avg_sq) + it.offset;
  float* master = MS == Master::kFp32 ? s.master + it.offset : nullptr;
  const Coefficients<float> c1(s.c);
#ifdef HALFADAM_AVX2
  const Coefficients<V8> c8(s.c);
  const __m256i seed_m = _mm256_set1_epi32(static_cast<int>(s.seed_exp_avg));
  const __m256i seed_v = _mm256_set1_epi32(static_cast<int>(s.seed_exp_avg_sq));
#endif
  for (int64_t start = a; start < b; start += BLOCK) {
    const int64_t end = std::min(start + BLOCK, b);
    int32_t tie_lane = -1;   // split: the lane whose remainder is +2**15 (decode)
    int32_t first_tie = -1;  // split: the first new remainder of +2**15 (encode)
    if constexpr (MS == Master::kSplit) tie_lane = static_cast<int32_t>(s.master_tie[(it.offset + start) / BLOCK]) - 1;
    int64_t i = start;
#ifdef HALFADAM_AVX2
    for (; i + 8 <= end; i += 8) {
      V8 w, mi = load8(m + i), vi = load8(v + i);
      const V8 g = load8(grad + i) * c8.grad_scale;
      if constexpr (MS == Master::kNone) {
        w = load8(reinterpret_cast<float*>(param) + i);
      } else {
        const V8 p = load8(param + i);
        if constexpr (MS == Master::kFp32) {
          w = load8(master + i);
        } else {  // r = hi * 256 + lo + 65536 in the block's tie lane
          const int64_t j = it.offset + i;
          __m256i r = _mm256_add_epi32(
              _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s.master_hi + j))), 8),
              _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s.master_lo + j))));
          const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(i - start)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
          r = _mm256_add_epi32(r, _mm256_and_si256(_mm256_cmpeq_epi32(lane, _mm256_set1_epi32(tie_lane)),
                                                   _mm256_set1_epi32(65536)));
          w = split_decode8(P(), p, r);
          w = select8(no_remainder8(p), w, p);  // no remainder over +-0, nan or inf
        }
        w = select8(stale8<P>(p, w), w, p);  // master sync
      }
      adam_lanes<L2, OPTIMIZED>(w, g, mi, vi, c8);
      const __m256i positions = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(i)),
                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      store_moment8(m + i, mi, seed_m, positions);
      store_moment8(v + i, vi, seed_v, positions);
      if constexpr (MS == Master::kFp32) store8(master + i, w);
      if constexpr (MS == Master::kSplit) {  // round once: the parameter's bits, and the remainder over them
        const __m128i bits = half_bits8(P(), w);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(param + i), bits);
        const __m256i r = split_remainder8(P(), w, widen8(P(), bits));
        // the tie rule: the block's first remainder of +2**15 is stored as -2**15 (flagged by the tie
        // byte), any other is clamped to 2**15 - 1 with the rest
        __m256i q = _mm256_min_epi32(_mm256_max_epi32(r, _mm256_set1_epi32(-32768)), _mm256_set1_epi32(32767));
        const int ties = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(r, _mm256_set1_epi32(32768))));
        if (ties != 0 && first_tie < 0) {
          const int lane = __builtin_ctz(ties);
          first_tie = static_cast<int32_t>(i - start) + lane;
          const __m256i at = _mm256_cmpeq_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(lane));
          q = _mm256_blendv_epi8(q, _mm256_set1_epi32(-32768), at);
        }
        const __m256i hi = _mm256_srai_epi32(q, 8), lo = _mm256_and_si256(q, _mm256_set1_epi32(255));
        const __m128i hi16 = _mm_packs_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
        const __m128i lo16 = _mm_packs_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(s.master_hi + it.offset + i), _mm_packs_epi16(hi16, hi16));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(s.master_lo + it.offset + i), _mm_packus_epi16(lo16, lo16));
      } else {
        store8(param + i, w);
      }
    }
#endif
    for (; i < end; ++i) {
      float w, mi = load1(m + i), vi = load1(v + i);
      const float g = load1(grad + i) * c1.grad_scale;
      if constexpr (MS == Master::kNone) {
        w = reinterpret_cast<float*>(param)[i];
      } else {
        const float p = load1(param + i);
        if constexpr (MS == Master::kFp32) {
          w = master[i];
        } else {
          const int64_t j = it.offset + i;
          const int32_t r = static_cast<int32_t>(s.master_hi[j]) * 256 + static_cast<int32_t>(s.master_lo[j]) +
                            (i - start == tie_lane ? 65536 : 0);
          w = split_decode1(P(), p, r);
          if (!std::isfinite(p) || p == 0.0f) w = p;  // no remainder over +-0, nan or inf
        }
        w = select1(written1(p, round1<P>(w)), w, p);  // master sync
      }
      adam_lanes<L2, OPTIMIZED>(w, g, mi, vi, c1);
      store_moment1(m + i, mi, s.seed_exp_avg, static_cast<uint32_t>(i));
      store_moment1(v + i, vi, s.seed_exp_avg_sq, static_cast<uint32_t>(i));
      if constexpr (MS == Master::kFp32) master[i] = w;
      store1(param + i, w);
      if constexpr (MS == Master::kSplit) {  // the tie rule, as above
        int32_t r = split_remainder1(P(), w, load1(param + i));
        if (r == 32768 && first_tie < 0) {
          first_tie = static_cast<int32_t>(i - start);
          r = -32768;
        }
        r = std::min(std::max(r, -32768), 32767);
        s.master_hi[it.offset + i] = static_cast<int8_t>(r >> 8);
        s.master_lo[it.offset + i] = static_cast<uint8_t>(r & 255);
      }
    }
    if constexpr (MS == Master::kSplit)
      s.master_tie[(it.offset + start) / BLOCK] = static_cast<uint8_t>(first_tie + 1);  // 0: no tie in the block
  }
}

using RunFn = void (*)(const Step&, const Item&, int64_t, int64_t);

template <typename P, typename G, Master MS, typename MA, typename MV>
RunFn pick_update(bool l2, bool optimized) {
  return l2 ? (optimized ? &run<P, G, MS, MA, MV, true, true> : &run<P, G, MS, MA, MV, true, false>)
            : (optimized ? &run<P, G, MS, MA, MV, false, true> : &run<P, G, MS, MA, MV, false, false>);
}

// Gradients are float32 or the parameter's dtype (adam_step converts others first).
template <typename P, Master MS, typename MA, typename MV>
RunFn pick_grad(bool float_grad, bool l2, bool optimized) {
  return float_grad ? pick_update<P, float, MS, MA, MV>(l2, optimized) : pick_update<P, P, MS, MA, MV>(l2, optimized);
}

// Callers check supported() first: any other dtype never reaches these switches.
template <typename MA, typename MV>
RunFn pick_param(at::ScalarType param, bool float_grad, Master ms, bool l2, bool optimized) {
  if (param == at::kFloat)  // float32 parameters: no master, or an fp32 one (master_weights=True)
    return ms == Master::kNone ? pick_update<float, float, Master::kNone, MA, MV>(l2, optimized)
                               : pick_update<float, float, Master::kFp32, MA, MV>(l2, optimized);
  if (param == at::kHalf)
    return ms == Master::kSplit ? pick_grad<at::Half, Master::kSplit, MA, MV>(float_grad, l2, optimized)
                                : pick_grad<at::Half, Master::kFp32, MA, MV>(float_grad, l2, optimized);
  return ms == Master::kSplit ? pick_grad<at::BFloat16, Master::kSplit, MA, MV>(float_grad, l2, optimized)
                              : pick_grad<at::BFloat16, Master::kFp32, MA, MV>(float_grad, l2, optimized);
}

RunFn pick(at::ScalarType exp_avg, at::ScalarType exp_avg_sq, at::ScalarType param, bool float_grad, Master ms,
           bool l2, bool optimized) {
  const bool a16 = exp_avg == at::kBFloat16, v16 = exp_avg_sq == at::kBFloat16;
  if (a16 && v16) return pick_param<at::BFloat16, at::BFloat16>(param, float_grad, ms, l2, optimized);
  if (a16) return pick_param<at::BFloat16, float>(param, float_grad, ms, l2, optimized);
  if (v16) return pick_param<float, at::BFloat16>(param, float_grad, ms, l2, optimized);
  return pick_param<float, float>(param, float_grad, ms, l2, optimized);
}

bool supported(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

uint32_t seed_term(int64_t step, uint32_t salt) {
  return static_cast<uint32_t>(static_cast<uint64_t>(step) * 0x27D4EB2Full + salt);
}

}  // namespace

// One step for params[k] (gradient grads[k], state at offsets[k] of the flat buffers in `state`, keyed
// as halfadam.encodings names them), k = 0..K-1. `step` seeds the stochastic rounding.
void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::map<std::string, at::Tensor>& state, const std::vector<int64_t>& offsets,
               const std::vector<double>& coefficients, const c10::optional<at::Tensor>& grad_scale, bool l2,
               bool optimized_update, int64_t step) {
  const int64_t K = static_cast<int64_t>(params.size());
  TORCH_CHECK(static_cast<int64_t>(grads.size()) == K && static_cast<int64_t>(offsets.size()) == K,
              "adam_step: params, grads and offsets differ in length");
  TORCH_CHECK(coefficients.size() == 8, "adam_step: expected 8 coefficients");
  auto get = [&](const char* key, at::ScalarType dtype) -> at::Tensor {  // undefined if absent
    auto found = state.find(key);
    if (found == state.end()) return at::Tensor();
    const at::Tensor& t = found->second;
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.dim() == 1,
                "adam_step: state['", key, "'] must be a contiguous 1-D ", dtype, " CPU tensor");
    return t;
  };
  auto moment_dtype = [&](const char* key) {
    const auto found = state.find(key);
    TORCH_CHECK(found != state.end() && (found->second.scalar_type() == at::kFloat ||
                                         found->second.scalar_type() == at::kBFloat16),
                "adam_step: state['", key, "'] must be float32 or bfloat16");
    return found->second.scalar_type();
  };
  const at::ScalarType adtype = moment_dtype("exp_avg"), vdtype = moment_dtype("exp_avg_sq");
  const at::Tensor exp_avg = get("exp_avg", adtype), exp_avg_sq = get("exp_avg_sq", vdtype);
  const int64_t total_state = exp_avg.numel();
  TORCH_CHECK(exp_avg_sq.numel() == total_state, "adam_step: exp_avg and exp_avg_sq differ in length");
  const at::Tensor master = get("master_weight", at::kFloat);
  const at::Tensor hi = get("master_hi", at::kChar), lo = get("master_lo", at::kByte);
  const at::Tensor tie = get("master_tie", at::kByte);
  const Master ms = master.defined() ? Master::kFp32 : lo.defined() ? Master::kSplit : Master::kNone;
  if (ms == Master::kFp32) TORCH_CHECK(master.numel() == total_state, "adam_step: master_weight's length");
  if (ms == Master::kSplit)
    TORCH_CHECK(hi.defined() && tie.defined() && hi.numel() == total_state && lo.numel() == total_state &&
                    tie.numel() * BLOCK == total_state,
                "adam_step: a split master needs master_hi, master_lo (one per element) and master_tie (one per block)");
  for (const auto& kv : state)
    TORCH_CHECK(kv.first == "master_weight" || kv.first == "master_hi" || kv.first == "master_lo" ||
                    kv.first == "master_tie" || kv.first == "exp_avg" || kv.first == "exp_avg_sq",
                "adam_step: unsupported state entry '", kv.first, "'");

  Step s{};
  s.master = ms == Master::kFp32 ? master.data_ptr<float>() : nullptr;
  s.master_hi = ms == Master::kSplit ? hi.data_ptr<int8_t>() : nullptr;
  s.master_lo = ms == Master::kSplit ? lo.data_ptr<uint8_t>() : nullptr;
  s.master_tie = ms == Master::kSplit ? tie.data_ptr<uint8_t>() : nullptr;
  s.exp_avg = exp_avg.data_ptr();
  s.exp_avg_sq = exp_avg_sq.data_ptr();
  for (int j = 0; j < 8; ++j) s.c[j] = static_cast<float>(coefficients[j]);
  s.c[8] = grad_scale.has_value() && grad_scale->defined() ? grad_scale->item<float>() : 1.0f;
  s.seed_exp_avg = seed_term(step, 0x3C6EF372u);     // encodings._SALT
  s.seed_exp_avg_sq = seed_term(step, 0x1B873593u);

  // Validate everything before writing anything; non-contiguous tensors go through contiguous copies.
  std::vector<Item> items(K);
  std::vector<RunFn> fns(K);
  std::vector<int64_t> starts(K + 1, 0);  // in blocks of BLOCK elements
  std::vector<at::Tensor> keep;                                // contiguous float32 copies of grads
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;   // (param, its contiguous copy)
  for (int64_t k = 0; k < K; ++k) {
    at::Tensor p = params[k], g = grads[k];
    const int64_t n = p.numel();
    TORCH_CHECK(p.device().is_cpu() && g.device().is_cpu(), "adam_step: params[", k, "] or its grad is not on the CPU");
    TORCH_CHECK(supported(p.scalar_type()) && at::isFloatingType(g.scalar_type()), "adam_step: params[", k, "] (",
                p.scalar_type(), ") or its gradient (", g.scalar_type(), "): parameters float32, float16 or bfloat16, "
                "gradients floating point");
    TORCH_CHECK(ms != Master::kNone || p.scalar_type() == at::kFloat, "adam_step: params[", k,
                "]: float16/bfloat16 parameters need a master");
    TORCH_CHECK(ms != Master::kSplit || p.scalar_type() != at::kFloat, "adam_step: params[", k,
                "]: a split master needs a float16/bfloat16 parameter");
    TORCH_CHECK(g.numel() == n, "adam_step: grads[", k, "] has ", g.numel(), " elements, its parameter ", n);
    TORCH_CHECK(offsets[k] >= 0 && offsets[k] + n <= total_state && (ms != Master::kSplit || offsets[k] % BLOCK == 0),
                "adam_step: offsets[", k, "] out of range or not block-aligned");
    if (g.scalar_type() != at::kFloat && g.scalar_type() != p.scalar_type()) {  // float64, fp16 for bf16...
      g = g.to(at::kFloat).contiguous();
      keep.push_back(g);
    } else if (!g.is_contiguous()) {
      g = g.contiguous();
      keep.push_back(g);
    }
    if (!p.is_contiguous()) {
      at::Tensor c = p.contiguous();
      write_back.emplace_back(p, c);
      p = c;
    }
    items[k] = Item{p.data_ptr(), g.data_ptr(), n, offsets[k]};
    fns[k] = pick(adtype, vdtype, p.scalar_type(), g.scalar_type() == at::kFloat, ms, l2, optimized_update);
    starts[k + 1] = starts[k] + (n + BLOCK - 1) / BLOCK;
  }
  {
    pybind11::gil_scoped_release no_gil;
    at::parallel_for(0, starts[K], GRAIN / BLOCK, [&](int64_t begin, int64_t end) {
      int64_t k = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
      for (int64_t u = begin; u < end; ++k) {
        const int64_t stop = std::min(end, starts[k + 1]);
        if (stop > u)
          fns[k](s, items[k], (u - starts[k]) * BLOCK, std::min(items[k].numel, (stop - starts[k]) * BLOCK));
        u = stop;
      }
    });
  }
  for (auto& pc : write_back) pc.first.copy_(pc.second);
  for (const auto& p : params) torch::autograd::impl::bump_version(p);  // as an in-place op would
}

// The index of the first (param, grad) pair that halfadam.optimizer's Python checks would reject
// (gradient not dense, not floating point, of another shape or device; parameter with elements that
// share memory), or -1: the step's validation in one call instead of several attribute reads per tensor.
int64_t first_invalid(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads) {
  TORCH_CHECK(params.size() == grads.size(), "first_invalid: params and grads differ in length");
  for (size_t k = 0; k < params.size(); ++k) {
    const at::Tensor& p = params[k];
    const at::Tensor& g = grads[k];
    if (!g.defined() || g.layout() != at::kStrided || !at::isFloatingType(g.scalar_type()) || g.sizes() != p.sizes() ||
        g.device() != p.device())
      return static_cast<int64_t>(k);
    if (!p.is_contiguous())
      for (int64_t d = 0; d < p.dim(); ++d)
        if (p.stride(d) == 0 && p.size(d) > 1) return static_cast<int64_t>(k);
  }
  return -1;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam_step", &adam_step, "halfadam: one Adam/AdamW step over a list of parameters with flat state buffers");
  m.def("first_invalid", &first_invalid, "halfadam: index of the first invalid (param, grad) pair, or -1");
}
