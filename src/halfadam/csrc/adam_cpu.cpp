// halfadam's hand-written CPU kernel: one Adam/AdamW step over a list of parameters whose fp32 state
// (master weights, exp_avg, exp_avg_sq) lives in flat buffers, in one call (the "cpp" implementation).
//
// The equations are halfadam.functional's, term for term and in the same order of operations
// (halfadam.functional.adam_elementwise_ with tensor coefficients, halfadam.functional.sync_master_);
// it is compiled with -ffp-contract=off so no multiply-add is fused into one rounding. Per element,
// with c = the coefficients of halfadam.functional.adam_coefficients:
//
//   g  = float(grad) [* grad_scale]
//   w  = master, or p where p != round(master)            (master sync; w = p for float32 params)
//   g  = g + c.l2 * w            (decay "l2")   |   w = w * c.decay_factor   (otherwise)
//   m  = m + (g - m) * c.one_minus_beta1
//   v  = v * c.beta2 + (g * c.one_minus_beta2) * g
//   d  = sqrt(v) + c.eps   (optimized_update)  |   d = sqrt(v) / c.sqrt_bias_correction2 + c.eps
//   w  = w - (m / d) * c.step_size
//   master = w;  p = round(w)   (round to nearest even, as Tensor.copy_)
//
// Work is split over torch's intra-op threads (at::parallel_for) by element ranges across the list.
// Each element is read and written once, in one loop: 8 lanes at a time with AVX2 (F16C converts
// float16, integer ops round bfloat16), one at a time for the tail and on other CPUs.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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
inline bool differ1(float a, float b) { return a != b; }  // true where either is nan

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

