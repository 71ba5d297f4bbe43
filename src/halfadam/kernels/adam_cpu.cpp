// halfadam's hand-written CPU kernel: one step of an update rule (Adam/AdamW, SGD or Lion) over a list of
// parameters whose state lives in a bucket's flat buffers, in one call (the "cpp" implementation).
//
// The equations are halfadam.functional's, term for term and in the same order of operations
// (halfadam.functional.adam_elementwise_ with tensor coefficients, halfadam.functional.sync_master_);
// it is compiled with -ffp-contract=off so no multiply-add is fused into one rounding. Per element,
// with c = the coefficients of halfadam.functional.adam_coefficients (rule 0, Adam):
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
// Rules 1 (SGD) and 2 (Lion) share everything but the lines between the moments' loads and the new w
// (lanes(), `if constexpr` on the rule), each op rounded once in this order; they keep one signed
// moment, in the exp_avg slot and encoded as exp_avg is (or none: SGD without momentum), never an
// exp_avg_sq. SGD (c = l2, momentum_a, momentum_b, nesterov_momentum, lr, sign; flags L2, NESTEROV):
//   g = g * c.sign;  g = g + c.l2 * w (L2)
//   buf = buf * c.momentum_a + g * c.momentum_b;  d = g + buf * c.nesterov_momentum (NESTEROV) | buf
//        (without momentum: no buf, d = g)
//   w = w - d * c.lr
// Lion (c = decay_factor, lr, beta1, one_minus_beta1, beta2, one_minus_beta2; no flags):
//   w = w * c.decay_factor;  u = m * c.beta1 + g * c.one_minus_beta1
//   s = (u > 0 ? 1 : 0) - (u < 0 ? 1 : 0)   (+0 for +-0 and nan, as torch.sign on the CPU)
//   w = w - s * c.lr;  m = m * c.beta2 + g * c.one_minus_beta2
//        (s * c.lr: the one of its three values, each made once per call: the same bits)
//
// State encodings (halfadam.encodings is their specification; the functions named there are mirrored
// here bit for bit): the master is fp32 ("master_weight"), split ("master_hi" int8, "master_lo"
// uint8, "master_tie" uint8 per block: encodings._split_decode / _split_encode_) or split8
// ("master_hi" alone, bfloat16 parameters: an 8-bit remainder rounded stochastically with 8 more
// random bits of the element's hash, encodings._split8_decode / _split8_encode_ / _master_bits); each
// moment is float32, bfloat16 (decoded exactly, encoded by stochastic rounding) or uint8: a small
// float per element, in tiers of mantissa bits by binade, over one uint8 base exponent per block
// ("exp_avg_scale", "exp_avg_sq_exponent": encodings._TIERS, _block_base, _encode_magnitude,
// _decode_magnitude, _decode_moment, _encode_moment_; the tiers are the constants under "the uint8
// codes" below, from which every table and shortcut here is derived).
// The random bits of the stochastic rounding are one hash per element and step (encodings._random_bits
// of the element's position in its parameter and the step): exp_avg takes its upper 16 bits,
// exp_avg_sq its lower 16 (encodings._moment_bits), for bfloat16 and uint8 moments alike; a split8
// master the upper byte of one more round of it (encodings._master_bits).
// Gradients are float32 or the parameter's dtype (adam_step converts any other floating dtype).
//
// Blocks (encodings.block_shape): each parameter is rows of row_length elements (the product of the
// dims after dim 0 where the format has per-block state, else the whole parameter: one row), each row
// cut into blocks of 128, its last one shorter where 128 does not divide the row; blocks never straddle
// rows. Element i keeps its per-element state at offset + i and draws the random bits of position
// position + i (its index in the flattened whole parameter); block j of a parameter keeps its per-block
// state (scales, tie) at block_offset + j. The encodings of a short block are those of its row padded
// with zeros to whole blocks (encodings._layout), which change no scale and no tie: the kernel steps
// only its n < 128 elements.
// Work is split over torch's intra-op threads (at::parallel_for) by blocks across the list.
// Each element is read and written once, in one loop written once for a "lane" type (the Lanes*
// structs below): 16 lanes with AVX-512 (F and BW; DQ, VBMI and BF16 where there: vfpclassps, one
// byte permute for the remainder's bytes, vcvtneps2bf16), 8 with AVX2 (and F16C), one at a time for
// the tails and on other CPUs (set_lanes picks a narrower width, for tests). A split (or split8)
// master's new weights go through a buffer of one block, stored by a second loop once the block's
// lanes are done (store_split, store_split8): without the rounding and the remainder after them, and
// with the moments stored ahead of the sqrt and divisions, more of the lanes' chains of those overlap
// (with encode_block inlined: about 7% off the bf16 and compact steps on Zen 4); a split8 master's
// hashes go through a buffer of one block too (h_buf), computed once for its bits and the moments'.
// A uint8 moment's block is decoded into a buffer of one block in L1 before the loop (whole blocks of
// codes that are all of a tier's binades by the short path), updated there with the running extremes of its new values, and
// encoded from there once the block is done (its scale is a maximum over it): with one hash per
// element for both moments, by table lookups of the tier where the lanes have them (vpermt2d), by
// the short path where no value of the block is subnormal for its base, nan or inf.
// Constants that a hot loop needs many of are made before it and pinned (Lanes*::pin): else GCC makes
// them again in the loop from a general register (mov, vpbroadcastd), which cost compact's step about
// 8% and tiny's 7% on Zen 4 (the encoders' and the split8 master's constants).
// The 8 lanes (AVX2) have 16 registers and no masks; four things make up for some of it: a constant by one
// load (Lanes8::seti: vpbroadcastd from memory, not mov, vmovd and vpbroadcastd per use), the hash's
// multipliers pinned (Mixers), blends by vblendvps (no vpcmpgtb before each vpblendvb) and narrowing stores
// by byte shuffles (vpshufb and one permute, not packs and extracts). Measured together as x86-64-v3 code
// (-mtune=znver3, torch's AVX2 kernels) on a Xeon (Sapphire Rapids, by thread CPU time, 1 thread, 20M
// bfloat16 parameters): split 7%, bf16 9%, compact 12-14%, tiny 5-10% off the step; fp32 0-1%.
// The float work is the divider's: sqrt and two divisions per element cost AVX-512 about 18 cycles
// per 16 lanes on the AMD Zen 4 this was measured on, a floor that torch's fused AdamW shares.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
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
#if defined(HALFADAM_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define HALFADAM_AVX512 1
#endif

#define HA_INLINE inline __attribute__((always_inline))

namespace {

constexpr int64_t GRAIN = 32768;  // elements per thread task (at::internal::GRAIN_SIZE)
constexpr int64_t BLOCK = 128;    // encodings.BLOCK

// ---------------------------------------------------------------- the uint8 codes (encodings.py)
// Each moment's codes, tier by tier from the smallest values up: (mantissa bits, binades)
// (encodings._TIERS; the lowest tier also holds the subnormals below its first binade), and its
// reserved magnitude codes (encodings._NAN_CODE, _INF_CODE) and magnitude mask (_MAGNITUDE_MASK).
struct Tier {
  int32_t mantissa, binades;
};
template <bool EXP_AVG> struct Codes;
template <> struct Codes<true> {  // exp_avg: a sign bit (128) and 7 magnitude bits
  static constexpr Tier kTiers[] = {{2, 8}, {3, 3}, {4, 4}};
  static constexpr int32_t kNan = 126, kInf = 127, kMask = 127;
};
template <> struct Codes<false> {  // exp_avg_sq: 8 magnitude bits
  static constexpr Tier kTiers[] = {{1, 29}, {3, 8}, {4, 8}};
  static constexpr int32_t kNan = 255, kInf = 254, kMask = 255;
};

// What the tiers make (encodings._tier_table), per tier: its mantissa bits, first binade over the
// block's base (r0) and first code, and k = (first << (23 - mantissa)) - (r0 << 23) mod 2**32: over
// a block's base (unit_bits = base << 23), a value of the tier has the code
// ((bits - unit_bits + k) >> (23 - mantissa)) and a code the bits (code << (23 - mantissa)) + unit_bits - k
// (encodings._encode_magnitude / _decode_magnitude, with the offsets written out); the subnormals below
// the lowest tier take k = 0 on the bits of value + unit.
struct TierRow {
  int32_t mantissa, r0, first, k;
};
template <size_t N>
struct TierRows {
  TierRow row[N];
  int32_t binades, top;  // the binades in all; the code just above them
};
template <size_t N>
constexpr TierRows<N> tier_rows(const Tier (&tiers)[N]) {
  TierRows<N> out{};
  int32_t r0 = 0, code = 1 << tiers[0].mantissa;
  for (size_t i = 0; i < N; ++i) {
    const uint32_t k = (static_cast<uint32_t>(code) << (23 - tiers[i].mantissa)) - (static_cast<uint32_t>(r0) << 23);
    out.row[i] = {tiers[i].mantissa, r0, code, static_cast<int32_t>(k)};
    r0 += tiers[i].binades;
    code += tiers[i].binades << tiers[i].mantissa;
  }
  out.binades = r0;
  out.top = code;
  return out;
}
template <bool EXP_AVG>
struct Spec {
  using C = Codes<EXP_AVG>;
  static constexpr size_t kTierCount = sizeof(C::kTiers) / sizeof(Tier);
  static constexpr TierRows<kTierCount> kRows = tier_rows(C::kTiers);
  static constexpr int32_t kM0 = C::kTiers[0].mantissa;
  static constexpr int32_t kSpan = kRows.binades - 1;  // encodings._SPAN: the base is E - kSpan
  static constexpr int32_t kNan = C::kNan, kInf = C::kInf, kMask = C::kMask;
  static constexpr int32_t kReserved = kNan < kInf ? kNan : kInf;  // the lowest reserved code
  static_assert(kRows.top < kReserved, "the codes reach the reserved ones");
  static_assert(kM0 >= 1, "the lowest tier needs a mantissa bit");
};
constexpr bool tiers_ok(const Tier* t, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (t[i].mantissa < 1 || t[i].mantissa > 7 || t[i].binades < 1) return false;
  return true;
}
static_assert(tiers_ok(Codes<true>::kTiers, Spec<true>::kTierCount) && tiers_ok(Codes<false>::kTiers, Spec<false>::kTierCount),
              "tiers of 1..7 mantissa bits (16 random bits go below them) and at least one binade");
constexpr uint32_t kSalt = 0x1B873593u;  // encodings._SALT

// The tiers by lookup (32 entries, for the lanes that have a table lookup): encoding by the value's
// binade over the base (r = t >> 23, 0..SPAN) less kEncodeOffset (the lowest binades, all of the
// lowest tier, share entry 0: max(r - offset, 0)), decoding by k >> (the lowest tier's mantissa
// bits), where that is 32 entries at most and every tier starts at a multiple of it (else: compares).
struct TierLut {
  int32_t shift[32], k[32];
};
template <bool EXP_AVG>
constexpr int32_t kEncodeOffset = Spec<EXP_AVG>::kSpan < 32 ? 0 : Spec<EXP_AVG>::kSpan - 31;
template <bool EXP_AVG, bool DECODE>
constexpr TierLut tier_lut() {
  using S = Spec<EXP_AVG>;
  TierLut out{};
  for (int32_t idx = 0; idx < 32; ++idx) {
    size_t tier = 0;
    for (size_t i = 1; i < S::kTierCount; ++i)
      if (DECODE ? (idx << S::kM0) >= S::kRows.row[i].first : idx + kEncodeOffset<EXP_AVG> >= S::kRows.row[i].r0) tier = i;
    out.shift[idx] = (DECODE ? 23 : 7) - S::kRows.row[tier].mantissa;
    out.k[idx] = S::kRows.row[tier].k;
  }
  return out;
}
template <bool EXP_AVG>
constexpr bool decode_lut_fits() {
  using S = Spec<EXP_AVG>;
  if ((S::kMask >> S::kM0) >= 32) return false;
  for (size_t i = 0; i < S::kTierCount; ++i)
    if (S::kRows.row[i].first % (1 << S::kM0) != 0) return false;
  return true;
}
template <bool EXP_AVG>
struct Luts {
  // encoding: entry 0 must be of the lowest tier, whatever the offset
  static constexpr bool kEncode = kEncodeOffset<EXP_AVG> == 0 ||
                                  (Spec<EXP_AVG>::kTierCount > 1 && kEncodeOffset<EXP_AVG> < Spec<EXP_AVG>::kRows.row[1].r0),
                        kDecode = decode_lut_fits<EXP_AVG>();
  alignas(64) static constexpr TierLut kEnc = tier_lut<EXP_AVG, false>();
  alignas(64) static constexpr TierLut kDec = tier_lut<EXP_AVG, true>();
};

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
// float32 -> bfloat16 bits, round to nearest even, nan -> 0x7FC0 (c10::BFloat16's rule)
inline uint16_t bf16_bits(float f) {
  const uint32_t u = float_to_bits(f);
  return f != f ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// ---------------------------------------------------------------- lanes
// One interface, three implementations: F (float32 lanes), I (int32 lanes), M (a lane mask), H (16-bit
// lanes). Integer arithmetic wraps (mod 2**32) as torch's int32 ops and the spec's masked int64 ones do;
// iif/fif(m, yes, no) is m ? yes : no per lane; load/store convert a dtype to float32 and back (stores
// round to nearest even, as Tensor.copy_).
struct Lanes1 {
  static constexpr int W = 1;
  using F = float;
  using I = int32_t;
  using M = bool;
  static HA_INLINE F set(float x) { return x; }
  static HA_INLINE I seti(int32_t x) { return x; }
  // x, opaque to the compiler: a constant made before a loop stays in a register (else it may be made again in the loop)
  static HA_INLINE I pin(I x) { asm("" : "+r"(x)); return x; }
  static HA_INLINE I iota() { return 0; }
  static HA_INLINE I bits(F x) { return static_cast<int32_t>(float_to_bits(x)); }
  static HA_INLINE F fromb(I i) { return bits_to_float(static_cast<uint32_t>(i)); }
  static HA_INLINE F fsqrt(F x) { return std::sqrt(x); }
  static HA_INLINE I iadd(I a, I b) { return static_cast<int32_t>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b)); }
  static HA_INLINE I isub(I a, I b) { return static_cast<int32_t>(static_cast<uint32_t>(a) - static_cast<uint32_t>(b)); }
  static HA_INLINE I imul(I a, I b) { return static_cast<int32_t>(static_cast<uint32_t>(a) * static_cast<uint32_t>(b)); }
  static HA_INLINE I iand(I a, I b) { return a & b; }
  static HA_INLINE I ior(I a, I b) { return a | b; }
  static HA_INLINE I ixor(I a, I b) { return a ^ b; }
  static HA_INLINE I srl(I a, int n) { return static_cast<int32_t>(static_cast<uint32_t>(a) >> n); }
  static HA_INLINE I sra(I a, int n) { return a >> n; }
  static HA_INLINE I sll(I a, int n) { return static_cast<int32_t>(static_cast<uint32_t>(a) << n); }
  static HA_INLINE I srlv(I a, I n) { return static_cast<int32_t>(static_cast<uint32_t>(a) >> n); }
  static HA_INLINE I sllv(I a, I n) { return static_cast<int32_t>(static_cast<uint32_t>(a) << n); }
  static HA_INLINE I imax(I a, I b) { return a > b ? a : b; }
  static HA_INLINE I iabs(I a) { return a < 0 ? isub(0, a) : a; }
  static HA_INLINE I imin(I a, I b) { return a < b ? a : b; }
  static HA_INLINE I umax(I a, I b) { return static_cast<uint32_t>(a) > static_cast<uint32_t>(b) ? a : b; }
  static HA_INLINE I umin(I a, I b) { return static_cast<uint32_t>(a) < static_cast<uint32_t>(b) ? a : b; }
  static HA_INLINE uint32_t hmax_u(I a) { return static_cast<uint32_t>(a); }
  static HA_INLINE uint32_t hmin_u(I a) { return static_cast<uint32_t>(a); }
  static HA_INLINE M ieq(I a, I b) { return a == b; }
  static HA_INLINE M igt(I a, I b) { return a > b; }
  static HA_INLINE M fneq(F a, F b) { return a != b; }  // unordered: true where either is nan
  static HA_INLINE M fgt(F a, F b) { return a > b; }    // ordered: false where either is nan
  static HA_INLINE M fnan(F a) { return a != a; }
  static HA_INLINE M nonfinite(F a) { return (float_to_bits(a) & 0x7F800000u) == 0x7F800000u; }  // nan, +-inf
  static HA_INLINE M special(F a) { return nonfinite(a) || (float_to_bits(a) << 1) == 0; }     // ... or +-0
  static HA_INLINE M mor(M a, M b) { return a || b; }
  static HA_INLINE M mand(M a, M b) { return a && b; }
  static HA_INLINE M mandn(M a, M b) { return !a && b; }
  static HA_INLINE M test_mask(M m, I a, int32_t c) { return m && (a & c) != 0; }  // m & ((a & c) != 0)
  static HA_INLINE I sub_unless(M m, I a, I b) { return m ? 0 : isub(a, b); }      // m ? 0 : a - b
  static HA_INLINE F fif(M m, F yes, F no) { return m ? yes : no; }
  static HA_INLINE I iif(M m, I yes, I no) { return m ? yes : no; }
  static HA_INLINE bool any(M m) { return m; }
  static HA_INLINE int bitmask(M m) { return m ? 1 : 0; }
  static HA_INLINE F cvtif(I a) { return static_cast<float>(a); }
  static HA_INLINE I round_i(F a) { return static_cast<int32_t>(std::nearbyint(a)); }
  static HA_INLINE F load(const float* p) { return *p; }
  static HA_INLINE I loadi(const int32_t* p) { return *p; }
  static HA_INLINE void storei(int32_t* p, I x) { *p = x; }
  static HA_INLINE F load(const at::BFloat16* p) { return bits_to_float(static_cast<uint32_t>(p->x) << 16); }
  static HA_INLINE F load(const at::Half* p) { return c10::detail::fp16_ieee_to_fp32_value(p->x); }
  static HA_INLINE void store(float* p, F x) { *p = x; }
  static HA_INLINE void store(at::BFloat16* p, F x) { p->x = bf16_bits(x); }
  static HA_INLINE I store_bf16(at::BFloat16* p, F x);  // stores round(x), returns it as float32 bits
  static HA_INLINE void store(at::Half* p, F x) { p->x = c10::detail::fp16_ieee_from_fp32_value(x); }
  static HA_INLINE I load_u8(const uint8_t* p) { return *p; }
  static HA_INLINE I load_s8(const int8_t* p) { return *p; }
  static HA_INLINE void store_u8(uint8_t* p, I x) { *p = static_cast<uint8_t>(x); }
  static HA_INLINE void store_s8(int8_t* p, I x) { *p = static_cast<int8_t>(x); }
  static HA_INLINE void store_lo8(uint8_t* p, I x) { *p = static_cast<uint8_t>(x); }
  // x's lowest byte to lo, its second one to hi (x in -32768..32767)
  static HA_INLINE void store_bytes(uint8_t* lo, int8_t* hi, I x) { *lo = static_cast<uint8_t>(x); *hi = static_cast<int8_t>(x >> 8); }
  static HA_INLINE void store_u16(void* p, I x) { *static_cast<uint16_t*>(p) = static_cast<uint16_t>(x); }
  static HA_INLINE void store_hi16(void* p, I x) { store_u16(p, srl(x, 16)); }  // the upper 16 bits
  // a lookup in a table of 32 int32 (index in 0..31)
  static constexpr bool kLut = true;
  struct Lut {
    const int32_t* t;
    int32_t c;
    bool rev;
  };
  static HA_INLINE Lut lut_load(const int32_t* t) { return {t, 0, false}; }
  static HA_INLINE Lut lut_rev(const int32_t* t, int32_t c) { return {t, c, true}; }  // entries c - t[i]
  static HA_INLINE I lut(const Lut& l, I idx) { return l.rev ? isub(l.c, l.t[idx & 31]) : l.t[idx & 31]; }
};

