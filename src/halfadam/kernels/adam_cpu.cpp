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
// moment is float32, bfloat16 (decoded exactly, encoded by stochastic rounding with
// encodings._random_bits' hash of the element's position in its parameter, the step and a salt) or
// uint8 with one float32 absmax per block (encodings._decode_moment / _encode_moment_: the dynamic
// map's nearest value for exp_avg, stochastic rounding between log2 levels for exp_avg_sq, nan and
// inf in flagged blocks; see "uint8 moments" below).
// Gradients are float32 or the parameter's dtype (adam_step converts any other floating dtype).
//
// Work is split over torch's intra-op threads (at::parallel_for) by 128-element blocks across the list.
// Each element is read and written once, in one loop: 8 lanes at a time with AVX2 (F16C converts
// float16, integer ops round bfloat16), one at a time for the tail and on other CPUs (a uint8
// moment's block goes through a float buffer in L1: decoded before the loop, encoded after it).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <type_traits>
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
inline __m256i nonfinite8(V8 x) {  // all bits set where x is nan or +-inf (exponent bits all ones)
  const __m256i exp_bits = _mm256_and_si256(_mm256_castps_si256(x.x), _mm256_set1_epi32(0x7F800000));
  return _mm256_cmpeq_epi32(exp_bits, _mm256_set1_epi32(0x7F800000));
}
inline V8 no_remainder8(V8 p) {
  return _mm256_or_ps(_mm256_castsi256_ps(nonfinite8(p)), _mm256_cmp_ps(p.x, _mm256_setzero_ps(), _CMP_EQ_OQ));
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
  if (!std::isfinite(rounded)) return 0;  // never decoded; 0 whatever the nan pattern
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
  return _mm256_andnot_si256(nonfinite8(rounded), _mm256_sub_epi32(_mm256_castps_si256(w.x), _mm256_castps_si256(rounded.x)));
}
inline __m256i split_remainder8(at::Half, V8 w, V8 rounded) {
  const V8 q = (w - rounded) / fp16_ulp8(rounded) * V8(65536.0f);
  const __m256i r = _mm256_cvtps_epi32(_mm256_round_ps(q.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return _mm256_andnot_si256(nonfinite8(rounded), r);
}
#endif

// ---------------------------------------------------------------- uint8 moments (_decode_moment, _encode_moment_)
// One block of BLOCK elements at a time, through a float buffer: the block is decoded (table value
// times |absmax|), the update runs on the buffer as on float32 moments, then the block is encoded:
// absmax over the finite values, y = x / absmax (a division, as encodings.py's), the code, and the
// absmax stored with its sign bit set where the block holds a nan or an inf (a "flagged" block, with
// reserved codes for them). The code is defined by exact float32 comparisons with the tables
// (encodings._dynamic_nearest's rule, and the largest exp_avg_sq level <= y): the decade found by
// comparisons and a log2 estimate from the exponent bits and a polynomial only pick the candidates,
// so the bytes are encodings.py's whatever either side's log10/log2 rounds to. Flagged blocks take
// the scalar path (rare: a nan or inf gradient); others are encoded 8 lanes at a time.
struct Tables {  // encodings.tables(), float32 values copied bit for bit, and the estimates' constants
  alignas(32) float dyn[256];      // the signed dynamic map (exp_avg: index = (code + 127) & 255)
  alignas(32) float dyn_by_code[256];  // dyn[(code + 127) & 255]
  alignas(32) float levels[264];   // exp_avg_sq levels by code; [256..]: 1.0
  float decades[7];                // 10**(i - 6): the decade thresholds
  // per decade i: its levels' coordinate tk = a * k_slope[i] + k_offset[i] ((a / 10**(i-6) - 0.1) * 2**i / 0.9
  // - 0.5: level k at tk = k), and 2**i
  alignas(32) float k_slope[8], k_offset[8], pow2[8];
  alignas(32) float below_mid[8];  // per decade i: the midpoint of its lowest value and the one below it
  float top_mid;                   // the midpoint of the largest value below 1.0 and 1.0
};

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();  // 0x7FC00000, torch's math.nan
// log2(1 + f) ~ f * (C[0] + C[1] f + C[2] f^2 + C[3] f^3 + C[4] f^4) on [0, 1), |error| < 3e-5 (a
// least-squares fit; 3e-4 of a code), evaluated as f * ((C[0] + C[1] f) + f^2 (C[2] + C[3] f) + f^4 C[4])
constexpr float kLog2C[5] = {1.4418258666992188f, -0.7086828351020813f, 0.4154243767261505f, -0.19442591071128845f,
                             0.04588700830936432f};
constexpr float kCodesPerOctave = 254.0f / 24.0f;  // encodings.V_OCTAVES

#ifdef HALFADAM_AVX2
inline void store_codes8(uint8_t* p, __m256i c) {  // 8 values in 0..255 -> 8 bytes
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
}
// table[index] and table[index + 1] per lane: eight 8-byte loads (AVX2's gathers are 3x slower on the
// AMD Zen 3 this was measured on)
inline void load_pairs8(const float* table, __m256i index, __m256* at, __m256* next) {
  const __m128i lo = _mm256_castsi256_si128(index), hi = _mm256_extracti128_si256(index, 1);
  const uint64_t q[4] = {static_cast<uint64_t>(_mm_cvtsi128_si64(lo)), static_cast<uint64_t>(_mm_extract_epi64(lo, 1)),
                         static_cast<uint64_t>(_mm_cvtsi128_si64(hi)), static_cast<uint64_t>(_mm_extract_epi64(hi, 1))};
  __m128 pair[4];  // lanes 2j, 2j + 1: (table[i], table[i + 1]) twice
  for (int j = 0; j < 4; ++j) {
    const __m128 low = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(table + static_cast<uint32_t>(q[j]))));
    pair[j] = _mm_loadh_pi(low, reinterpret_cast<const __m64*>(table + (q[j] >> 32)));
  }
  const __m256 ac = _mm256_set_m128(pair[2], pair[0]), bd = _mm256_set_m128(pair[3], pair[1]);
  *at = _mm256_shuffle_ps(ac, bd, _MM_SHUFFLE(2, 0, 2, 0));
  *next = _mm256_shuffle_ps(ac, bd, _MM_SHUFFLE(3, 1, 3, 1));
}
inline __m256 load_codes8(const float* table, const uint8_t* c) {  // table[c[0..7]]
  const __m128 lo = _mm_setr_ps(table[c[0]], table[c[1]], table[c[2]], table[c[3]]);
  const __m128 hi = _mm_setr_ps(table[c[4]], table[c[5]], table[c[6]], table[c[7]]);
  return _mm256_set_m128(hi, lo);
}