inline V8 load8(const float* p) { return _mm256_loadu_ps(p); }
inline V8 load8(const at::BFloat16* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
inline V8 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store8(float* p, V8 v) { _mm256_storeu_ps(p, v.x); }
inline __m128i bf16_bits8(V8 v) {
  const __m256i u = _mm256_castps_si256(v.x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v.x, v.x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline void store8(at::BFloat16* p, V8 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_bits8(v)); }
inline __m128i f16_bits8(V8 v) { return _mm256_cvtps_ph(v.x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline void store8(at::Half* p, V8 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), f16_bits8(v)); }
inline V8 differ8(V8 a, V8 b) { return _mm256_cmp_ps(a.x, b.x, _CMP_NEQ_UQ); }  // true where either is nan
// The master-sync test, p != round(w), per lane (all bits set where true).
template <typename P> inline V8 stale8(V8 p, V8 w);
template <> inline V8 stale8<float>(V8 p, V8 w) { return differ8(p, w); }
template <> inline V8 stale8<at::Half>(V8 p, V8 w) { return differ8(p, _mm256_cvtph_ps(f16_bits8(w))); }
template <> inline V8 stale8<at::BFloat16>(V8 p, V8 w) {
  // round(w) to bfloat16 kept in float32 bits: the rounding of bf16_bits8 without the packing; a nan w
  // is stale whatever those bits are (round(nan) is nan)
  const __m256i u = _mm256_castps_si256(w.x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb),
                                     _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm256_or_ps(differ8(p, _mm256_castsi256_ps(r)).x, _mm256_cmp_ps(w.x, w.x, _CMP_UNORD_Q));
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

struct Item {
  void* param;
  const void* grad;
  int64_t offset;  // into the flat state buffers
};

struct Step {
  float* master;  // nullptr: the parameter (float32) is the weight
  float* exp_avg;
  float* exp_avg_sq;
  float c[9];  // adam_coefficients, then the gradient scale (1 without one: g * 1 == g exactly)
};

// Elements a..b of one parameter. P: the parameter's dtype, G: the gradient's; MASTER: an fp32 master
// weight is updated (else the parameter, float32, is the weight).
template <typename P, typename G, bool MASTER, bool L2, bool OPTIMIZED>
void run(const Step& s, const Item& it, int64_t a, int64_t b) {
  P* param = static_cast<P*>(it.param);
  const G* grad = static_cast<const G*>(it.grad);
  float* master = MASTER ? s.master + it.offset : nullptr;
  float* m = s.exp_avg + it.offset;
  float* v = s.exp_avg_sq + it.offset;
  int64_t i = a;
#ifdef HALFADAM_AVX2
  const Coefficients<V8> c8(s.c);
  for (; i + 8 <= b; i += 8) {
    V8 w, mi = load8(m + i), vi = load8(v + i);
    const V8 g = load8(grad + i) * c8.grad_scale;
    if constexpr (MASTER) {
      const V8 p = load8(param + i);
      w = load8(master + i);
      w = select8(stale8<P>(p, w), w, p);  // master sync
    } else {
      w = load8(param + i);
    }
    adam_lanes<L2, OPTIMIZED>(w, g, mi, vi, c8);
    store8(m + i, mi);
    store8(v + i, vi);
    if constexpr (MASTER) store8(master + i, w);
    store8(param + i, w);
  }
#endif
  const Coefficients<float> c1(s.c);
  for (; i < b; ++i) {
    float w, mi = m[i], vi = v[i];
    const float g = load1(grad + i) * c1.grad_scale;
    if constexpr (MASTER) {
      const float p = load1(param + i);
      w = select1(differ1(p, round1<P>(master[i])), master[i], p);  // master sync
    } else {
      w = param[i];
    }
    adam_lanes<L2, OPTIMIZED>(w, g, mi, vi, c1);
    m[i] = mi;
    v[i] = vi;
    if constexpr (MASTER) master[i] = w;
    store1(param + i, w);
  }
}

using RunFn = void (*)(const Step&, const Item&, int64_t, int64_t);

template <typename P, typename G, bool MASTER>
RunFn pick3(bool l2, bool optimized) {
  return l2 ? (optimized ? &run<P, G, MASTER, true, true> : &run<P, G, MASTER, true, false>)
            : (optimized ? &run<P, G, MASTER, false, true> : &run<P, G, MASTER, false, false>);
}

template <typename P, bool MASTER>
RunFn pick2(at::ScalarType grad, bool l2, bool optimized) {
  switch (grad) {
    case at::kFloat: return pick3<P, float, MASTER>(l2, optimized);
    case at::kHalf: return pick3<P, at::Half, MASTER>(l2, optimized);
    default: return pick3<P, at::BFloat16, MASTER>(l2, optimized);
  }
}

// float16/bfloat16 parameters always have a master (checked by the caller), float32 ones may.
RunFn pick(at::ScalarType param, at::ScalarType grad, bool master, bool l2, bool optimized) {
  switch (param) {
    case at::kFloat: return master ? pick2<float, true>(grad, l2, optimized) : pick2<float, false>(grad, l2, optimized);
    case at::kHalf: return pick2<at::Half, true>(grad, l2, optimized);
    default: return pick2<at::BFloat16, true>(grad, l2, optimized);
  }
}

bool supported(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

}  // namespace

// One step for params[k] (gradient grads[k], state at offsets[k] of the flat buffers), k = 0..K-1.
void adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
               const c10::optional<at::Tensor>& master, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
               const std::vector<int64_t>& offsets, const std::vector<double>& coefficients,
               const c10::optional<at::Tensor>& grad_scale, bool l2, bool optimized_update) {
  const int64_t K = static_cast<int64_t>(params.size());
  TORCH_CHECK(static_cast<int64_t>(grads.size()) == K && static_cast<int64_t>(offsets.size()) == K,
              "adam_step: params, grads and offsets differ in length");
  TORCH_CHECK(coefficients.size() == 8, "adam_step: expected 8 coefficients");
  const bool has_master = master.has_value() && master->defined();
  auto check_state = [](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
                "adam_step: ", name, " must be a contiguous float32 CPU tensor");
  };
  check_state(exp_avg, "exp_avg");
  check_state(exp_avg_sq, "exp_avg_sq");
  if (has_master) {
    check_state(*master, "master");
    TORCH_CHECK(master->numel() == exp_avg.numel(), "adam_step: master and exp_avg differ in length");
  }
  TORCH_CHECK(exp_avg_sq.numel() == exp_avg.numel(), "adam_step: exp_avg and exp_avg_sq differ in length");

  Step s;
  s.master = has_master ? master->data_ptr<float>() : nullptr;
  s.exp_avg = exp_avg.data_ptr<float>();
  s.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  for (int j = 0; j < 8; ++j) s.c[j] = static_cast<float>(coefficients[j]);
  s.c[8] = grad_scale.has_value() && grad_scale->defined() ? grad_scale->item<float>() : 1.0f;

  // Validate everything before writing anything; non-contiguous tensors go through contiguous copies.
  std::vector<Item> items(K);
  std::vector<RunFn> fns(K);
  std::vector<int64_t> starts(K + 1, 0);
  std::vector<at::Tensor> keep;                                // contiguous copies of strided grads
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;   // (param, its contiguous copy)
  for (int64_t k = 0; k < K; ++k) {
    at::Tensor p = params[k], g = grads[k];
    const int64_t n = p.numel();
    TORCH_CHECK(p.device().is_cpu() && g.device().is_cpu(), "adam_step: params[", k, "] or its grad is not on the CPU");
    TORCH_CHECK(supported(p.scalar_type()) && supported(g.scalar_type()), "adam_step: params[", k,
                "]: unsupported dtype");
    TORCH_CHECK(has_master || p.scalar_type() == at::kFloat, "adam_step: params[", k,
                "]: float16/bfloat16 parameters need a master");
    TORCH_CHECK(g.numel() == n, "adam_step: grads[", k, "] has ", g.numel(), " elements, its parameter ", n);
    TORCH_CHECK(offsets[k] >= 0 && offsets[k] + n <= exp_avg.numel(), "adam_step: offsets[", k, "] out of range");
    if (!g.is_contiguous()) {
      g = g.contiguous();
      keep.push_back(g);
    }
    if (!p.is_contiguous()) {
      at::Tensor c = p.contiguous();
      write_back.emplace_back(p, c);
      p = c;
    }
    items[k] = Item{p.data_ptr(), g.data_ptr(), offsets[k]};
    fns[k] = pick(p.scalar_type(), g.scalar_type(), has_master, l2, optimized_update);
    starts[k + 1] = starts[k] + n;
  }
  const int64_t total = starts[K];
  {
    pybind11::gil_scoped_release no_gil;
    at::parallel_for(0, total, GRAIN, [&](int64_t begin, int64_t end) {
      int64_t k = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
      for (int64_t e = begin; e < end; ++k) {
        const int64_t stop = std::min(end, starts[k + 1]);
        if (stop > e) fns[k](s, items[k], e - starts[k], stop - starts[k]);
        e = stop;
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
  m.def("adam_step", &adam_step, "halfadam: one Adam/AdamW step over a list of parameters with flat fp32 state");
  m.def("first_invalid", &first_invalid, "halfadam: index of the first invalid (param, grad) pair, or -1");
}