#ifdef HALFADAM_AVX2
struct V8 {
  __m256 x;
  V8() = default;
  V8(__m256 v) : x(v) {}
  explicit V8(float f) : x(_mm256_set1_ps(f)) {}
};
HA_INLINE V8 operator+(V8 a, V8 b) { return _mm256_add_ps(a.x, b.x); }
HA_INLINE V8 operator-(V8 a, V8 b) { return _mm256_sub_ps(a.x, b.x); }
HA_INLINE V8 operator*(V8 a, V8 b) { return _mm256_mul_ps(a.x, b.x); }
HA_INLINE V8 operator/(V8 a, V8 b) { return _mm256_div_ps(a.x, b.x); }

struct Lanes8 {
  static constexpr int W = 8;
  using F = V8;
  using I = __m256i;
  using M = __m256i;  // all bits set where true
  static HA_INLINE F set(float x) { return V8(x); }
  // A constant x by one load, vpbroadcastd from a 4-byte constant of its own (merged by the linker):
  // with AVX2's 16 registers GCC else makes it again in the loop that needs it, from a general register
  // (mov, vmovd, vpbroadcastd: three instructions and two vector ones, per use)
  static HA_INLINE I seti(int32_t x) {
#if defined(__ELF__)  // the constant's own section: ELF's (a Mach-O or COFF build makes it as before)
    if (__builtin_constant_p(x)) {
      I r;
      asm(".pushsection .rodata.cst4,\"aM\",@progbits,4\n\t.balign 4\n1:\t.long %c1\n\t.popsection\n\t"
          "vpbroadcastd 1b(%%rip), %0" : "=x"(r) : "i"(x));
      return r;
    }
#endif
    return _mm256_set1_epi32(x);
  }
  static HA_INLINE I pin(I x) { asm("" : "+x"(x)); return x; }
  static HA_INLINE I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static HA_INLINE I bits(F x) { return _mm256_castps_si256(x.x); }
  static HA_INLINE F fromb(I i) { return _mm256_castsi256_ps(i); }
  static HA_INLINE F fsqrt(F x) { return _mm256_sqrt_ps(x.x); }
  static HA_INLINE I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static HA_INLINE I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static HA_INLINE I imul(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static HA_INLINE I iand(I a, I b) { return _mm256_and_si256(a, b); }
  static HA_INLINE I ior(I a, I b) { return _mm256_or_si256(a, b); }
  static HA_INLINE I ixor(I a, I b) { return _mm256_xor_si256(a, b); }
  static HA_INLINE I srl(I a, int n) { return _mm256_srli_epi32(a, n); }
  static HA_INLINE I sra(I a, int n) { return _mm256_srai_epi32(a, n); }
  static HA_INLINE I sll(I a, int n) { return _mm256_slli_epi32(a, n); }
  static HA_INLINE I srlv(I a, I n) { return _mm256_srlv_epi32(a, n); }
  static HA_INLINE I sllv(I a, I n) { return _mm256_sllv_epi32(a, n); }
  static HA_INLINE I imax(I a, I b) { return _mm256_max_epi32(a, b); }
  static HA_INLINE I iabs(I a) { return _mm256_abs_epi32(a); }
  static HA_INLINE I imin(I a, I b) { return _mm256_min_epi32(a, b); }
  static HA_INLINE I umax(I a, I b) { return _mm256_max_epu32(a, b); }
  static HA_INLINE I umin(I a, I b) { return _mm256_min_epu32(a, b); }
  static HA_INLINE uint32_t hmax_u(I a) {
    __m128i h = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    h = _mm_max_epu32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
    h = _mm_max_epu32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(h));
  }
  static HA_INLINE uint32_t hmin_u(I a) {
    __m128i h = _mm_min_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    h = _mm_min_epu32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
    h = _mm_min_epu32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(h));
  }
  static HA_INLINE M ieq(I a, I b) { return _mm256_cmpeq_epi32(a, b); }
  static HA_INLINE M igt(I a, I b) { return _mm256_cmpgt_epi32(a, b); }
  static HA_INLINE M fneq(F a, F b) { return _mm256_castps_si256(_mm256_cmp_ps(a.x, b.x, _CMP_NEQ_UQ)); }
  static HA_INLINE M fgt(F a, F b) { return _mm256_castps_si256(_mm256_cmp_ps(a.x, b.x, _CMP_GT_OQ)); }
  static HA_INLINE M fnan(F a) { return _mm256_castps_si256(_mm256_cmp_ps(a.x, a.x, _CMP_UNORD_Q)); }
  static HA_INLINE M nonfinite(F a) {
    const I e = _mm256_and_si256(bits(a), seti(0x7F800000));
    return _mm256_cmpeq_epi32(e, seti(0x7F800000));
  }
  static HA_INLINE M special(F a) { return mor(nonfinite(a), _mm256_cmpeq_epi32(sll(bits(a), 1), _mm256_setzero_si256())); }
  static HA_INLINE M mor(M a, M b) { return _mm256_or_si256(a, b); }
  static HA_INLINE M mand(M a, M b) { return _mm256_and_si256(a, b); }
  static HA_INLINE M mandn(M a, M b) { return _mm256_andnot_si256(a, b); }
  static HA_INLINE M test_mask(M m, I a, int32_t c) {
    return _mm256_andnot_si256(_mm256_cmpeq_epi32(_mm256_and_si256(a, seti(c)), _mm256_setzero_si256()), m);
  }
  static HA_INLINE I sub_unless(M m, I a, I b) { return _mm256_andnot_si256(m, _mm256_sub_epi32(a, b)); }
  static HA_INLINE F fif(M m, F yes, F no) { return _mm256_blendv_ps(no.x, yes.x, _mm256_castsi256_ps(m)); }
  // by vblendvps: GCC folds a blend to a select on its mask's sign bits, which for a vpblendvb's bytes
  // takes one more compare (vpcmpgtb) to remake the mask it had, and for a vblendvps's lanes none
  static HA_INLINE I iif(M m, I yes, I no) {
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(no), _mm256_castsi256_ps(yes), _mm256_castsi256_ps(m)));
  }
  static HA_INLINE bool any(M m) { return !_mm256_testz_si256(m, m); }
  static HA_INLINE int bitmask(M m) { return _mm256_movemask_ps(_mm256_castsi256_ps(m)); }
  static HA_INLINE F cvtif(I a) { return _mm256_cvtepi32_ps(a); }
  static HA_INLINE I round_i(F a) {
    return _mm256_cvtps_epi32(_mm256_round_ps(a.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static HA_INLINE F load(const float* p) { return _mm256_loadu_ps(p); }
  static HA_INLINE I loadi(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static HA_INLINE void storei(int32_t* p, I x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x); }
  static HA_INLINE F load(const at::BFloat16* p) {
    return fromb(sll(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static HA_INLINE F load(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static HA_INLINE void store(float* p, F x) { _mm256_storeu_ps(p, x.x); }
  static HA_INLINE void store(at::BFloat16* p, F x);
  static HA_INLINE I store_bf16(at::BFloat16* p, F x);  // stores round(x), returns it as float32 bits
  static HA_INLINE void store(at::Half* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static HA_INLINE I load_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static HA_INLINE I load_s8(const int8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  // Narrowing stores by byte shuffles (vpshufb within each 128-bit half, then one permute across them),
  // in place of packs and extracts: the bytes `pick` takes of each half, as dwords 0, 4, 1, 5, ... (vpermd)
  static HA_INLINE __m128i gather_dwords(I x, I pick) {
    return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(x, pick), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
  // ... each lane's first byte, in the low 8 bytes
  static HA_INLINE __m128i low_bytes(I x) {
    return gather_dwords(x, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1,
                                             -1, -1, -1, -1, -1, -1, -1, -1, -1));
  }
  // ... each lane's 16-bit half at byte `at` (0 or 2), in order (as qwords 0, 2: vpermq)
  template <int AT>
  static HA_INLINE __m128i halves(I x) {
    const I pick = _mm256_setr_epi8(AT, AT + 1, AT + 4, AT + 5, AT + 8, AT + 9, AT + 12, AT + 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                    AT, AT + 1, AT + 4, AT + 5, AT + 8, AT + 9, AT + 12, AT + 13, -1, -1, -1, -1, -1, -1, -1, -1);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(x, pick), 0xD8));
  }
  static HA_INLINE void store_u8(uint8_t* p, I x) { _mm_storel_epi64(reinterpret_cast<__m128i*>(p), low_bytes(x)); }  // values in 0..255
  static HA_INLINE void store_s8(int8_t* p, I x) { _mm_storel_epi64(reinterpret_cast<__m128i*>(p), low_bytes(x)); }  // values in -128..127
  static HA_INLINE void store_lo8(uint8_t* p, I x) { store_u8(p, x); }  // the lowest byte
  static HA_INLINE void store_bytes(uint8_t* lo, int8_t* hi, I x) {  // the lanes' first bytes, then their second ones
    const __m128i b = gather_dwords(x, _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, 1, 5,
                                                        9, 13, -1, -1, -1, -1, -1, -1, -1, -1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(lo), b);
    _mm_storeh_pd(reinterpret_cast<double*>(hi), _mm_castsi128_pd(b));
  }
  static HA_INLINE void store_u16(void* p, I x) { _mm_storeu_si128(static_cast<__m128i*>(p), halves<0>(x)); }  // values in 0..65535
  static HA_INLINE void store_hi16(void* p, I x) { _mm_storeu_si128(static_cast<__m128i*>(p), halves<2>(x)); }  // the upper 16 bits
  static constexpr bool kLut = false;  // 8-entry permutes only: the tiers by compares
  struct Lut {};
  static HA_INLINE Lut lut_load(const int32_t*) { return {}; }
  static HA_INLINE Lut lut_rev(const int32_t*, int32_t) { return {}; }
  static HA_INLINE I lut(const Lut&, I idx) { return idx; }
};
#endif

#ifdef HALFADAM_AVX512
struct V16 {
  __m512 x;
  V16() = default;
  V16(__m512 v) : x(v) {}
  explicit V16(float f) : x(_mm512_set1_ps(f)) {}
};
HA_INLINE V16 operator+(V16 a, V16 b) { return _mm512_add_ps(a.x, b.x); }
HA_INLINE V16 operator-(V16 a, V16 b) { return _mm512_sub_ps(a.x, b.x); }
HA_INLINE V16 operator*(V16 a, V16 b) { return _mm512_mul_ps(a.x, b.x); }
HA_INLINE V16 operator/(V16 a, V16 b) { return _mm512_div_ps(a.x, b.x); }

struct Lanes16 {
  static constexpr int W = 16;
  using F = V16;
  using I = __m512i;
  using M = __mmask16;
  static HA_INLINE F set(float x) { return V16(x); }
  static HA_INLINE I seti(int32_t x) { return _mm512_set1_epi32(x); }
  static HA_INLINE I pin(I x) { asm("" : "+v"(x)); return x; }
  static HA_INLINE I iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static HA_INLINE I bits(F x) { return _mm512_castps_si512(x.x); }
  static HA_INLINE F fromb(I i) { return _mm512_castsi512_ps(i); }
  static HA_INLINE F fsqrt(F x) { return _mm512_sqrt_ps(x.x); }
  static HA_INLINE I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static HA_INLINE I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static HA_INLINE I imul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static HA_INLINE I iand(I a, I b) { return _mm512_and_si512(a, b); }
  static HA_INLINE I ior(I a, I b) { return _mm512_or_si512(a, b); }
  static HA_INLINE I ixor(I a, I b) { return _mm512_xor_si512(a, b); }
  static HA_INLINE I srl(I a, int n) { return _mm512_srli_epi32(a, n); }
  static HA_INLINE I sra(I a, int n) { return _mm512_srai_epi32(a, n); }
  static HA_INLINE I sll(I a, int n) { return _mm512_slli_epi32(a, n); }
  static HA_INLINE I srlv(I a, I n) { return _mm512_srlv_epi32(a, n); }
  static HA_INLINE I sllv(I a, I n) { return _mm512_sllv_epi32(a, n); }
  static HA_INLINE I imax(I a, I b) { return _mm512_max_epi32(a, b); }
  static HA_INLINE I iabs(I a) { return _mm512_abs_epi32(a); }
  static HA_INLINE I imin(I a, I b) { return _mm512_min_epi32(a, b); }
  static HA_INLINE I umax(I a, I b) { return _mm512_max_epu32(a, b); }
  static HA_INLINE I umin(I a, I b) { return _mm512_min_epu32(a, b); }
  static HA_INLINE uint32_t hmax_u(I a) { return static_cast<uint32_t>(_mm512_reduce_max_epu32(a)); }
  static HA_INLINE uint32_t hmin_u(I a) { return static_cast<uint32_t>(_mm512_reduce_min_epu32(a)); }
  static HA_INLINE M ieq(I a, I b) { return _mm512_cmpeq_epi32_mask(a, b); }
  static HA_INLINE M igt(I a, I b) { return _mm512_cmpgt_epi32_mask(a, b); }
  static HA_INLINE M fneq(F a, F b) { return _mm512_cmp_ps_mask(a.x, b.x, _CMP_NEQ_UQ); }
  static HA_INLINE M fgt(F a, F b) { return _mm512_cmp_ps_mask(a.x, b.x, _CMP_GT_OQ); }
  static HA_INLINE M fnan(F a) { return _mm512_cmp_ps_mask(a.x, a.x, _CMP_UNORD_Q); }
#ifdef __AVX512DQ__  // vfpclassps: 0x01 quiet nan, 0x02 +0, 0x04 -0, 0x08 +inf, 0x10 -inf, 0x80 signalling nan
  static HA_INLINE M nonfinite(F a) { return _mm512_fpclass_ps_mask(a.x, 0x99); }
  static HA_INLINE M special(F a) { return _mm512_fpclass_ps_mask(a.x, 0x9F); }
#else
  static HA_INLINE M nonfinite(F a) {
    return _mm512_cmpeq_epi32_mask(_mm512_and_si512(bits(a), _mm512_set1_epi32(0x7F800000)), _mm512_set1_epi32(0x7F800000));
  }
  static HA_INLINE M special(F a) { return mor(nonfinite(a), _mm512_testn_epi32_mask(sll(bits(a), 1), sll(bits(a), 1))); }
#endif
  static HA_INLINE M mor(M a, M b) { return static_cast<M>(a | b); }
  static HA_INLINE M mand(M a, M b) { return static_cast<M>(a & b); }
  static HA_INLINE M mandn(M a, M b) { return static_cast<M>(~a & b); }
  static HA_INLINE M test_mask(M m, I a, int32_t c) { return _mm512_mask_test_epi32_mask(m, a, _mm512_set1_epi32(c)); }
  static HA_INLINE I sub_unless(M m, I a, I b) { return _mm512_maskz_sub_epi32(static_cast<M>(~m), a, b); }
  static HA_INLINE F fif(M m, F yes, F no) { return _mm512_mask_blend_ps(m, no.x, yes.x); }
  static HA_INLINE I iif(M m, I yes, I no) { return _mm512_mask_blend_epi32(m, no, yes); }
  static HA_INLINE bool any(M m) { return m != 0; }
  static HA_INLINE int bitmask(M m) { return static_cast<int>(m); }
  static HA_INLINE F cvtif(I a) { return _mm512_cvtepi32_ps(a); }
  static HA_INLINE I round_i(F a) { return _mm512_cvt_roundps_epi32(a.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static HA_INLINE F load(const float* p) { return _mm512_loadu_ps(p); }
  static HA_INLINE I loadi(const int32_t* p) { return _mm512_loadu_si512(p); }
  static HA_INLINE void storei(int32_t* p, I x) { _mm512_storeu_si512(p, x); }
  // bfloat16 -> float32: each 16-bit value into the upper half of its lane (one word permute, the
  // lower halves zeroed by the mask)
  static HA_INLINE I widen_hi16(__m256i h) {
    const __m512i idx = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5, 0, 4, 0, 3, 0,
                                         2, 0, 1, 0, 0, 0);
    return _mm512_maskz_permutexvar_epi16(static_cast<__mmask32>(0xAAAAAAAAu), idx, _mm512_castsi256_si512(h));
  }
  static HA_INLINE F load(const at::BFloat16* p) { return fromb(widen_hi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))); }
  // the upper 16 bits of each lane to p (one word permute)
  static HA_INLINE void store_hi16(void* p, I x) {
    const __m512i idx = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 31, 29, 27, 25, 23, 21, 19, 17, 15,
                                         13, 11, 9, 7, 5, 3, 1);
    _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_castsi512_si256(_mm512_permutexvar_epi16(idx, x)));
  }
  static HA_INLINE F load(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static HA_INLINE void store(float* p, F x) { _mm512_storeu_ps(p, x.x); }
  static HA_INLINE void store(at::BFloat16* p, F x);
  static HA_INLINE I store_bf16(at::BFloat16* p, F x);  // stores round(x), returns it as float32 bits
  static HA_INLINE void store(at::Half* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static HA_INLINE I load_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static HA_INLINE I load_s8(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static HA_INLINE void store_u8(uint8_t* p, I x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x)); }
  static HA_INLINE void store_s8(int8_t* p, I x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x)); }
  static HA_INLINE void store_lo8(uint8_t* p, I x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x)); }
  static HA_INLINE void store_bytes(uint8_t* lo, int8_t* hi, I x) {
#ifdef __AVX512VBMI__  // one byte permute: the lanes' first bytes, then their second ones
    const __m512i idx = _mm512_set_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                        0, 0, 0, 0, 61, 57, 53, 49, 45, 41, 37, 33, 29, 25, 21, 17, 13, 9, 5, 1, 60, 56,
                                        52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0);
    const __m512i b = _mm512_permutexvar_epi8(idx, x);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_castsi512_si128(b));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm512_extracti32x4_epi32(b, 1));