#endif

// encodings._dynamic_nearest for one y in [-1, 1]: the index j in 127..255 with the smallest float32
// |dyn[j] - |y||, ties to the lower index, mirrored (max(254 - j, 0)) for y < 0. c is the nearer of
// the two map values around |y| (its coordinate is within 2e-5 of a spacing), so c - 1, c, c + 1 hold both.
inline int32_t dyn_nearest1(float y, const Tables& t) {
  const float a = std::fabs(y);
  int i = 0;
  for (int d = 0; d < 6; ++d) i += a >= t.decades[d] ? 1 : 0;
  float k = std::nearbyint(a * t.k_slope[i] + t.k_offset[i]);
  k = std::min(std::max(k, 0.0f), t.pow2[i] - 1.0f);
  const int32_t c = 127 + (1 << i) + static_cast<int32_t>(k);  // 128..254
  int32_t best = c - 1;
  float best_err = std::fabs(t.dyn[best] - a);
  for (int32_t j = c; j <= c + 1; ++j) {
    const float err = std::fabs(t.dyn[j] - a);
    if (err < best_err) best = j, best_err = err;
  }
  return y < 0.0f ? std::max(254 - best, 0) : best;
}
// floor(255 + log2(y) * 254 / 24) clamped to 1..254, estimated (within one code of the exact one)
inline int32_t level_estimate1(float y) {
  const uint32_t u = float_to_bits(y);
  const float f = bits_to_float((u & 0x7FFFFFu) | 0x3F800000u) - 1.0f;
  const float f2 = f * f;
  const float l = static_cast<float>(static_cast<int32_t>((u >> 23) & 0xFFu) - 127) +
                  f * ((kLog2C[0] + kLog2C[1] * f) + f2 * (kLog2C[2] + kLog2C[3] * f) + (f2 * f2) * kLog2C[4]);
  return static_cast<int32_t>(std::min(std::max(std::floor(255.0f + l * kCodesPerOctave), 1.0f), 254.0f));
}
// the largest code in 1..254 whose level is <= y (1 below the range), at least `lowest`
inline int32_t level_code1(float y, int32_t lowest, const Tables& t) {
  int32_t lo = level_estimate1(y);
  lo += (t.levels[lo + 1] <= y ? 1 : 0) - (t.levels[lo] > y ? 1 : 0);
  return std::max(std::min(std::max(lo, 1), 254), lowest);
}