#else
    store_lo8(lo, x);
    store_s8(hi, sra(x, 8));
#endif
  }
  static HA_INLINE void store_u16(void* p, I x) { _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x)); }
  static constexpr bool kLut = true;  // vpermt2d: 32 entries in two registers
  struct Lut {
    __m512i lo, hi;
  };
  static HA_INLINE Lut lut_load(const int32_t* t) { return {pin(_mm512_loadu_si512(t)), pin(_mm512_loadu_si512(t + 16))}; }
  static HA_INLINE Lut lut_rev(const int32_t* t, int32_t c) {  // entries c - t[i]
    return {isub(seti(c), _mm512_loadu_si512(t)), isub(seti(c), _mm512_loadu_si512(t + 16))};
  }
  static HA_INLINE I lut(const Lut& l, I idx) { return _mm512_permutex2var_epi32(l.lo, idx, l.hi); }
};
#endif

// ---------------------------------------------------------------- shared lane logic
// float32 bits + 0x7FFF + the lowest kept bit: its upper 16 bits are the bfloat16 rounded to nearest
// even (c10::BFloat16's rule) for every non-nan value; the lower 16 cleared: that value in float32
template <class L>
HA_INLINE typename L::I bf16_round_bits(typename L::F x) {
  const typename L::I u = L::bits(x);
  const typename L::I up = L::iadd(L::iadd(u, L::seti(0x7FFF)), L::iand(L::srl(u, 16), L::seti(1)));
  return L::iand(up, L::seti(static_cast<int32_t>(0xFFFF0000u)));
}
// round(x) to bfloat16 as float32 bits, nan -> 0x7FC00000 (the stored parameter's bits)
template <class L>
HA_INLINE typename L::I bf16_rounded(typename L::F x) {
  return L::iif(L::fnan(x), L::seti(0x7FC00000), bf16_round_bits<L>(x));
}
// round(x) to bfloat16 stored at p; returns the rounded values as float32 bits
HA_INLINE Lanes1::I Lanes1::store_bf16(at::BFloat16* p, F x) {
  const I r = bf16_rounded<Lanes1>(x);
  store_u16(p, srl(r, 16));
  return r;
}
#ifdef HALFADAM_AVX2
HA_INLINE Lanes8::I Lanes8::store_bf16(at::BFloat16* p, F x) {
  const I r = bf16_rounded<Lanes8>(x);
  store_u16(p, srl(r, 16));
  return r;
}
HA_INLINE void Lanes8::store(at::BFloat16* p, F x) { store_bf16(p, x); }
#endif
#ifdef HALFADAM_AVX512
// vcvtneps2bf16 rounds to nearest even in one instruction but flushes denormal inputs to zero: a vector
// with one rounds by integers (the pattern of a nan may differ: any nan is a nan)
HA_INLINE Lanes16::I Lanes16::store_bf16(at::BFloat16* p, F x) {
#ifdef __AVX512BF16__
  if (_mm512_fpclass_ps_mask(x.x, 0x20) == 0) {
    const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x.x));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
    return widen_hi16(h);
  }
#endif
  const I r = bf16_rounded<Lanes16>(x);
  store_hi16(p, r);
  return r;
}
HA_INLINE void Lanes16::store(at::BFloat16* p, F x) { store_bf16(p, x); }
#endif

// round(x) to P, as a float32 (P = float: x itself)
template <class L> HA_INLINE typename L::F round_to(float, typename L::F x) { return x; }
template <class L> HA_INLINE typename L::F round_to(at::BFloat16, typename L::F x) { return L::fromb(bf16_rounded<L>(x)); }
template <class L> HA_INLINE typename L::F round_to(at::Half, typename L::F x) {
  at::Half h;
  L::store(&h, x);
  return L::load(&h);
}
#ifdef HALFADAM_AVX2
template <> HA_INLINE V8 round_to<Lanes8>(at::Half, V8 x) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(x.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif
#ifdef HALFADAM_AVX512
template <> HA_INLINE V16 round_to<Lanes16>(at::Half, V16 x) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(x.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// halfadam.functional.written: another value (nan on either side: an unordered compare) or a zero of
// the other sign (the sign bits differ)
template <class L>
HA_INLINE typename L::M written(typename L::F p, typename L::F r) {
  return L::mor(L::fneq(p, r), L::igt(L::seti(0), L::ixor(L::bits(p), L::bits(r))));
}
// The master-sync test, written(p, round(w)).
template <class L, typename P>
HA_INLINE typename L::M stale(typename L::F p, typename L::F w) {
  if constexpr (std::is_same<P, at::BFloat16>::value)  // a nan w is stale whatever its rounded bits are
    return L::mor(written<L>(p, L::fromb(bf16_round_bits<L>(w))), L::fnan(w));
  else
    return written<L>(p, round_to<L>(P(), w));
}
// encodings._fp16_ulp: 2**(max(e, -14) - 10) for |x| in [2**e, 2**(e+1)), from x's float32 bits
template <class L>
HA_INLINE typename L::F fp16_ulp(typename L::F x) {
  typename L::I e = L::iand(L::srl(L::bits(x), 23), L::seti(0xFF));
  e = L::imax(e, L::seti(127 - 14));
  return L::fromb(L::sll(L::isub(e, L::seti(10)), 23));
}

// The hash's multipliers, made once before a loop that hashes (pinned: with AVX2's 16 registers GCC
// else makes each again per vector from a general register, mov, vmovd and vpbroadcastd, where the
// pinned one spilled is one load folded into the vpmulld)
template <class L>
struct Mixers {
  typename L::I m1 = L::pin(L::seti(0x7FEB352D)), m2 = L::pin(L::seti(0x2C1B3C6D)), m3 = L::pin(L::seti(0x297A2D39));
};
// encodings._random_bits of an element's position x with the seed folded in:
// seed_term = (step * 0x27D4EB2F + _SALT) mod 2**32
template <class L>
HA_INLINE typename L::I hash(typename L::I x, typename L::I seed_term, const Mixers<L>& k) {
  typename L::I h = L::ixor(x, seed_term);
  h = L::imul(L::ixor(h, L::srl(h, 16)), k.m1);
  h = L::imul(L::ixor(h, L::srl(h, 15)), k.m2);
  h = L::imul(L::ixor(h, L::srl(h, 16)), k.m3);
  return L::ixor(h, L::srl(h, 15));
}
// hash of the W positions position0 + lane (mod 2**32). Where position0 is a multiple of W, the
// lanes differ in bits below 16 only: x = position0 ^ seed_term is one value, and the first round's
// h ^ (h >> 16) is (x ^ (x >> 16)) ^ lane.
template <class L>
HA_INLINE typename L::I hash_at(uint32_t position0, uint32_t seed_term, const Mixers<L>& k) {
  using I = typename L::I;
  if (L::W == 1 || (position0 & (L::W - 1)) != 0)
    return hash<L>(L::iadd(L::seti(static_cast<int32_t>(position0)), L::iota()), L::seti(static_cast<int32_t>(seed_term)), k);
  const uint32_t x = position0 ^ seed_term;
  I h = L::imul(L::ixor(L::seti(static_cast<int32_t>(x ^ (x >> 16))), L::iota()), k.m1);
  h = L::imul(L::ixor(h, L::srl(h, 15)), k.m2);
  h = L::imul(L::ixor(h, L::srl(h, 16)), k.m3);
  return L::ixor(h, L::srl(h, 15));
}
// encodings._moment_bits: exp_avg's 16 random bits are the hash's upper half, exp_avg_sq's its lower
// (low16: 0xFFFF in every lane, an encoder's pinned one in its loop)
template <class L, bool EXP_AVG>
HA_INLINE typename L::I moment_bits(typename L::I h, typename L::I low16 = L::seti(0xFFFF)) {
  return EXP_AVG ? L::srl(h, 16) : L::iand(h, low16);
}

// ---------------------------------------------------------------- uint8 moments
// A block's decoding or encoding constants from its base exponent (mod 2**32, whatever the stored byte):
// unit_bits = base << 23, and unit, that float (2**(base - 127)).
struct BlockCode {
  int32_t unit_bits;
  float unit;
  static BlockCode of(int32_t base) {
    const uint32_t ub = static_cast<uint32_t>(base) << 23;
    return {static_cast<int32_t>(ub), bits_to_float(ub)};
  }
};

// The tier of each lane's magnitude code k (decode) or of its value's bits less unit_bits, t (encode),
// by compares: the shift 23 - mantissa (decode) or 7 - mantissa (encode), and the tier's entry of `ks`
// (the tiers' k, or for decoding unit_bits - k); for a code or value above the subnormals (those take
// the lowest tier's, fixed by the callers).
template <class L, bool EXP_AVG, bool DECODE>
HA_INLINE void tier_of(typename L::I key, const int32_t* ks, typename L::I* shift, typename L::I* k) {
  using S = Spec<EXP_AVG>;
  constexpr int kBase = DECODE ? 23 : 7;
  *shift = L::seti(kBase - S::kRows.row[0].mantissa);
  *k = L::seti(ks[0]);
  for (size_t i = 1; i < S::kTierCount; ++i) {  // unrolled: the rows are constants
    const TierRow& row = S::kRows.row[i];
    const typename L::M taken = DECODE ? L::igt(key, L::seti(row.first - 1)) : L::igt(key, L::seti((row.r0 << 23) - 1));
    *shift = L::iif(taken, L::seti(kBase - row.mantissa), *shift);
    *k = L::iif(taken, L::seti(ks[i]), *k);
  }
}
template <bool EXP_AVG>
struct TierKs {  // the tiers' k, in an array
  int32_t k[Spec<EXP_AVG>::kTierCount];
  constexpr TierKs() : k{} {
    for (size_t i = 0; i < Spec<EXP_AVG>::kTierCount; ++i) k[i] = Spec<EXP_AVG>::kRows.row[i].k;
  }
};

// A uint8 moment's decoder for one block (its stored base): per code, the bits (k << shift) + uk with
// uk = unit_bits - the tier's k (a subnormal code: unit_bits, less unit after).
template <class L, bool EXP_AVG>
struct Decoder {
  using I = typename L::I;
  static constexpr bool kLut = L::kLut && Luts<EXP_AVG>::kDecode;
  BlockCode bc;
  typename L::Lut shift_lut, uk_lut;
  int32_t uk[Spec<EXP_AVG>::kTierCount];
  explicit Decoder(const BlockCode& code) : bc(code) {
    if constexpr (kLut) {
      shift_lut = L::lut_load(Luts<EXP_AVG>::kDec.shift);
      uk_lut = L::lut_rev(Luts<EXP_AVG>::kDec.k, bc.unit_bits);
    } else {
      for (size_t i = 0; i < Spec<EXP_AVG>::kTierCount; ++i)
        uk[i] = static_cast<int32_t>(static_cast<uint32_t>(bc.unit_bits) - static_cast<uint32_t>(Spec<EXP_AVG>::kRows.row[i].k));
    }
  }
  HA_INLINE void tier(I k, I* shift, I* ukv) const {
    if constexpr (kLut) {
      const I idx = L::srl(k, Spec<EXP_AVG>::kM0);
      *shift = L::lut(shift_lut, idx);
      *ukv = L::lut(uk_lut, idx);
    } else {
      tier_of<L, EXP_AVG, true>(k, uk, shift, ukv);
    }
  }
};

// encodings._decode_moment for uint8 codes (encodings._decode_magnitude; then the reserved codes and
// exp_avg's sign bit). NORMAL: every code is of a tier's binades (codes_normal), none subnormal or reserved.
template <class L, bool EXP_AVG, bool NORMAL>
HA_INLINE typename L::F decode_u8(typename L::I code, const Decoder<L, EXP_AVG>& d) {
  using I = typename L::I;
  using S = Spec<EXP_AVG>;
  const I k = EXP_AVG ? L::iand(code, L::seti(S::kMask)) : code;
  I shift, uk;
  d.tier(k, &shift, &uk);
  typename L::F value;
  if (NORMAL) {
    value = L::fromb(L::iadd(L::sllv(k, shift), uk));
  } else {  // a subnormal code: (k << (23 - mantissa)) + unit_bits, less unit
    const typename L::M sub = L::igt(L::seti(1 << S::kM0), k);
    value = L::fromb(L::iadd(L::sllv(k, shift), L::iif(sub, L::seti(d.bc.unit_bits), uk)));
    value = L::fif(sub, value - L::set(d.bc.unit), value);
    value = L::fif(L::ieq(k, L::seti(S::kInf)), L::set(std::numeric_limits<float>::infinity()), value);
  }
  if (EXP_AVG)  // the sign bit (a nan's is dropped below)
    value = L::fromb(L::ixor(L::bits(value), L::sll(L::iand(code, L::seti(128)), 24)));
  if (!NORMAL)
    value = L::fif(L::ieq(k, L::seti(S::kNan)), L::set(std::numeric_limits<float>::quiet_NaN()), value);
  return value;
}
// Whether every code of a whole block is of a tier's binades (2**mantissa of the lowest tier up to the
// reserved codes; codes above the tiers' top decode by the top tier, as the spec does them)
template <bool EXP_AVG>
inline bool codes_normal(const uint8_t* c) {
  using S = Spec<EXP_AVG>;
  constexpr uint8_t kMask = static_cast<uint8_t>(S::kMask);
  constexpr uint8_t kLow = 1 << S::kM0;
  constexpr uint8_t kSpan = static_cast<uint8_t>(S::kReserved - 1 - kLow);  // k - kLow <= kSpan
#if defined(HALFADAM_AVX512)
  const __m512i mask = _mm512_set1_epi8(static_cast<char>(kMask)), low = _mm512_set1_epi8(static_cast<char>(kLow));
  const __m512i span = _mm512_set1_epi8(static_cast<char>(kSpan));
  const __m512i a = _mm512_sub_epi8(_mm512_and_si512(_mm512_loadu_si512(c), mask), low);
  const __m512i b = _mm512_sub_epi8(_mm512_and_si512(_mm512_loadu_si512(c + 64), mask), low);
  return (_mm512_cmpgt_epu8_mask(a, span) | _mm512_cmpgt_epu8_mask(b, span)) == 0;
#elif defined(HALFADAM_AVX2)
  const __m256i mask = _mm256_set1_epi8(static_cast<char>(kMask)), low = _mm256_set1_epi8(static_cast<char>(kLow));
  __m256i top = _mm256_setzero_si256();
  for (int j = 0; j < BLOCK; j += 32)
    top = _mm256_max_epu8(top, _mm256_sub_epi8(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j)), mask), low));
  const __m256i over = _mm256_cmpeq_epi8(_mm256_min_epu8(top, _mm256_set1_epi8(static_cast<char>(kSpan))), top);
  return _mm256_movemask_epi8(over) == -1;
#else
  for (int j = 0; j < BLOCK; ++j)
    if (static_cast<uint8_t>((c[j] & kMask) - kLow) > kSpan) return false;
  return true;
#endif
}
// Decode n codes of one block into out (a whole block of codes_normal ones by the shorter path).
template <class L, bool EXP_AVG>
HA_INLINE void decode_block(const uint8_t* codes, int64_t n, const BlockCode& bc, float* out) {
  const Decoder<L, EXP_AVG> d(bc);
  int64_t j = 0;
  if (L::W > 1 && n == BLOCK && codes_normal<EXP_AVG>(codes)) {
    for (; j < BLOCK; j += L::W) L::store(out + j, decode_u8<L, EXP_AVG, true>(L::load_u8(codes + j), d));
    return;
  }
  for (; j + L::W <= n; j += L::W) L::store(out + j, decode_u8<L, EXP_AVG, false>(L::load_u8(codes + j), d));
  if (j < n) {
    const Decoder<Lanes1, EXP_AVG> d1(bc);
    for (; j < n; ++j) out[j] = decode_u8<Lanes1, EXP_AVG, false>(codes[j], d1);
  }
}

// The tiers of encoding: by the value's binade over the base (t >> 23) where the lanes have a lookup,
// else by compares.
template <class L, bool EXP_AVG>
struct Encoder {
  using I = typename L::I;
  static constexpr bool kLut = L::kLut && Luts<EXP_AVG>::kEncode;
  static constexpr TierKs<EXP_AVG> kKs{};
  typename L::Lut shift_lut, k_lut;
  // exp_avg_sq's rounding term's constants, made once (pinned: not again per vector)
  I byte = L::pin(L::seti(255)), c256 = L::pin(L::seti(256)), c5 = L::pin(L::seti(5)), c11 = L::pin(L::seti(11)),
    low16 = L::pin(L::seti(0xFFFF)), offset = L::pin(L::seti(kEncodeOffset<EXP_AVG> << 23));
  Encoder() {
    if constexpr (kLut) {
      shift_lut = L::lut_load(Luts<EXP_AVG>::kEnc.shift);
      k_lut = L::lut_load(Luts<EXP_AVG>::kEnc.k);
    }
  }
  // t >= 0 unless !NORMAL (then a subnormal's, t < 0, comes out as the lowest tier's)
  template <bool NORMAL>
  HA_INLINE void tier(I t, I* shift, I* k) const {
    if constexpr (kLut) {
      constexpr int32_t kOffset = kEncodeOffset<EXP_AVG>;
      I idx = L::sra(kOffset ? L::isub(t, offset) : t, 23);
      if (!NORMAL || kOffset) idx = L::imax(idx, L::seti(0));
      *shift = L::lut(shift_lut, idx);
      *k = L::lut(k_lut, idx);
    } else {
      tier_of<L, EXP_AVG, false>(t, kKs.k, shift, k);
    }
  }
};