// Decode n elements of one block (stored absmax `absmax`) into out.
template <bool EXP_AVG>
void decode_block(const uint8_t* codes, float absmax, int64_t n, float* out, const Tables& t) {
  const float* table = EXP_AVG ? t.dyn : t.levels;
  const int32_t shift = EXP_AVG ? 127 : 0;  // exp_avg stores (index - 127) & 255: code 0 is 0.0
  const float scale = std::fabs(absmax);
  const bool flagged = std::signbit(absmax);
  int64_t j = 0;
#ifdef HALFADAM_AVX2
  if (!flagged) {
    const float* by_code = EXP_AVG ? t.dyn_by_code : t.levels;
    const V8 vscale(scale);
    for (; j + 8 <= n; j += 8) store8(out + j, V8(load_codes8(by_code, codes + j)) * vscale);
  }
#endif
  for (; j < n; ++j) {
    const int32_t index = (static_cast<int32_t>(codes[j]) + shift) & 255;
    float x = table[index] * scale;
    if (flagged) {  // encodings._NONFINITE
      if (EXP_AVG) x = index == 128 ? kInf : index == 126 ? -kInf : index == 129 ? kNaN : x;
      else x = index == 1 ? kInf : index == 2 ? kNaN : x;
    }
    out[j] = x;
  }
}

// The block's absmax over its finite values, and whether it holds a nan or an inf.
inline float block_absmax(const float* x, bool* flagged) {
  float absmax = 0.0f;
  bool nonfinite = false;
  int64_t j = 0;
#ifdef HALFADAM_AVX2
  __m256 mx = _mm256_setzero_ps();
  __m256i bad = _mm256_setzero_si256();
  for (; j + 8 <= BLOCK; j += 8) {
    const __m256i bits = _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(x + j)), _mm256_set1_epi32(0x7FFFFFFF));
    const __m256i finite = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800000), bits);
    mx = _mm256_max_ps(mx, _mm256_castsi256_ps(_mm256_and_si256(bits, finite)));
    bad = _mm256_or_si256(bad, _mm256_andnot_si256(finite, _mm256_set1_epi32(-1)));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  absmax = _mm_cvtss_f32(h);
  nonfinite = !_mm256_testz_si256(bad, bad);
#endif
  for (; j < BLOCK; ++j) {
    if (std::isfinite(x[j])) absmax = std::max(absmax, std::fabs(x[j]));
    else nonfinite = true;
  }
  *flagged = nonfinite;
  return absmax;
}

// encodings._encode_moment_ for one block, element by element (any block, flagged ones included)
template <bool EXP_AVG>
void encode_block1(const float* x, uint8_t* codes, float den, bool flagged, uint32_t position0, uint32_t seed_term,
                   const Tables& t) {
  for (int64_t j = 0; j < BLOCK; ++j) {
    const float xj = x[j];
    const bool finite = std::isfinite(xj);
    const float xf = finite ? xj : 0.0f;
    const float y = xf / den;
    int32_t code;
    if (EXP_AVG) {
      int32_t index = dyn_nearest1(y, t);
      if (flagged && (index == 126 || index == 128 || index == 129)) index = 127;  // reserved: to 0.0
      if (!finite) index = xj == kInf ? 128 : xj == -kInf ? 126 : 129;
      code = (index - 127) & 255;
    } else {  // stochastic rounding between the level below y and the next; nonzero never to 0
      const int32_t lo = level_code1(y, flagged ? 3 : 1, t);  // codes 1, 2 mean inf, nan in a flagged block
      const float v_lo = t.levels[lo], v_hi = t.levels[lo + 1];
      const float p = std::min(std::max((y - v_lo) / (v_hi - v_lo), 0.0f), 1.0f);
      const uint32_t bits = hash1(position0 + static_cast<uint32_t>(j), seed_term);
      const float u = static_cast<float>(bits >> 8) * (1.0f / 16777216.0f);  // encodings._uniform
      code = xf > 0.0f ? lo + (u < p ? 1 : 0) : 0;
      if (!finite) code = xj == kInf ? 1 : 2;
    }
    codes[j] = static_cast<uint8_t>(code);
  }
}