// encodings._encode_moment_ for uint8 of float32 x over a block's new base (BlockCode bc) with the
// element's hash h. encodings._encode_magnitude with its offsets written out: for t = the magnitude's
// bits - unit_bits (its binade over the base in bits 23 and up) in a tier, ((t + k) >> (23 - mantissa)),
// rounded with the 16 random bits added below the kept ones: (((t + k) >> (7 - mantissa)) + bits) >> 16
// (t + k >= 0: the same integer); a subnormal one (t < 0) uses the bits of a + unit less unit_bits.
// NORMAL: every value of the block is finite with a magnitude >= unit (and exp_avg_sq's is >= 0), so
// that no lane needs a selection of its own.
template <class L, bool EXP_AVG, bool NORMAL>
HA_INLINE typename L::I encode_u8(typename L::F x, typename L::I h, const BlockCode& bc, const Encoder<L, EXP_AVG>& en) {
  using I = typename L::I;
  using M = typename L::M;
  using S = Spec<EXP_AVG>;
  const I b = L::bits(x);
  const I mag = EXP_AVG || !NORMAL ? L::iand(b, L::seti(0x7FFFFFFF)) : b;
  M nf{};
  I a = mag;
  if (!NORMAL) {  // the finite magnitude (0 for nan and inf)
    nf = L::igt(mag, L::seti(0x7F7FFFFF));
    a = L::iif(nf, L::seti(0), mag);
  }
  const I unit_bits = L::seti(bc.unit_bits);
  const I t = L::isub(a, unit_bits);
  I shift, tk;
  en.template tier<NORMAL>(t, &shift, &tk);
  I y = L::iadd(t, tk);
  if (!NORMAL) {  // subnormals: the bits of a + unit (k = 0)
    const M sub = L::igt(L::seti(0), t);
    y = L::iif(sub, L::isub(L::bits(L::fromb(a) + L::set(bc.unit)), unit_bits), y);
  }
  const I kept = L::srlv(y, shift);  // the kept bits, then 16 of remainder
  I rounding = moment_bits<L, EXP_AVG>(h, en.low16);
  if (!EXP_AVG) {  // encodings._encode_magnitude: + (5 f8 (256 - f8)) >> max(mantissa + 4, 6), mantissa = 7 - shift
    const I f8 = L::iand(L::srl(kept, 8), en.byte);
    const I q = L::imul(f8, L::isub(en.c256, f8));
    const I by = L::isub(en.c11, L::imin(shift, en.c5));  // encodings._V_ROUNDING_MIN_SHIFT
    rounding = L::iadd(rounding, L::srlv(L::iadd(L::sll(q, 2), q), by));
  }
  const I k = L::srl(L::iadd(kept, rounding), 16);
  if (EXP_AVG) {  // the sign bit; nan (its sign dropped) and +-inf
    const I sign = L::iand(L::srl(b, 24), L::seti(128));
    if (NORMAL) return L::ior(k, sign);
    const M nan = L::igt(mag, L::seti(0x7F800000));
    const I code = L::iif(nf, L::iif(nan, L::seti(S::kNan), L::seti(S::kInf)), k);
    return L::ior(code, L::iif(nan, L::seti(0), sign));
  }
  if (NORMAL) return k;  // >= 2**mantissa
  // exp_avg_sq: x > 0 (a positive float's bits, signed, are > 0) never to 0; x <= 0 to 0; +inf, and
  // nan (-inf too)
  const I code = L::iif(L::igt(b, L::seti(0)), L::imax(k, L::seti(1)), L::seti(0));
  return L::iif(nf, L::iif(L::ieq(b, L::seti(0x7F800000)), L::seti(S::kInf), L::seti(S::kNan)), code);
}

// A block's new values' running extremes, kept by the loop: exp_avg's of bits << 1 (the magnitude),
// exp_avg_sq's of the bits themselves (a sign bit, nan and inf are all above +inf's), as unsigned.
struct Extremes {
  uint32_t max, min;
};
// The block's base exponent (encodings._block_base: max(E - SPAN, 1) for E the biased exponent of its
// largest finite magnitude) and whether encode_u8<NORMAL> applies to all of it.
struct Plan {
  int32_t base;
  bool normal;
};
// The largest bits << 1 of x[0..n)'s finite values (the exact maximum for a block with a nan or an inf)
inline uint32_t finite_max2(const float* x, int64_t n) {
  uint32_t mx = 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t m2 = float_to_bits(x[j]) << 1;
    if (m2 < 0xFF000000u) mx = std::max(mx, m2);
  }
  return mx;
}
template <bool EXP_AVG>
inline Plan plan(const float* x, int64_t n, Extremes e) {
  constexpr int32_t kSpan = Spec<EXP_AVG>::kSpan;
  if (EXP_AVG) {
    if (e.max >= 0xFF000000u) return {std::max(static_cast<int32_t>(finite_max2(x, n) >> 24) - kSpan, 1), false};
    const int32_t base = std::max(static_cast<int32_t>(e.max >> 24) - kSpan, 1);
    return {base, e.min >= static_cast<uint32_t>(base) << 24};
  }
  if (e.max >= 0x7F800000u) return {std::max(static_cast<int32_t>(finite_max2(x, n) >> 24) - kSpan, 1), false};
  const int32_t base = std::max(static_cast<int32_t>(e.max >> 23) - kSpan, 1);
  return {base, e.min >= static_cast<uint32_t>(base) << 23};
}
// The running extremes as the loop keeps them, of n values
template <bool EXP_AVG>
inline Extremes extremes(const float* x, int64_t n) {
  Extremes e{0, 0xFFFFFFFFu};
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t b = EXP_AVG ? float_to_bits(x[j]) << 1 : float_to_bits(x[j]);
    e.max = std::max(e.max, b), e.min = std::min(e.min, b);
  }
  return e;
}

// Encode n values of one block (mx: exp_avg's new values, vx: exp_avg_sq's), writing n codes each and
// the block's scale. One hash per element serves both moments (HASHED: the elements' hashes are in
// `hashes`, computed for a split8 master's rounding; else computed here).
template <class L, bool M8, bool V8, bool NORMAL_M, bool NORMAL_V, bool HASHED = false>
HA_INLINE void encode_lanes(const float* mx, const float* vx, uint8_t* mc, uint8_t* vc, int64_t n, const BlockCode& mb,
                            const BlockCode& vb, uint32_t position0, uint32_t seed_term, const int32_t* hashes = nullptr) {
  using I = typename L::I;
  const Encoder<L, true> me;
  const Encoder<L, false> ve;
  const Mixers<L> mix;
  for (int64_t j = 0; j + L::W <= n; j += L::W) {
    const I h = HASHED ? L::loadi(hashes + j) : hash_at<L>(position0 + static_cast<uint32_t>(j), seed_term, mix);
    if (M8) L::store_u8(mc + j, encode_u8<L, true, NORMAL_M>(L::load(mx + j), h, mb, me));
    if (V8) L::store_u8(vc + j, encode_u8<L, false, NORMAL_V>(L::load(vx + j), h, vb, ve));
  }
}
template <class L, bool M8, bool V8, bool HASHED = false>
HA_INLINE void encode_block(const float* mx, const float* vx, uint8_t* mc, uint8_t* vc, int64_t n, Extremes me,
                             Extremes ve, uint8_t* m_scale, uint8_t* v_scale, uint32_t position0, uint32_t seed_term,
                             const int32_t* hashes = nullptr) {
  const Plan mp = M8 ? plan<true>(mx, n, me) : Plan{1, true}, vp = V8 ? plan<false>(vx, n, ve) : Plan{1, true};
  if (M8) *m_scale = static_cast<uint8_t>(mp.base);
  if (V8) *v_scale = static_cast<uint8_t>(vp.base);
  const BlockCode mb = BlockCode::of(mp.base), vb = BlockCode::of(vp.base);
  const int64_t body = L::W > 1 ? n / L::W * L::W : 0;
  const uint32_t p0 = position0, st = seed_term;
  if (mp.normal && vp.normal) encode_lanes<L, M8, V8, true, true, HASHED>(mx, vx, mc, vc, body, mb, vb, p0, st, hashes);
  else if (mp.normal) encode_lanes<L, M8, V8, true, false, HASHED>(mx, vx, mc, vc, body, mb, vb, p0, st, hashes);
  else if (vp.normal) encode_lanes<L, M8, V8, false, true, HASHED>(mx, vx, mc, vc, body, mb, vb, p0, st, hashes);
  else encode_lanes<L, M8, V8, false, false, HASHED>(mx, vx, mc, vc, body, mb, vb, p0, st, hashes);
  if (body < n)
    encode_lanes<Lanes1, M8, V8, false, false, HASHED>(mx + body, vx + body, mc + body, vc + body, n - body, mb, vb,
                                                       position0 + static_cast<uint32_t>(body), seed_term,
                                                       HASHED ? hashes + body : nullptr);
}

// ---------------------------------------------------------------- the step
enum class Master { kNone, kFp32, kSplit, kSplit8 };
// The update rules (halfadam.functional.Rule.kernel): the lines of lanes() between the moments' loads
// and the new weight are the rule's, the rest is shared.
enum Rule : int { kAdam = 0, kSgd = 1, kLion = 2 };

struct Item {
  void* param;
  const void* grad;
  int64_t numel;
  int64_t offset;        // into the flat per-element buffers (a multiple of BLOCK: split master, uint8 moment)
  int64_t block_offset;  // its first block's index in the flat per-block buffers (master_tie, *_scale)
  int64_t row_length;    // elements per row of blocks (a divisor of numel; 0 only with numel 0)
  int64_t position;      // its first element's index in its whole parameter (a shard's; the random bits' positions)
};

struct Step {
  float* master;            // fp32 master weights (Master::kFp32)
  int8_t* master_hi;        // split master (Master::kSplit): remainder bytes and per-block tie lane + 1;
                            // split8 (Master::kSplit8): master_hi alone, the 8-bit remainder
  uint8_t* master_lo;
  uint8_t* master_tie;
  void* exp_avg;            // float32, bfloat16 or uint8 codes (MA), and the same for exp_avg_sq (MV);
  void* exp_avg_sq;         // null where the rule keeps no such moment (NoMoment)
  uint8_t* exp_avg_scale;   // uint8 moments: one base exponent per block (else null)
  uint8_t* exp_avg_sq_scale;
  float c[9];               // the rule's coefficients (Adam 8, SGD and Lion 6, the rest 0), then the gradient scale
  bool scaled;              // a gradient scale (else c[8] is not applied)
  bool l2, optimized;       // Adam: decay "l2" (else decoupled), optimized_update; SGD: l2 = weight decay on
  bool nesterov;            // SGD: nesterov momentum
  uint32_t seed_term;       // the random bits' seed (the step and the salt)
};

// The rule's coefficients in lanes (Step::c, in the order the Python side passes them), the gradient scale
// and the hash's multipliers (a bfloat16 moment's hashes).
template <class L, int RULE>
struct Coefficients;
template <class L>
struct Coefficients<L, kAdam> {
  typename L::F decay_factor, l2, step_size, sqrt_bias_correction2, one_minus_beta1, beta2, one_minus_beta2, eps,
      grad_scale;
  Mixers<L> mix;  // a bfloat16 moment's hashes
  explicit Coefficients(const float* c)
      : decay_factor(L::set(c[0])), l2(L::set(c[1])), step_size(L::set(c[2])), sqrt_bias_correction2(L::set(c[3])),
        one_minus_beta1(L::set(c[4])), beta2(L::set(c[5])), one_minus_beta2(L::set(c[6])), eps(L::set(c[7])),
        grad_scale(L::set(c[8])) {}
};
template <class L>
struct Coefficients<L, kSgd> {
  typename L::F l2, momentum_a, momentum_b, nesterov_momentum, lr, sign, grad_scale;
  Mixers<L> mix;
  explicit Coefficients(const float* c)
      : l2(L::set(c[0])), momentum_a(L::set(c[1])), momentum_b(L::set(c[2])), nesterov_momentum(L::set(c[3])),
        lr(L::set(c[4])), sign(L::set(c[5])), grad_scale(L::set(c[8])) {}
};
template <class L>
struct Coefficients<L, kLion> {
  typename L::F decay_factor, beta1, one_minus_beta1, beta2, one_minus_beta2, grad_scale;
  // s * lr for the sign's three values s = 1 - 0, 0 - 1 and 0 - 0 (+1, -1, +0), each product made once here
  // (one float32 rounding each, as in the lanes: the same bits), so that the lanes select one: two blends
  // for two blends, a subtraction and a multiplication (about 6% off Lion's step over split8 and bfloat16)
  typename L::F lr_up, lr_down, lr_zero;
  Mixers<L> mix;
  explicit Coefficients(const float* c)
      : decay_factor(L::set(c[0])), beta1(L::set(c[2])), one_minus_beta1(L::set(c[3])), beta2(L::set(c[4])),
        one_minus_beta2(L::set(c[5])), grad_scale(L::set(c[8])), lr_up(L::set(1.0f * c[1])),
        lr_down(L::set(-1.0f * c[1])), lr_zero(L::set(0.0f * c[1])) {}
};

// The per-block values the lanes of one block share.
template <class L>
struct Block {
  int64_t start;           // the block's first element (an index into the parameter)
  int32_t tie_lane = -1;   // split: the lane whose remainder is +2**15 (decode)
  int32_t first_tie = -1;  // split: the first new remainder of +2**15 (encode)
  float* m_buf;            // uint8 moments: the block's values, decoded, then updated in place
  float* v_buf;
  float* w_buf;            // split, split8: the block's new weights (store_split, store_split8 store them)
  int32_t* h_buf;          // split8: the block's hashes, computed once for the master's and the moments' bits
  typename L::I m_max, m_min, v_max, v_min;  // ... and their new values' running extremes (Extremes)
};

// A moment slot the rule does not keep (SGD's and Lion's exp_avg_sq, SGD's exp_avg without momentum):
// nothing loaded, nothing stored, no scale.
struct NoMoment {};
template <typename T> constexpr bool is_u8 = std::is_same<T, uint8_t>::value;
template <typename T> constexpr bool is_bf16 = std::is_same<T, at::BFloat16>::value;
template <typename T> constexpr bool is_none = std::is_same<T, NoMoment>::value;