#ifdef HALFADAM_AVX2
// encode_block1's exp_avg codes for a block without nan or inf, 8 lanes at a time, with no table: away
// from the midpoint between two map values (more than 1e-3 of their spacing inside a decade, 1e-4
// relative at a decade's edge, where the computed coordinate's error is below 2e-5 and 1e-7) the
// nearest value is the one on its side, whatever the float32 distances round to; 8 lanes with one
// nearer a midpoint (about 1 in 60) take dyn_nearest1, which compares the distances.
inline void encode_exp_avg8(const float* x, uint8_t* codes, float den, const Tables& t) {
  const __m256 vden = _mm256_set1_ps(den), sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
  const __m256 k_slope = _mm256_load_ps(t.k_slope), k_offset = _mm256_load_ps(t.k_offset);
  const __m256 pow2 = _mm256_load_ps(t.pow2), below_mid = _mm256_load_ps(t.below_mid);
  const __m256 top_mid = _mm256_set1_ps(t.top_mid);
  __m256 decade[6];
  for (int d = 0; d < 6; ++d) decade[d] = _mm256_set1_ps(t.decades[d]);
  for (int64_t j = 0; j < BLOCK; j += 8) {
    const __m256 y = _mm256_div_ps(_mm256_loadu_ps(x + j), vden);
    const __m256 a = _mm256_andnot_ps(sign, y);
    __m256i ge[6];  // the decade: how many thresholds a reaches (masks are -1), summed as a tree
    for (int d = 0; d < 6; ++d) ge[d] = _mm256_castps_si256(_mm256_cmp_ps(a, decade[d], _CMP_GE_OQ));
    const __m256i ge4 = _mm256_add_epi32(_mm256_add_epi32(ge[0], ge[1]), _mm256_add_epi32(ge[2], ge[3]));
    const __m256i i = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_add_epi32(ge4, _mm256_add_epi32(ge[4], ge[5])));
    const __m256 lev = _mm256_permutevar8x32_ps(pow2, i);
    // the level coordinate in the decade: level k at tk = k (its values are 1e-5 of a spacing off)
    const __m256 tk = (V8(a) * V8(_mm256_permutevar8x32_ps(k_slope, i)) + V8(_mm256_permutevar8x32_ps(k_offset, i))).x;
    const __m256 r = _mm256_round_ps(tk, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 k = _mm256_min_ps(_mm256_max_ps(r, zero), _mm256_sub_ps(lev, _mm256_set1_ps(1.0f)));
    __m256i c = _mm256_cvttps_epi32(_mm256_add_ps(_mm256_add_ps(_mm256_set1_ps(127.0f), lev), k));
    // below the decade's lowest level: it, or the value below (the previous decade's top, or 0)
    const __m256 mid = _mm256_permutevar8x32_ps(below_mid, i);
    const __m256 lower = _mm256_and_ps(_mm256_cmp_ps(tk, zero, _CMP_LT_OQ), _mm256_cmp_ps(a, mid, _CMP_LT_OQ));
    c = _mm256_add_epi32(c, _mm256_castps_si256(lower));  // -1 where lower
    c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(a, top_mid, _CMP_GT_OQ)));  // above the last: 1.0
    // near a midpoint: inside the decade (its midpoints are at tk = 0.5 .. 2**i - 1.5), or at its edges
    const __m256 inside = _mm256_and_ps(_mm256_cmp_ps(tk, zero, _CMP_GT_OQ),
                                        _mm256_cmp_ps(tk, _mm256_sub_ps(lev, _mm256_set1_ps(1.0f)), _CMP_LT_OQ));
    const __m256 off_mid = _mm256_andnot_ps(sign, _mm256_sub_ps(tk, r));  // 0.5 at a midpoint
    const __m256 near_inside = _mm256_and_ps(inside, _mm256_cmp_ps(off_mid, _mm256_set1_ps(0.5f - 1e-3f), _CMP_GT_OQ));
    const __m256 near_below = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(a, mid)),
                                            _mm256_mul_ps(mid, _mm256_set1_ps(1e-4f)), _CMP_LE_OQ);
    const __m256 near_top = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(a, top_mid)), _mm256_set1_ps(1e-4f),
                                          _CMP_LE_OQ);
    const __m256 near_mid = _mm256_or_ps(near_inside, _mm256_or_ps(near_below, near_top));
    if (!_mm256_testz_ps(near_mid, near_mid)) {
      alignas(32) float ys[8];
      _mm256_store_ps(ys, y);
      for (int l = 0; l < 8; ++l) codes[j + l] = static_cast<uint8_t>((dyn_nearest1(ys[l], t) - 127) & 255);
      continue;
    }
    const __m256i mirrored = _mm256_max_epi32(_mm256_sub_epi32(_mm256_set1_epi32(254), c), _mm256_setzero_si256());
    const __m256i index = _mm256_blendv_epi8(c, mirrored, _mm256_castps_si256(_mm256_cmp_ps(y, zero, _CMP_LT_OQ)));
    store_codes8(codes + j, _mm256_and_si256(_mm256_sub_epi32(index, _mm256_set1_epi32(127)), _mm256_set1_epi32(255)));
  }
}
// encode_block1's exp_avg_sq codes for a block without nan or inf, 8 lanes at a time: the estimate,
// the pair of levels there, and the exact correction (level_code1; about 1 in 2000 lanes needs one)
inline void encode_exp_avg_sq8(const float* x, uint8_t* codes, float den, uint32_t position0, uint32_t seed_term,
                               const Tables& t) {
  const __m256 vden = _mm256_set1_ps(den);
  const __m256i seed = _mm256_set1_epi32(static_cast<int>(seed_term)), one = _mm256_set1_epi32(1);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t j = 0; j < BLOCK; j += 8) {
    const __m256 xf = _mm256_loadu_ps(x + j);
    const __m256 y = _mm256_div_ps(xf, vden);
    const __m256i u = _mm256_castps_si256(y);  // the estimate (level_estimate1)
    const V8 f = V8(_mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFF)),
                                                        _mm256_set1_epi32(0x3F800000)))) - V8(1.0f);
    const V8 e(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 23), _mm256_set1_epi32(0xFF)),
                                                   _mm256_set1_epi32(127))));
    const V8 f2 = f * f, K(kCodesPerOctave);  // 255 + log2(y) * K, the polynomial's coefficients times K
    const V8 q = (V8(kLog2C[0] * kCodesPerOctave) + V8(kLog2C[1] * kCodesPerOctave) * f) +
                 f2 * (V8(kLog2C[2] * kCodesPerOctave) + V8(kLog2C[3] * kCodesPerOctave) * f) +
                 (f2 * f2) * V8(kLog2C[4] * kCodesPerOctave);
    __m256 est = _mm256_round_ps((V8(255.0f) + e * K + f * q).x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    est = _mm256_min_ps(_mm256_max_ps(est, _mm256_set1_ps(1.0f)), _mm256_set1_ps(254.0f));
    __m256i lo = _mm256_cvttps_epi32(est);
    __m256 v_lo, v_hi;
    load_pairs8(t.levels, lo, &v_lo, &v_hi);
    const __m256i up = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(v_hi, y, _CMP_LE_OQ)),
                                        _mm256_cmpgt_epi32(_mm256_set1_epi32(254), lo));
    const __m256i down = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(v_lo, y, _CMP_GT_OQ)),
                                          _mm256_cmpgt_epi32(lo, one));
    const __m256i moved = _mm256_or_si256(up, down);
    if (!_mm256_testz_si256(moved, moved)) {
      lo = _mm256_add_epi32(_mm256_sub_epi32(lo, up), down);  // masks are -1
      load_pairs8(t.levels, lo, &v_lo, &v_hi);
    }
    __m256 p = _mm256_div_ps((V8(y) - V8(v_lo)).x, _mm256_sub_ps(v_hi, v_lo));
    p = _mm256_min_ps(_mm256_max_ps(p, zero), _mm256_set1_ps(1.0f));
    const uint32_t first = position0 + static_cast<uint32_t>(j);
    const __m256i positions = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first)), lanes);
    const __m256 uniform = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(hash8(positions, seed), 8)),
                                         _mm256_set1_ps(1.0f / 16777216.0f));
    const __m256i code = _mm256_sub_epi32(lo, _mm256_castps_si256(_mm256_cmp_ps(uniform, p, _CMP_LT_OQ)));
    store_codes8(codes + j, _mm256_and_si256(code, _mm256_castps_si256(_mm256_cmp_ps(xf, zero, _CMP_GT_OQ))));
  }
}
#endif

// Encode one block: x holds BLOCK values (past the parameter's end: the padding's zeros); the first n
// codes are written to `out` (the padding's code, 0, is not), the stored absmax to *absmax_out.
template <bool EXP_AVG>
void encode_block(const float* x, uint8_t* out, int64_t n, float* absmax_out, uint32_t position0, uint32_t seed_term,
                  const Tables& t) {
  bool flagged;
  const float absmax = block_absmax(x, &flagged);
  const float den = absmax > 0.0f ? absmax : 1.0f;
  alignas(32) uint8_t local[BLOCK];
  uint8_t* codes = n == BLOCK ? out : local;
#ifdef HALFADAM_AVX2
  if (!flagged) {
    if (EXP_AVG) encode_exp_avg8(x, codes, den, t);
    else encode_exp_avg_sq8(x, codes, den, position0, seed_term, t);
  } else {
    encode_block1<EXP_AVG>(x, codes, den, true, position0, seed_term, t);
  }
#else
  encode_block1<EXP_AVG>(x, codes, den, flagged, position0, seed_term, t);
#endif
  if (codes != out) std::memcpy(out, codes, static_cast<size_t>(n));
  *absmax_out = flagged ? -absmax : absmax;
}

struct Item {
  void* param;
  const void* grad;
  int64_t numel;
  int64_t offset;  // into the flat state buffers (a multiple of BLOCK with a split master or a uint8 moment)
  int64_t position;  // its first element's index in its whole parameter (a shard's; the random bits' positions)
};