// A moment's lanes at state index e (block lane j): float32, bfloat16, or a uint8 moment's decoded value
// (NoMoment: 0, never used).
template <class L, typename MT>
HA_INLINE typename L::F load_moment(const void* state, int64_t e, const float* buf) {
  if constexpr (is_none<MT>) return L::set(0.0f);
  else if constexpr (is_u8<MT>) return L::load(buf);
  else return L::load(static_cast<const MT*>(state) + e);
}
// ... and the new value stored: float32; bfloat16 by stochastic rounding (add 16 random bits below
// bf16's, truncate: encodings._encode_moment_; a nan as bf16's nan); uint8: into the block's buffer, with its extremes.
template <class L, typename MT, bool EXP_AVG>
HA_INLINE void store_moment(void* state, int64_t e, typename L::F x, typename L::I h, float* buf, typename L::I& mx,
                            typename L::I& mn) {
  if constexpr (is_none<MT>) {
    return;
  } else if constexpr (is_u8<MT>) {
    L::store(buf, x);
    const typename L::I b = EXP_AVG ? L::sll(L::bits(x), 1) : L::bits(x);
    mx = L::umax(mx, b);
    mn = L::umin(mn, b);
  } else if constexpr (is_bf16<MT>) {
    // a nan is stored as bfloat16's (its bits plus the random ones could carry into the sign bit)
    L::store_hi16(static_cast<at::BFloat16*>(state) + e,
                  L::iif(L::fnan(x), L::seti(0x7FC00000), L::iadd(L::bits(x), moment_bits<L, EXP_AVG>(h))));
  } else {
    L::store(static_cast<float*>(state) + e, x);
  }
}

// ---------------------------------------------------------------- the split8 master (encodings.py)
// encodings._BF16_MAX_BITS: the largest finite bfloat16's float32 bits (its magnitude)
constexpr int32_t kBf16MaxBits = 0x7F7F0000;

// encodings._split8_decode: the master from a bfloat16 parameter p (as float32) and its 8-bit remainder c
// (int8, sign-extended): the bits p + 256 c, + 1 where c = -128; p itself where p is +-0, nan or +-inf.
// (No master sync: every such master rounds to p, a written p included.)
template <class L>
HA_INLINE typename L::F split8_decode(typename L::F p, typename L::I c) {
  const typename L::I r = L::iif(L::ieq(c, L::seti(-128)), L::seti(-128 * 256 + 1), L::sll(c, 8));
  return L::fif(L::special(p), p, L::fromb(L::iadd(L::bits(p), r)));
}
// encodings._master_bits: the split8 master's 8 random bits from the element's hash h, one more
// xor-shift-multiply round and its upper byte
template <class L>
HA_INLINE typename L::I master_bits(typename L::I h, const Mixers<L>& k) {
  return L::srl(L::imul(L::ixor(h, L::srl(h, 16)), k.m1), 24);
}

// The new moments of elements i .. i + W - 1 (block lane j, state index e) stored: one hash per element
// where a bfloat16 moment rounds with it (kept in h_buf for a split8 master's bits, store_split8).
template <class L, Master MS, typename MA, typename MV>
HA_INLINE void store_moments(const Step& s, const Item& it, const Mixers<L>& mix, Block<L>& blk, int64_t i, int64_t e,
                             int32_t j, typename L::F m, typename L::F v) {
  typename L::I h{};
  if constexpr (is_bf16<MA> || is_bf16<MV>) {
    h = hash_at<L>(static_cast<uint32_t>(it.position + i), s.seed_term, mix);
    if constexpr (MS == Master::kSplit8) L::storei(blk.h_buf + j, h);  // for store_split8
  }
  store_moment<L, MA, true>(s.exp_avg, e, m, h, blk.m_buf + j, blk.m_max, blk.m_min);
  store_moment<L, MV, false>(s.exp_avg_sq, e, v, h, blk.v_buf + j, blk.v_max, blk.v_min);
}

// Elements i .. i + W - 1 of one parameter (all in block `blk`). RULE: the update rule (kAdam, kSgd,
// kLion), P: the parameter's dtype, G: the gradient's, MS: how the master is kept (kNone: the parameter,
// float32, is the weight), MA / MV: exp_avg's and exp_avg_sq's dtypes (float, at::BFloat16 or uint8_t;
// NoMoment: a slot the rule does not keep).
template <class L, int RULE, typename P, typename G, Master MS, typename MA, typename MV>
HA_INLINE void lanes(const Step& s, const Item& it, const Coefficients<L, RULE>& c, Block<L>& blk, int64_t i) {
  using F = typename L::F;
  using I = typename L::I;
  P* param = static_cast<P*>(it.param);
  const G* grad = static_cast<const G*>(it.grad);
  const int64_t e = it.offset + i;                        // the state index
  const int32_t j = static_cast<int32_t>(i - blk.start);  // the lane in the block
  F w, p;
  F g = L::load(grad + i);
  if (s.scaled) g = g * c.grad_scale;
  if constexpr (MS == Master::kNone) {
    w = L::load(reinterpret_cast<const float*>(param) + i);
  } else {
    p = L::load(param + i);
    if constexpr (MS == Master::kFp32) {
      w = L::load(s.master + e);
      w = L::fif(stale<L, P>(p, w), p, w);  // master sync
    } else if constexpr (MS == Master::kSplit8) {
      w = split8_decode<L>(p, L::load_s8(s.master_hi + e));
    } else {  // r = hi * 256 + lo, + 65536 in the block's tie lane
      I r = L::iadd(L::sll(L::load_s8(s.master_hi + e), 8), L::load_u8(s.master_lo + e));
      if (static_cast<uint32_t>(blk.tie_lane - j) < static_cast<uint32_t>(L::W))
        r = L::iif(L::ieq(L::iota(), L::seti(blk.tie_lane - j)), L::iadd(r, L::seti(65536)), r);
      if constexpr (is_bf16<P>) {
        // master = p + r in bits; no remainder over +-0, nan or inf; and the master sync: for such a p
        // the bits p + r round to nearest even (in bits: exact) to p exactly where |r| + (p odd) <= 2**15.
        // Outside the tie lane r is in [-2**15, 2**15 - 1] (whatever the bytes): only r = -2**15 over an
        // odd p is written.
        const I pb = L::bits(p), wb = L::iadd(pb, r);
        typename L::M drop;
        if (static_cast<uint32_t>(blk.tie_lane - j) < static_cast<uint32_t>(L::W))
          drop = L::igt(L::iadd(L::iabs(r), L::iand(L::srl(pb, 16), L::seti(1))), L::seti(32768));
        else  // r == -2**15 and p odd
          drop = L::test_mask(L::ieq(r, L::seti(-32768)), pb, 0x10000);
        w = L::fif(L::mor(L::special(p), drop), p, L::fromb(wb));
      } else {  // p + r * ulp(p) / 2**16
        w = p + L::cvtif(r) * (fp16_ulp<L>(p) * L::set(1.0f / 65536.0f));
        w = L::fif(L::mor(L::special(p), stale<L, P>(p, w)), p, w);
      }
    }
  }
  F m = load_moment<L, MA>(s.exp_avg, e, blk.m_buf + j);
  F v = load_moment<L, MV>(s.exp_avg_sq, e, blk.v_buf + j);
  if constexpr (RULE == kAdam) {  // halfadam.functional.adam_elementwise_
    if (s.l2) g = g + c.l2 * w; else w = w * c.decay_factor;
    m = m + (g - m) * c.one_minus_beta1;
    v = v * c.beta2 + (g * c.one_minus_beta2) * g;
    // the moments stored before the sqrt and divisions (in program order: not behind them)
    store_moments<L, MS, MA, MV>(s, it, c.mix, blk, i, e, j, m, v);
    const F root = L::fsqrt(v);
    const F d = s.optimized ? root + c.eps : root / c.sqrt_bias_correction2 + c.eps;
    w = w - (m / d) * c.step_size;
  } else if constexpr (RULE == kSgd) {  // m: the momentum buffer (NoMoment: none)
    static_assert(is_none<MV>, "SGD keeps no exp_avg_sq");
    g = g * c.sign;
    if (s.l2) g = g + c.l2 * w;
    F d = g;
    if constexpr (!is_none<MA>) {
      m = m * c.momentum_a + g * c.momentum_b;
      store_moments<L, MS, MA, MV>(s, it, c.mix, blk, i, e, j, m, v);
      d = s.nesterov ? g + m * c.nesterov_momentum : m;
    }
    w = w - d * c.lr;
  } else {
    static_assert(RULE == kLion && !is_none<MA> && is_none<MV>, "Lion keeps exp_avg alone");
    w = w * c.decay_factor;
    const F u = m * c.beta1 + g * c.one_minus_beta1;
    const F zero = L::set(0.0f);  // s = (u > 0 ? 1 : 0) - (u < 0 ? 1 : 0); s * lr: one of three (Coefficients)
    w = w - L::fif(L::fgt(zero, u), c.lr_down, L::fif(L::fgt(u, zero), c.lr_up, c.lr_zero));
    m = m * c.beta2 + g * c.one_minus_beta2;
    store_moments<L, MS, MA, MV>(s, it, c.mix, blk, i, e, j, m, v);
  }
  if constexpr (MS == Master::kFp32) L::store(s.master + e, w);
  if constexpr (MS == Master::kSplit || MS == Master::kSplit8) {  // to the block's buffer: store_split(8) stores them
    L::store(blk.w_buf + j, w);
  } else if constexpr (MS != Master::kNone) {
    L::store(param + i, w);
  } else {
    L::store(reinterpret_cast<float*>(param) + i, w);
  }
}

// A split master's new weights of elements i .. i + W - 1 (block lane j), from the block's buffer once
// the lanes of the whole block have put them there (apart, the chains of sqrt and divisions of a block's
// lanes overlap more of each other): round once, the parameter's bits, and the remainder over them.
template <class L, typename P>
HA_INLINE void store_split(const Step& s, const Item& it, Block<L>& blk, int64_t i) {
  using F = typename L::F;
  using I = typename L::I;
  P* param = static_cast<P*>(it.param);
  const int64_t e = it.offset + i;
  const int32_t j = static_cast<int32_t>(i - blk.start);
  const F w = L::load(blk.w_buf + j);
  I q;
  if constexpr (is_bf16<P>) {
    // remainder: the difference of bit patterns, 0 over a nan or an infinity; within [-2**15, 2**15]
    const I rb = L::store_bf16(param + i, w);
    q = L::sub_unless(L::nonfinite(L::fromb(rb)), L::bits(w), rb);
  } else {  // (w - rounded) / ulp(rounded) * 2**16, to nearest
    L::store(param + i, w);
    const F rounded = round_to<L>(P(), w);
    const F ratio = (w - rounded) / fp16_ulp<L>(rounded) * L::set(65536.0f);
    q = L::imax(L::iif(L::nonfinite(rounded), L::seti(0), L::round_i(ratio)), L::seti(-32768));
  }
  // the tie rule: the block's first remainder of +2**15 is stored as -2**15 (flagged by the tie
  // byte), any other is clamped to 2**15 - 1 with the rest
  const int ties = L::bitmask(L::ieq(q, L::seti(32768)));
  q = L::imin(q, L::seti(32767));
  if (ties != 0 && blk.first_tie < 0) {
    const int lane = __builtin_ctz(static_cast<unsigned>(ties));
    blk.first_tie = j + lane;
    q = L::iif(L::ieq(L::iota(), L::seti(lane)), L::seti(-32768), q);
  }
  L::store_bytes(s.master_lo + e, s.master_hi + e, q);
}

// A split8 master's new weights w of elements i .. i + W - 1 (block lane j), from the block's buffer
// (encodings._split8_encode_ with the step's rounding): p = round(w) (nearest even), the remainder
// r = bits(w) - bits(p) rounded stochastically with the element's 8 random bits, c = (r + bits) >> 8
// (floor); c = 128 moves p one bfloat16 value away from zero (its bits + 2**16) with c = -128, unless
// p is the largest finite magnitude (c = 127); c = 0 over a p of +-0, nan or +-inf.
// HASHED: the lanes' hashes are in the block's h_buf (a bfloat16 moment's); KEEP: put them there (for a
// uint8 moment's encode_block).
template <class L>
struct Split8Constants {  // store_split8's, made once per run (pinned: not again per vector)
  using I = typename L::I;
  I magnitude = L::pin(L::seti(0x7FFFFFFF)), top = L::pin(L::seti(kBf16MaxBits)), c128 = L::pin(L::seti(128)),
    ulp = L::pin(L::seti(65536)), c127 = L::pin(L::seti(127)), cm128 = L::pin(L::seti(-128));
  Mixers<L> mix;
};
template <class L, bool HASHED, bool KEEP>
HA_INLINE void store_split8(const Step& s, const Item& it, Block<L>& blk, int64_t i, const Split8Constants<L>& k) {
  using I = typename L::I;
  using M = typename L::M;
  at::BFloat16* param = static_cast<at::BFloat16*>(it.param);
  const int64_t e = it.offset + i;
  const int32_t j = static_cast<int32_t>(i - blk.start);
  const typename L::F w = L::load(blk.w_buf + j);
  const I pb = bf16_rounded<L>(w);  // round(w)'s float32 bits (nan: bf16's nan)
  const M sp = L::special(L::fromb(pb));
  I h;
  if constexpr (HASHED) {
    h = L::loadi(blk.h_buf + j);
  } else {
    h = hash_at<L>(static_cast<uint32_t>(it.position + i), s.seed_term, k.mix);
    if constexpr (KEEP) L::storei(blk.h_buf + j, h);
  }
  const I rnd = master_bits<L>(h, k.mix);
  I c = L::sra(L::iadd(L::isub(L::bits(w), pb), rnd), 8);
  const M top = L::ieq(L::iand(pb, k.magnitude), k.top);
  const M bump = L::mandn(L::mor(sp, top), L::ieq(c, k.c128));
  L::store_hi16(param + i, L::iif(bump, L::iadd(pb, k.ulp), pb));
  c = L::iif(bump, k.cm128, L::imin(c, k.c127));
  L::store_s8(s.master_hi + e, L::iif(sp, L::seti(0), c));
}