struct Step {
  float* master;            // fp32 master weights (Master::kFp32)
  int8_t* master_hi;        // split master (Master::kSplit): remainder bytes and per-block tie lane + 1
  uint8_t* master_lo;
  uint8_t* master_tie;
  void* exp_avg;            // float32 or bfloat16 (MA), float32 or bfloat16 (MV), or uint8 codes (MA / MV float)
  void* exp_avg_sq;
  float* exp_avg_absmax;    // uint8 moments: one stored absmax per block (else null)
  float* exp_avg_sq_absmax;
  const Tables* tables;     // uint8 moments: encodings.tables()
  float c[9];               // adam_coefficients, then the gradient scale (1 without one: g * 1 == g exactly)
  uint32_t seed_exp_avg, seed_exp_avg_sq;  // hash seeds of the stochastic rounding (bfloat16 moments, uint8 exp_avg_sq)
};

// Elements a..b (a a multiple of BLOCK) of one parameter. P: the parameter's dtype, G: the gradient's,
// MS: how the master is kept (kNone: the parameter, float32, is the weight), MA / MV: exp_avg's and
// exp_avg_sq's dtypes, float for float32 and uint8 (a runtime branch per block: a uint8 moment's
// block is decoded into a float buffer, updated there and encoded).
template <typename P, typename G, Master MS, typename MA, typename MV, bool L2, bool OPTIMIZED>
void run(const Step& s, const Item& it, int64_t a, int64_t b) {
  P* param = static_cast<P*>(it.param);
  const G* grad = static_cast<const G*>(it.grad);
  constexpr bool kMayQuantizeM = std::is_same<MA, float>::value, kMayQuantizeV = std::is_same<MV, float>::value;
  const bool m8 = kMayQuantizeM && s.exp_avg_absmax != nullptr, v8 = kMayQuantizeV && s.exp_avg_sq_absmax != nullptr;
  MA* const m_state = m8 ? nullptr : static_cast<MA*>(s.exp_avg) + it.offset;
  MV* const v_state = v8 ? nullptr : static_cast<MV*>(s.exp_avg_sq) + it.offset;
  uint8_t* const m_codes = m8 ? static_cast<uint8_t*>(s.exp_avg) + it.offset : nullptr;
  uint8_t* const v_codes = v8 ? static_cast<uint8_t*>(s.exp_avg_sq) + it.offset : nullptr;
  alignas(32) float m_block[kMayQuantizeM ? BLOCK : 1], v_block[kMayQuantizeV ? BLOCK : 1];
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
    // this block's moments from element `start` on: the state's, or a uint8 moment's decoded block
    const int64_t block = (it.offset + start) / BLOCK;
    MA* m = m_state ? m_state + start : nullptr;
    MV* v = v_state ? v_state + start : nullptr;
    if constexpr (kMayQuantizeM) {
      if (m8) {
        decode_block<true>(m_codes + start, s.exp_avg_absmax[block], end - start, m_block, *s.tables);
        m = m_block;
      }
    }
    if constexpr (kMayQuantizeV) {
      if (v8) {
        decode_block<false>(v_codes + start, s.exp_avg_sq_absmax[block], end - start, v_block, *s.tables);
        v = v_block;
      }
    }
    int64_t i = start;
#ifdef HALFADAM_AVX2
    for (; i + 8 <= end; i += 8) {
      V8 w, mi = load8(m + (i - start)), vi = load8(v + (i - start));
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
      const __m256i positions = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(it.position + i)),
                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      store_moment8(m + (i - start), mi, seed_m, positions);
      store_moment8(v + (i - start), vi, seed_v, positions);
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
      float w, mi = load1(m + (i - start)), vi = load1(v + (i - start));
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
      store_moment1(m + (i - start), mi, s.seed_exp_avg, static_cast<uint32_t>(it.position + i));
      store_moment1(v + (i - start), vi, s.seed_exp_avg_sq, static_cast<uint32_t>(it.position + i));
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
    if constexpr (kMayQuantizeM) {
      if (m8) {  // past the parameter's end: the padding's zeros (encodings.py encodes whole padded blocks)
        std::fill(m_block + (end - start), m_block + BLOCK, 0.0f);
        encode_block<true>(m_block, m_codes + start, end - start, s.exp_avg_absmax + block, 0, 0, *s.tables);
      }
    }
    if constexpr (kMayQuantizeV) {
      if (v8) {
        std::fill(v_block + (end - start), v_block + BLOCK, 0.0f);
        encode_block<false>(v_block, v_codes + start, end - start, s.exp_avg_sq_absmax + block,
                            static_cast<uint32_t>(it.position + start), s.seed_exp_avg_sq, *s.tables);
      }
    }
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

// encodings.tables() (dynamic map, decades, levels) copied into `t`, with the estimates' constants.
static void fill_tables(const std::vector<at::Tensor>& tables, Tables* t) {
  TORCH_CHECK(tables.size() == 3, "adam_step: uint8 moments need encodings.tables() (3 tensors), got ", tables.size());
  const int64_t sizes[3] = {256, 7, 256};
  for (int j = 0; j < 3; ++j)
    TORCH_CHECK(tables[j].device().is_cpu() && tables[j].scalar_type() == at::kFloat && tables[j].is_contiguous() &&
                    tables[j].numel() == sizes[j],
                "adam_step: tables[", j, "] must be a contiguous float32 CPU tensor of ", sizes[j], " elements");
  std::memcpy(t->dyn, tables[0].data_ptr<float>(), sizeof(t->dyn));
  std::memcpy(t->decades, tables[1].data_ptr<float>(), sizeof(t->decades));
  std::memcpy(t->levels, tables[2].data_ptr<float>(), 256 * sizeof(float));
  std::fill(t->levels + 256, t->levels + 264, 1.0f);
  for (int c = 0; c < 256; ++c) t->dyn_by_code[c] = t->dyn[(c + 127) & 255];
  for (int i = 0; i < 8; ++i) {
    const int d = std::min(i, 6);
    t->pow2[i] = static_cast<float>(1 << d);
    t->k_slope[i] = static_cast<float>(t->pow2[i] / 0.9 / t->decades[d]);
    t->k_offset[i] = static_cast<float>(-0.1 * t->pow2[i] / 0.9 - 0.5);
    const int lowest = 127 + (1 << d);  // decade d's lowest value, and the one below it
    t->below_mid[i] = static_cast<float>((static_cast<double>(t->dyn[lowest - 1]) + t->dyn[lowest]) / 2);
  }
  t->top_mid = static_cast<float>((static_cast<double>(t->dyn[254]) + t->dyn[255]) / 2);
}

// One step for params[k] (gradient grads[k], state at offsets[k] of the flat buffers in `state`, keyed
// as halfadam.encodings names them), k = 0..K-1. `step` seeds the stochastic rounding; `tables` is
// encodings.tables() with a uint8 moment (else empty).
void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::map<std::string, at::Tensor>& state, const std::vector<int64_t>& offsets,
               const std::vector<double>& coefficients, const c10::optional<at::Tensor>& grad_scale, bool l2,
               bool optimized_update, int64_t step, const std::vector<at::Tensor>& tables,
               const std::vector<int64_t>& positions) {
  const int64_t K = static_cast<int64_t>(params.size());
  TORCH_CHECK(static_cast<int64_t>(grads.size()) == K && static_cast<int64_t>(offsets.size()) == K &&
                  (positions.empty() || static_cast<int64_t>(positions.size()) == K),
              "adam_step: params, grads, offsets and positions differ in length");
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
                                         found->second.scalar_type() == at::kBFloat16 ||
                                         found->second.scalar_type() == at::kByte),
                "adam_step: state['", key, "'] must be float32, bfloat16 or uint8");
    return found->second.scalar_type();
  };
  const at::ScalarType adtype = moment_dtype("exp_avg"), vdtype = moment_dtype("exp_avg_sq");
  const at::Tensor exp_avg = get("exp_avg", adtype), exp_avg_sq = get("exp_avg_sq", vdtype);
  const int64_t total_state = exp_avg.numel();
  TORCH_CHECK(exp_avg_sq.numel() == total_state, "adam_step: exp_avg and exp_avg_sq differ in length");
  const bool m8 = adtype == at::kByte, v8 = vdtype == at::kByte;
  const at::Tensor m_absmax = get("exp_avg_absmax", at::kFloat), v_absmax = get("exp_avg_sq_absmax", at::kFloat);
  TORCH_CHECK(m8 == m_absmax.defined() && v8 == v_absmax.defined() &&
                  (!m8 || m_absmax.numel() * BLOCK == total_state) && (!v8 || v_absmax.numel() * BLOCK == total_state),
              "adam_step: a uint8 moment needs its *_absmax (one per block of ", BLOCK,
              "), and only a uint8 one has it");
  Tables table_values;
  if (m8 || v8) fill_tables(tables, &table_values);
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
                    kv.first == "master_tie" || kv.first == "exp_avg" || kv.first == "exp_avg_sq" ||
                    kv.first == "exp_avg_absmax" || kv.first == "exp_avg_sq_absmax",
                "adam_step: unsupported state entry '", kv.first, "'");

  Step s{};
  s.master = ms == Master::kFp32 ? master.data_ptr<float>() : nullptr;
  s.master_hi = ms == Master::kSplit ? hi.data_ptr<int8_t>() : nullptr;
  s.master_lo = ms == Master::kSplit ? lo.data_ptr<uint8_t>() : nullptr;
  s.master_tie = ms == Master::kSplit ? tie.data_ptr<uint8_t>() : nullptr;
  s.exp_avg = exp_avg.data_ptr();
  s.exp_avg_sq = exp_avg_sq.data_ptr();
  s.exp_avg_absmax = m8 ? m_absmax.data_ptr<float>() : nullptr;
  s.exp_avg_sq_absmax = v8 ? v_absmax.data_ptr<float>() : nullptr;
  s.tables = &table_values;
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
    TORCH_CHECK(offsets[k] >= 0 && offsets[k] + n <= total_state &&
                    ((ms != Master::kSplit && !m8 && !v8) || offsets[k] % BLOCK == 0),
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
    items[k] = Item{p.data_ptr(), g.data_ptr(), n, offsets[k], positions.empty() ? 0 : positions[k]};
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

// The kernel's uint8 block encoder and decoder by themselves (tests: encodings._encode_moment_ and
// _decode_moment's bytes and values): x (float32) and codes (uint8) a multiple of BLOCK long, absmax
// (float32) one per block, positions from 0, `step` the seed.
static void check_uint8_args(const at::Tensor& codes, const at::Tensor& absmax) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.numel() % BLOCK == 0 && absmax.device().is_cpu() && absmax.scalar_type() == at::kFloat &&
                  absmax.is_contiguous() && absmax.numel() * BLOCK == codes.numel(),
              "uint8 codes (a multiple of ", BLOCK, " long) and float32 absmax (one per block), contiguous, "
              "on the CPU");
}
void encode_uint8(const at::Tensor& x, at::Tensor codes, at::Tensor absmax, const std::vector<at::Tensor>& tables,
                  bool exp_avg, int64_t step) {
  check_uint8_args(codes, absmax);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() == codes.numel(),
              "encode_uint8: x must be a contiguous float32 CPU tensor as long as codes");
  Tables t;
  fill_tables(tables, &t);
  const uint32_t seed = seed_term(step, 0x1B873593u);  // encodings._SALT["exp_avg_sq"]
  const float* xs = x.data_ptr<float>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  float* am = absmax.data_ptr<float>();
  for (int64_t b = 0; b < absmax.numel(); ++b) {
    const int64_t j = b * BLOCK;
    if (exp_avg) encode_block<true>(xs + j, out + j, BLOCK, am + b, 0, 0, t);
    else encode_block<false>(xs + j, out + j, BLOCK, am + b, static_cast<uint32_t>(j), seed, t);
  }
}
at::Tensor decode_uint8(const at::Tensor& codes, const at::Tensor& absmax, const std::vector<at::Tensor>& tables,
                        bool exp_avg) {
  check_uint8_args(codes, absmax);
  Tables t;
  fill_tables(tables, &t);
  at::Tensor out = at::empty({codes.numel()}, codes.options().dtype(at::kFloat));
  const uint8_t* in = codes.data_ptr<uint8_t>();
  const float* am = absmax.data_ptr<float>();
  float* values = out.data_ptr<float>();
  for (int64_t b = 0; b < absmax.numel(); ++b) {
    const int64_t j = b * BLOCK;
    if (exp_avg) decode_block<true>(in + j, am[b], BLOCK, values + j, t);
    else decode_block<false>(in + j, am[b], BLOCK, values + j, t);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam_step", &adam_step, "halfadam: one Adam/AdamW step over a list of parameters with flat state buffers");
  m.def("first_invalid", &first_invalid, "halfadam: index of the first invalid (param, grad) pair, or -1");
  m.def("encode_uint8", &encode_uint8, "halfadam (tests): the kernel's uint8 moment encoder over whole blocks");
  m.def("decode_uint8", &decode_uint8, "halfadam (tests): the kernel's uint8 moment decoder over whole blocks");
}