// Blocks j0..j1 of one parameter, each W lanes at a time (L), its tail one at a time. Block j is the
// column c = j % per_row of row r = j / per_row (per_row = ceil(row_length / BLOCK)): elements
// r * row_length + c * BLOCK up to BLOCK of them, the row's end first. Where BLOCK divides row_length,
// or the row is the whole parameter, that is j * BLOCK: one division per call, none per block or element.
template <class L, int RULE, typename P, typename G, Master MS, typename MA, typename MV>
void run(const Step& step, const Item& item, int64_t j0, int64_t j1) {
  constexpr bool kM8 = is_u8<MA>, kV8 = is_u8<MV>;
  const Step s = step;  // local copies: the stores through byte pointers cannot change them
  const Item it = item;
  const Coefficients<L, RULE> cl(s.c);
  const Coefficients<Lanes1, RULE> c1(s.c);
  // split8: one hash per element for the master and the moments, in h_buf where a moment needs it too
  constexpr bool kHashed = MS == Master::kSplit8 && (is_bf16<MA> || is_bf16<MV>);  // by the lanes
  constexpr bool kKeepHash = MS == Master::kSplit8 && (kM8 || kV8);                // for encode_block
  constexpr bool kWeights = MS == Master::kSplit || MS == Master::kSplit8;  // through w_buf
  alignas(64) float m_buf[kM8 ? BLOCK : 1], v_buf[kV8 ? BLOCK : 1], w_buf[kWeights ? BLOCK : 1];
  alignas(64) int32_t h_buf[kHashed || kKeepHash ? BLOCK : 1];
  const Split8Constants<L> split8_constants;
  const Split8Constants<Lanes1> split8_constants1;
  const int64_t length = it.row_length, per_row = (length + BLOCK - 1) / BLOCK;
  // block j's row's first element, and the block's first element's place in the row
  int64_t row = j0 / per_row * length, column = j0 % per_row * BLOCK;
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t start = row + column, end = std::min(start + BLOCK, row + length), n = end - start;
    const int64_t block = it.block_offset + j;
    column += BLOCK;
    if (column >= length) {  // the row's last block: the next one starts a row
      column = 0;
      row += length;
    }
    uint8_t* const m_codes = kM8 ? static_cast<uint8_t*>(s.exp_avg) + it.offset + start : nullptr;
    uint8_t* const v_codes = kV8 ? static_cast<uint8_t*>(s.exp_avg_sq) + it.offset + start : nullptr;
    if constexpr (kM8) decode_block<L, true>(m_codes, n, BlockCode::of(s.exp_avg_scale[block]), m_buf);
    if constexpr (kV8) decode_block<L, false>(v_codes, n, BlockCode::of(s.exp_avg_sq_scale[block]), v_buf);
    Block<L> bl;
    bl.start = start;
    if constexpr (MS == Master::kSplit) bl.tie_lane = static_cast<int32_t>(s.master_tie[block]) - 1;
    bl.m_buf = m_buf;
    bl.v_buf = v_buf;
    bl.w_buf = w_buf;
    bl.h_buf = h_buf;
    bl.m_max = bl.v_max = L::seti(0);
    bl.m_min = bl.v_min = L::seti(-1);
    int64_t i = start;
    for (; i + L::W <= end; i += L::W) lanes<L, RULE, P, G, MS, MA, MV>(s, it, cl, bl, i);
    Extremes me{L::hmax_u(bl.m_max), L::hmin_u(bl.m_min)}, ve{L::hmax_u(bl.v_max), L::hmin_u(bl.v_min)};
    const int64_t body = i;  // the tail after it, one at a time
    Block<Lanes1> b1;
    b1.start = start;
    b1.tie_lane = bl.tie_lane;
    b1.m_buf = m_buf;
    b1.v_buf = v_buf;
    b1.w_buf = w_buf;
    b1.h_buf = h_buf;
    if (i < end) {  // the tail
      b1.m_max = static_cast<int32_t>(me.max), b1.m_min = static_cast<int32_t>(me.min);
      b1.v_max = static_cast<int32_t>(ve.max), b1.v_min = static_cast<int32_t>(ve.min);
      for (; i < end; ++i) lanes<Lanes1, RULE, P, G, MS, MA, MV>(s, it, c1, b1, i);
      me = {static_cast<uint32_t>(b1.m_max), static_cast<uint32_t>(b1.m_min)};
      ve = {static_cast<uint32_t>(b1.v_max), static_cast<uint32_t>(b1.v_min)};
    }
    if constexpr (MS == Master::kSplit) {  // the new weights in order (the tie rule's first), then the tie
      for (i = start; i < body; i += L::W) store_split<L, P>(s, it, bl, i);
      b1.first_tie = bl.first_tie;
      for (; i < end; ++i) store_split<Lanes1, P>(s, it, b1, i);
      s.master_tie[block] = static_cast<uint8_t>(b1.first_tie + 1);  // 0: no tie
    }
    if constexpr (MS == Master::kSplit8) {  // the new weights' rounding and 8-bit remainders
      for (i = start; i < body; i += L::W) store_split8<L, kHashed, kKeepHash>(s, it, bl, i, split8_constants);
      for (; i < end; ++i) store_split8<Lanes1, kHashed, kKeepHash>(s, it, b1, i, split8_constants1);
    }
    // the n elements of a short block (a row's last, or the parameter's): the padding's zeros change no
    // maximum, and their codes (0) are not written
    if constexpr (kM8 || kV8)
      encode_block<L, kM8, kV8, MS == Master::kSplit8>(m_buf, v_buf, m_codes, v_codes, n, me, ve, s.exp_avg_scale + block,
                                                       s.exp_avg_sq_scale + block,
                                                       static_cast<uint32_t>(it.position + start), s.seed_term, h_buf);
  }
}

using RunFn = void (*)(const Step&, const Item&, int64_t, int64_t);

// The lane width adam_step runs (tests set a narrower one: set_lanes).
#if defined(HALFADAM_AVX512)
constexpr int kMaxLanes = 16;
#elif defined(HALFADAM_AVX2)
constexpr int kMaxLanes = 8;
#else
constexpr int kMaxLanes = 1;
#endif
std::atomic<int> g_lanes{kMaxLanes};

template <int RULE, typename P, typename G, Master MS, typename MA, typename MV>
RunFn pick_lanes() {
  switch (g_lanes.load()) {
#ifdef HALFADAM_AVX512
    case 16: return &run<Lanes16, RULE, P, G, MS, MA, MV>;
#endif
#ifdef HALFADAM_AVX2
    case 8: return &run<Lanes8, RULE, P, G, MS, MA, MV>;
#endif
    default: return &run<Lanes1, RULE, P, G, MS, MA, MV>;
  }
}

// Gradients are float32 or the parameter's dtype (adam_step converts others first).
template <int RULE, typename P, Master MS, typename MA, typename MV>
RunFn pick_grad(bool float_grad) {
  return float_grad ? pick_lanes<RULE, P, float, MS, MA, MV>() : pick_lanes<RULE, P, P, MS, MA, MV>();
}

// Callers check supported() first: any other dtype never reaches these switches.
template <int RULE, typename MA, typename MV>
RunFn pick_param(at::ScalarType param, bool float_grad, Master ms) {
  if (param == at::kFloat)  // float32 parameters: no master, or an fp32 one (master_weights=True)
    return ms == Master::kNone ? pick_lanes<RULE, float, float, Master::kNone, MA, MV>()
                               : pick_lanes<RULE, float, float, Master::kFp32, MA, MV>();
  if (param == at::kHalf)
    return ms == Master::kSplit ? pick_grad<RULE, at::Half, Master::kSplit, MA, MV>(float_grad)
                                : pick_grad<RULE, at::Half, Master::kFp32, MA, MV>(float_grad);
  if (ms == Master::kSplit8)  // bfloat16 parameters only (adam_step checks)
    return pick_grad<RULE, at::BFloat16, Master::kSplit8, MA, MV>(float_grad);
  return ms == Master::kSplit ? pick_grad<RULE, at::BFloat16, Master::kSplit, MA, MV>(float_grad)
                              : pick_grad<RULE, at::BFloat16, Master::kFp32, MA, MV>(float_grad);
}

// The exp_avg slot's dtype picks MA (NONE: at::ScalarType::Undefined, the slot absent, picks NoMoment:
// SGD without momentum).
template <int RULE, typename MV, bool NONE>
RunFn pick_m(at::ScalarType exp_avg, at::ScalarType param, bool float_grad, Master ms) {
  if (exp_avg == at::kByte) return pick_param<RULE, uint8_t, MV>(param, float_grad, ms);
  if (exp_avg == at::kBFloat16) return pick_param<RULE, at::BFloat16, MV>(param, float_grad, ms);
  if constexpr (NONE)
    if (exp_avg == at::ScalarType::Undefined) return pick_param<RULE, NoMoment, MV>(param, float_grad, ms);
  return pick_param<RULE, float, MV>(param, float_grad, ms);
}

template <typename MA>
RunFn pick_v(at::ScalarType exp_avg_sq, at::ScalarType param, bool float_grad, Master ms) {
  if (exp_avg_sq == at::kByte) return pick_param<kAdam, MA, uint8_t>(param, float_grad, ms);
  if (exp_avg_sq == at::kBFloat16) return pick_param<kAdam, MA, at::BFloat16>(param, float_grad, ms);
  return pick_param<kAdam, MA, float>(param, float_grad, ms);
}

// Adam: both moments, 3 x 3 dtypes; SGD: exp_avg of 3 dtypes or none, Lion: exp_avg of 3 dtypes, and
// neither an exp_avg_sq (adam_step checks the slots against the rule): 7 more runs per (parameter,
// gradient, master, lanes) beside Adam's 9, not 2 x 16.
RunFn pick(int64_t rule, at::ScalarType exp_avg, at::ScalarType exp_avg_sq, at::ScalarType param, bool float_grad,
           Master ms) {
  if (rule == kSgd) return pick_m<kSgd, NoMoment, true>(exp_avg, param, float_grad, ms);
  if (rule == kLion) return pick_m<kLion, NoMoment, false>(exp_avg, param, float_grad, ms);
  if (exp_avg == at::kByte) return pick_v<uint8_t>(exp_avg_sq, param, float_grad, ms);
  if (exp_avg == at::kBFloat16) return pick_v<at::BFloat16>(exp_avg_sq, param, float_grad, ms);
  return pick_v<float>(exp_avg_sq, param, float_grad, ms);
}

bool supported(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

uint32_t seed_term(int64_t step) {
  return static_cast<uint32_t>(static_cast<uint64_t>(step) * 0x27D4EB2Full + kSalt);
}

}  // namespace

// One step of update rule `rule` (0 Adam, 1 SGD, 2 Lion: halfadam.functional.Rule.kernel) for params[k]
// (gradient grads[k]; state in the flat buffers of `state`, keyed as halfadam.encodings names them, a
// rule's moments under the kernel's slots: its signed one as exp_avg, its square one as exp_avg_sq; per
// element at offsets[k], per block at block_offsets[k]; in rows of row_lengths[k] elements,
// halfadam.buckets.Bucket.row_lengths), k = 0..K-1. `coefficients`: the rule's (Adam 8, SGD and Lion 6);
// `l2`, `optimized_update`: its flags (Adam: decay "l2", optimized_update; SGD: weight decay on, nesterov;
// Lion: ignored). Adam needs both slots; Lion exp_avg alone, SGD exp_avg (momentum) or no moment. `step`
// seeds the stochastic rounding; `positions`: each parameter's first element's index in its whole
// parameter (empty: 0). Every argument is checked before anything is written.
void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const std::map<std::string, at::Tensor>& state, const std::vector<int64_t>& offsets,
               const std::vector<int64_t>& block_offsets, const std::vector<int64_t>& row_lengths,
               const std::vector<double>& coefficients, const c10::optional<at::Tensor>& grad_scale, bool l2,
               bool optimized_update, int64_t step, const std::vector<int64_t>& positions, int64_t rule) {
  const int64_t K = static_cast<int64_t>(params.size());
  TORCH_CHECK(static_cast<int64_t>(grads.size()) == K && static_cast<int64_t>(offsets.size()) == K &&
                  (positions.empty() || static_cast<int64_t>(positions.size()) == K),
              "adam_step: params, grads, offsets and positions differ in length");
  TORCH_CHECK(static_cast<int64_t>(block_offsets.size()) == K && static_cast<int64_t>(row_lengths.size()) == K,
              "adam_step: block_offsets (", block_offsets.size(), ") and row_lengths (", row_lengths.size(),
              ") must have one entry per parameter (", K, ")");
  TORCH_CHECK(rule == kAdam || rule == kSgd || rule == kLion, "adam_step: rule ", rule,
              " is none of 0 (Adam), 1 (SGD) and 2 (Lion)");
  const char* rule_name = rule == kAdam ? "Adam" : rule == kSgd ? "SGD" : "Lion";
  const size_t n_coefficients = rule == kAdam ? 8 : 6;
  TORCH_CHECK(coefficients.size() == n_coefficients, "adam_step: rule ", rule, " (", rule_name, ") expected ",
              n_coefficients, " coefficients, got ", coefficients.size());
  auto get = [&](const char* key, at::ScalarType dtype) -> at::Tensor {  // undefined if absent
    auto found = state.find(key);
    if (found == state.end()) return at::Tensor();
    const at::Tensor& t = found->second;
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.dim() == 1,
                "adam_step: state['", key, "'] must be a contiguous 1-D ", dtype, " CPU tensor");
    return t;
  };
  // a moment slot's dtype: kept (float32, bfloat16 or uint8), or at::ScalarType::Undefined where the
  // rule lets it be absent (`may_lack`) and it is; `kept`: whether the rule keeps it at all
  auto moment_dtype = [&](const char* key, bool kept, bool may_lack) {
    const auto found = state.find(key);
    TORCH_CHECK(kept || found == state.end(), "adam_step: rule ", rule, " (", rule_name, ") keeps no '", key,
                "': state['", key, "'] must be absent");
    if (found == state.end() && may_lack) return at::ScalarType::Undefined;
    TORCH_CHECK(found != state.end() && (found->second.scalar_type() == at::kFloat ||
                                         found->second.scalar_type() == at::kBFloat16 ||
                                         found->second.scalar_type() == at::kByte),
                "adam_step: state['", key, "'] must be float32, bfloat16 or uint8");
    return found->second.scalar_type();
  };
  const at::ScalarType adtype = moment_dtype("exp_avg", true, rule == kSgd);
  const at::ScalarType vdtype = moment_dtype("exp_avg_sq", rule == kAdam, rule != kAdam);
  const at::Tensor exp_avg = get("exp_avg", adtype), exp_avg_sq = get("exp_avg_sq", vdtype);
  // the per-element buffers' length: the moments', else the master's (-1: no per-element state at all,
  // SGD without momentum over float32 parameters)
  int64_t total_state = exp_avg.defined() ? exp_avg.numel() : exp_avg_sq.defined() ? exp_avg_sq.numel() : -1;
  TORCH_CHECK(!exp_avg.defined() || !exp_avg_sq.defined() || exp_avg_sq.numel() == total_state,
              "adam_step: exp_avg and exp_avg_sq differ in length");
  const bool m8 = adtype == at::kByte, v8 = vdtype == at::kByte;
  const at::Tensor m_scale = get("exp_avg_scale", at::kByte), v_scale = get("exp_avg_sq_exponent", at::kByte);
  TORCH_CHECK(m8 == m_scale.defined() && v8 == v_scale.defined(),
              "adam_step: a uint8 moment needs its *_scale (uint8, one per block), and only a uint8 one has it");
  const at::Tensor master = get("master_weight", at::kFloat);
  const at::Tensor hi = get("master_hi", at::kChar), lo = get("master_lo", at::kByte);
  const at::Tensor tie = get("master_tie", at::kByte);
  // master_hi without master_lo (and master_tie): a split8 master
  const Master ms = master.defined()                ? Master::kFp32
                    : lo.defined() || tie.defined() ? Master::kSplit
                    : hi.defined()                  ? Master::kSplit8
                                                    : Master::kNone;
  if (total_state < 0) {  // no moment: the master's per-element buffer gives the length
    const at::Tensor& first = master.defined() ? master : hi.defined() ? hi : lo;
    if (first.defined()) total_state = first.numel();
  }
  if (ms == Master::kFp32) TORCH_CHECK(master.numel() == total_state, "adam_step: master_weight's length");
  if (ms == Master::kSplit)
    TORCH_CHECK(hi.defined() && lo.defined() && tie.defined() && hi.numel() == total_state && lo.numel() == total_state,
                "adam_step: a split master needs master_hi, master_lo (one per element) and master_tie (one per block)");
  if (ms == Master::kSplit8)
    TORCH_CHECK(hi.numel() == total_state, "adam_step: a split8 master needs master_hi (one per element)");
  // the per-block buffers (one entry per block of every parameter, block_offsets into them): one length
  const bool blocked = ms == Master::kSplit || m8 || v8;
  int64_t total_blocks = -1;
  for (const at::Tensor* t : {&tie, &m_scale, &v_scale}) {
    if (!t->defined()) continue;
    TORCH_CHECK(total_blocks < 0 || t->numel() == total_blocks,
                "adam_step: master_tie, exp_avg_scale and exp_avg_sq_exponent differ in length");
    total_blocks = t->numel();
  }
  for (const auto& kv : state)
    TORCH_CHECK(kv.first == "master_weight" || kv.first == "master_hi" || kv.first == "master_lo" ||
                    kv.first == "master_tie" || kv.first == "exp_avg" || kv.first == "exp_avg_sq" ||
                    kv.first == "exp_avg_scale" || kv.first == "exp_avg_sq_exponent",
                "adam_step: unsupported state entry '", kv.first, "'");

  Step s{};
  s.master = ms == Master::kFp32 ? master.data_ptr<float>() : nullptr;
  s.master_hi = ms == Master::kSplit || ms == Master::kSplit8 ? hi.data_ptr<int8_t>() : nullptr;
  s.master_lo = ms == Master::kSplit ? lo.data_ptr<uint8_t>() : nullptr;
  s.master_tie = ms == Master::kSplit ? tie.data_ptr<uint8_t>() : nullptr;
  s.exp_avg = exp_avg.defined() ? exp_avg.data_ptr() : nullptr;
  s.exp_avg_sq = exp_avg_sq.defined() ? exp_avg_sq.data_ptr() : nullptr;
  s.exp_avg_scale = m8 ? m_scale.data_ptr<uint8_t>() : nullptr;
  s.exp_avg_sq_scale = v8 ? v_scale.data_ptr<uint8_t>() : nullptr;
  for (size_t j = 0; j < n_coefficients; ++j) s.c[j] = static_cast<float>(coefficients[j]);
  s.scaled = grad_scale.has_value() && grad_scale->defined();
  s.c[8] = s.scaled ? grad_scale->item<float>() : 1.0f;
  s.l2 = rule != kLion && l2;
  s.optimized = rule == kAdam && optimized_update;
  s.nesterov = rule == kSgd && optimized_update;
  s.seed_term = seed_term(step);

  // Validate everything before writing anything; non-contiguous tensors go through contiguous copies.
  std::vector<Item> items(K);
  std::vector<RunFn> fns(K);
  std::vector<int64_t> starts(K + 1, 0);  // in blocks: params[k]'s are starts[k] .. starts[k + 1]
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
    TORCH_CHECK(ms != Master::kSplit8 || p.scalar_type() == at::kBFloat16, "adam_step: params[", k, "] (",
                p.scalar_type(), "): a split8 master (master_hi without master_lo) needs a bfloat16 parameter");
    TORCH_CHECK(ms != Master::kSplit || p.scalar_type() != at::kFloat, "adam_step: params[", k,
                "]: a split master needs a float16/bfloat16 parameter");
    TORCH_CHECK(g.numel() == n, "adam_step: grads[", k, "] has ", g.numel(), " elements, its parameter ", n);
    TORCH_CHECK(offsets[k] >= 0 && (total_state < 0 || offsets[k] + n <= total_state) &&
                    (!blocked || offsets[k] % BLOCK == 0),
                "adam_step: offsets[", k, "] out of range or not block-aligned");
    // rows of row_length elements, each cut into blocks of BLOCK (its last one shorter)
    const int64_t length = row_lengths[k];
    TORCH_CHECK(n == 0 ? length >= 0 : length > 0 && n % length == 0, "adam_step: row_lengths[", k, "] = ", length,
                " does not divide params[", k, "]'s ", n, " elements into rows");
    const int64_t blocks = n == 0 ? 0 : n / length * ((length + BLOCK - 1) / BLOCK);
    TORCH_CHECK(!blocked || (block_offsets[k] >= 0 && block_offsets[k] + blocks <= total_blocks),
                "adam_step: block_offsets[", k, "] = ", block_offsets[k], ": params[", k, "]'s ", blocks,
                " blocks do not fit the per-block buffers (", total_blocks, " entries)");
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
    items[k] = Item{p.data_ptr(), g.data_ptr(), n, offsets[k], block_offsets[k], length,
                    positions.empty() ? 0 : positions[k]};
    fns[k] = pick(rule, adtype, vdtype, p.scalar_type(), g.scalar_type() == at::kFloat, ms);
    starts[k + 1] = starts[k] + blocks;
  }
  {
    pybind11::gil_scoped_release no_gil;
    at::parallel_for(0, starts[K], GRAIN / BLOCK, [&](int64_t begin, int64_t end) {
      int64_t k = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
      for (int64_t u = begin; u < end; ++k) {
        const int64_t stop = std::min(end, starts[k + 1]);
        if (stop > u) fns[k](s, items[k], u - starts[k], stop - starts[k]);
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
// _decode_moment's bytes and values), at the lane width adam_step runs: x (float32) and codes (uint8) a
// multiple of BLOCK long, scale (uint8) one per block, positions from 0, `step` the seed.
static void check_uint8_args(const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.numel() % BLOCK == 0 && scale.device().is_cpu() && scale.scalar_type() == at::kByte &&
                  scale.is_contiguous() && scale.numel() * BLOCK == codes.numel(),
              "uint8 codes (a multiple of ", BLOCK, " long) and uint8 scale (one per block), contiguous, on the CPU");
}

template <class L>
static void encode_blocks(const float* x, uint8_t* codes, uint8_t* scale, int64_t blocks, bool exp_avg, uint32_t seed) {
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t j = b * BLOCK;
    const Extremes none{0, 0xFFFFFFFFu};
    if (exp_avg) encode_block<L, true, false>(x + j, nullptr, codes + j, nullptr, BLOCK, extremes<true>(x + j, BLOCK), none,
                                              scale + b, nullptr, static_cast<uint32_t>(j), seed);
    else encode_block<L, false, true>(nullptr, x + j, nullptr, codes + j, BLOCK, none, extremes<false>(x + j, BLOCK),
                                      nullptr, scale + b, static_cast<uint32_t>(j), seed);
  }
}
template <class L, bool EXP_AVG>
static void decode_blocks(const uint8_t* codes, const uint8_t* scale, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b)
    decode_block<L, EXP_AVG>(codes + b * BLOCK, BLOCK, BlockCode::of(scale[b]), out + b * BLOCK);
}

void encode_uint8(const at::Tensor& x, at::Tensor codes, at::Tensor scale, bool exp_avg, int64_t step) {
  check_uint8_args(codes, scale);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() == codes.numel(),
              "encode_uint8: x must be a contiguous float32 CPU tensor as long as codes");
  const float* xs = x.data_ptr<float>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  uint8_t* sc = scale.data_ptr<uint8_t>();
  const int64_t blocks = scale.numel();
  const uint32_t seed = seed_term(step);
  switch (g_lanes.load()) {
#ifdef HALFADAM_AVX512
    case 16: encode_blocks<Lanes16>(xs, out, sc, blocks, exp_avg, seed); break;
#endif
#ifdef HALFADAM_AVX2
    case 8: encode_blocks<Lanes8>(xs, out, sc, blocks, exp_avg, seed); break;
#endif
    default: encode_blocks<Lanes1>(xs, out, sc, blocks, exp_avg, seed);
  }
}

at::Tensor decode_uint8(const at::Tensor& codes, const at::Tensor& scale, bool exp_avg) {
  check_uint8_args(codes, scale);
  at::Tensor out = at::empty({codes.numel()}, codes.options().dtype(at::kFloat));
  const uint8_t* in = codes.data_ptr<uint8_t>();
  const uint8_t* sc = scale.data_ptr<uint8_t>();
  float* values = out.data_ptr<float>();
  const int64_t blocks = scale.numel();
  switch (g_lanes.load()) {
#ifdef HALFADAM_AVX512
    case 16:
      exp_avg ? decode_blocks<Lanes16, true>(in, sc, blocks, values) : decode_blocks<Lanes16, false>(in, sc, blocks, values);
      break;
#endif
#ifdef HALFADAM_AVX2
    case 8:
      exp_avg ? decode_blocks<Lanes8, true>(in, sc, blocks, values) : decode_blocks<Lanes8, false>(in, sc, blocks, values);
      break;
#endif
    default:
      exp_avg ? decode_blocks<Lanes1, true>(in, sc, blocks, values) : decode_blocks<Lanes1, false>(in, sc, blocks, values);
  }
  return out;
}

// The lane widths compiled in: 16 (AVX-512), 8 (AVX2), 1.
std::vector<int64_t> available_lanes() {
  std::vector<int64_t> widths;
#ifdef HALFADAM_AVX512
  widths.push_back(16);
#endif
#ifdef HALFADAM_AVX2
  widths.push_back(8);
#endif
  widths.push_back(1);
  return widths;
}

// The lane width adam_step, encode_uint8 and decode_uint8 run (tests: every width compiled in is
// checked on this machine); 0 gives the widest. Returns the previous width.
int64_t set_lanes(int64_t lanes) {
  const std::vector<int64_t> widths = available_lanes();
  if (lanes == 0) lanes = kMaxLanes;
  TORCH_CHECK(std::find(widths.begin(), widths.end(), lanes) != widths.end(), "set_lanes: ", lanes,
              " lanes are not compiled in");
  return g_lanes.exchange(static_cast<int>(lanes));
}

// The uint8 codes' constants compiled in (tests compare them with encodings._TIERS, _NAN_CODE, _INF_CODE,
// _MAGNITUDE_MASK and _SALT): {name: (tiers as (mantissa, binades) pairs, nan code, inf code, mask)}, salt.
std::pair<std::map<std::string, std::tuple<std::vector<std::pair<int64_t, int64_t>>, int64_t, int64_t, int64_t>>, int64_t>
uint8_codes() {
  std::map<std::string, std::tuple<std::vector<std::pair<int64_t, int64_t>>, int64_t, int64_t, int64_t>> out;
  std::vector<std::pair<int64_t, int64_t>> m, v;
  for (const Tier& t : Codes<true>::kTiers) m.emplace_back(t.mantissa, t.binades);
  for (const Tier& t : Codes<false>::kTiers) v.emplace_back(t.mantissa, t.binades);
  out["exp_avg"] = {m, Codes<true>::kNan, Codes<true>::kInf, Codes<true>::kMask};
  out["exp_avg_sq"] = {v, Codes<false>::kNan, Codes<false>::kInf, Codes<false>::kMask};
  return {out, kSalt};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam_step", &adam_step,
        "halfadam: one step of an update rule (0 Adam/AdamW, 1 SGD, 2 Lion) over a list of parameters with flat "
        "state buffers",
        pybind11::arg("params"), pybind11::arg("grads"), pybind11::arg("state"), pybind11::arg("offsets"),
        pybind11::arg("block_offsets"), pybind11::arg("row_lengths"), pybind11::arg("coefficients"),
        pybind11::arg("grad_scale"), pybind11::arg("l2"), pybind11::arg("optimized_update"), pybind11::arg("step"),
        pybind11::arg("positions"), pybind11::arg("rule") = 0);
  m.def("first_invalid", &first_invalid, "halfadam: index of the first invalid (param, grad) pair, or -1");
  m.def("encode_uint8", &encode_uint8, "halfadam (tests): the kernel's uint8 moment encoder over whole blocks");
  m.def("decode_uint8", &decode_uint8, "halfadam (tests): the kernel's uint8 moment decoder over whole blocks");
  m.def("available_lanes", &available_lanes, "halfadam (tests): the lane widths compiled in (16, 8, 1)");
  m.def("set_lanes", &set_lanes, "halfadam (tests): the lane width to run (0: the widest); returns the previous one");
  m.def("uint8_codes", &uint8_codes, "halfadam (tests): the uint8 codes' tiers, reserved codes, masks and salt compiled in");
}
