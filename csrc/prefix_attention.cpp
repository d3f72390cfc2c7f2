// Fused prefix attention on the CPU: every query row attends to [prefix ; tokens] of its example, forward and
// backward, without expanding the prefix over the batch, concatenating it with the token keys/values, or
// storing the attention probabilities or a dropout mask.
//
// Work is split by (example, head): one item gathers the keys its rows can see (the P prefix rows of its
// prompt, then the example's non-padded tokens) into small per-thread tiles, computes a block of up to
// kRowBlock query rows against all of them (scores, an exact softmax over the whole key row, dropout, the
// product with the values) and writes its output rows straight into a (B, S, H, D) buffer: the layout the
// attention function hands back to transformers, so no permute follows. Only the per-row natural-log
// log-sum-exp is saved; the backward recomputes the probabilities from it and regenerates the dropout mask
// from the seed (philox.h: the same keep decisions as the Triton kernels).
//
// The products run on a register-blocked micro-kernel written with GCC/Clang vector extensions and compiled
// for several x86-64 levels (target_clones: AVX-512, AVX2+FMA, baseline), chosen at load time; elementwise
// work (exp, the Philox rounds) is written so the compiler vectorises it in the same clones.
//
// Prefix gradients are reduced without atomics and independently of the thread count: the backward's items
// are (group of kGroup examples, head) with a fixed grouping; each writes its prefix partial sum to its own
// slot (one per group for a shared (H, P, D) prefix, one per example for a (T, H, P, D) prefix picked by
// prompt_index), and the slots are then summed into each prompt in slot order.
//
// float32 only: the Python side upcasts half inputs and sends float64 to the aten composite.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "philox.h"

// The vector helpers are always inlined, so the AVX-512 argument-passing ABI note does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(FASTPROMPT_NO_TARGET_CLONES)
#define FASTPROMPT_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FASTPROMPT_SIMD_CLONES
#endif

namespace fastprompt {
namespace {

constexpr int64_t kRowBlock = 64;  // query rows per tile
constexpr int64_t kLanes = 16;     // floats per vector of the micro-kernel; column dims are padded to it
constexpr int64_t kMr = 4;         // rows of the micro-kernel's register block
constexpr int64_t kGroup = 8;      // examples per backward item (fixed: the prefix reduction order)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

FASTPROMPT_INLINE vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

FASTPROMPT_INLINE void store(float* p, const vfloat& v) { std::memcpy(p, &v, sizeof(v)); }

// C (M x N, row stride ldc) = [C +] sum_k A(r, k) B(k, :), with A(r, k) = a[r * ars + k * aks] and B row-major
// (row stride ldb). M must be a multiple of kMr and N of kLanes (callers pad their tiles with zeros).
FASTPROMPT_SIMD_CLONES
void gemm(const float* __restrict a, int64_t ars, int64_t aks, const float* __restrict b, int64_t ldb,
          float* __restrict c, int64_t ldc, int64_t M, int64_t N, int64_t K, bool accumulate) {
  for (int64_t i = 0; i < M; i += kMr) {
    for (int64_t j = 0; j < N; j += kLanes) {
      vfloat acc[kMr];
      for (int r = 0; r < kMr; ++r) acc[r] = accumulate ? load(c + (i + r) * ldc + j) : vfloat{};
      const float* ai = a + i * ars;
      for (int64_t k = 0; k < K; ++k) {
        const vfloat bk = load(b + k * ldb + j);
        for (int r = 0; r < kMr; ++r) acc[r] += ai[r * ars + k * aks] * bk;
      }
      for (int r = 0; r < kMr; ++r) store(c + (i + r) * ldc + j, acc[r]);
    }
  }
}

typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));

// exp(x) for x <= 0, lane by lane (Cephes' expf polynomial, within 2 ulp; x is clamped at -87.3, so the result
// is at least 1.2e-38, never 0). Written with vector types: GCC does not vectorise the scalar form.
FASTPROMPT_INLINE vfloat vexp_nonpositive(const vfloat& x_in) {
  const vfloat lo = vfloat{} - 87.33654475f;
  const vfloat x = x_in > lo ? x_in : lo;
  const vfloat t = x * 1.44269504088896341f + 0.5f;
  const vint n0 = __builtin_convertvector(t, vint);  // floor(t) (t <= 0.5): truncation, minus one below a
  const vint n = n0 + (__builtin_convertvector(n0, vfloat) > t);  // negative fraction (a true compare is -1)
  const vfloat fn = __builtin_convertvector(n, vfloat);
  vfloat r = x - fn * 0.693359375f;
  r = r + fn * 2.12194440e-4f;
  vfloat y = vfloat{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const vint bits = (n + 127) << 23;  // 2^n, n >= -126
  return y * __builtin_bit_cast(vfloat, bits);
}

// s[c] = exp(s[c] * mul - sub) for c < np (a multiple of kLanes), every argument <= 0.
FASTPROMPT_INLINE void exp_row(float* s, int64_t np, float mul, float sub) {
  for (int64_t c = 0; c < np; c += kLanes) store(s + c, vexp_nonpositive(load(s + c) * mul - sub));
}

// Sums and maxima over np = a multiple of kLanes entries, with a fixed association (16 lanes, then the lanes in
// order): the compiler does not vectorise a float reduction written as a plain loop.
FASTPROMPT_INLINE float vsum(const float* x, int64_t np) {
  vfloat acc{};
  for (int64_t c = 0; c < np; c += kLanes) acc += load(x + c);
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

FASTPROMPT_INLINE float vdot(const float* x, const float* y, int64_t np) {
  vfloat acc{};
  for (int64_t c = 0; c < np; c += kLanes) acc += load(x + c) * load(y + c);
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

FASTPROMPT_INLINE float vmax(const float* x, int64_t np) {
  vfloat acc = load(x);
  for (int64_t c = kLanes; c < np; c += kLanes) {
    const vfloat v = load(x + c);
    acc = v > acc ? v : acc;
  }
  float m = acc[0];
  for (int l = 1; l < kLanes; ++l) m = std::max(m, acc[l]);
  return m;
}

// --------------------------------------------------------------------------------------------------------
// row-wise steps of the softmax over n visible columns, padded to np

// Scores -> dropped-out probabilities in place (padding columns 0); returns the row's natural-log log-sum-exp
// (-inf when n == 0). Column c is key column cols[c] of the virtual concatenation (the dropout counter).
FASTPROMPT_SIMD_CLONES
float softmax_row(float* __restrict s, int64_t n, int64_t np, float scale, const int32_t* __restrict cols,
                  uint32_t row_base, uint32_t bh, const PhiloxKey* key, float keep_scale) {
  if (n == 0) {
    for (int64_t c = 0; c < np; ++c) s[c] = 0.0f;
    return kNegInf;
  }
  for (int64_t c = 0; c < np; c += kLanes) store(s + c, load(s + c) * scale);
  for (int64_t c = n; c < np; ++c) s[c] = kNegInf;
  const float m = vmax(s, np);
  exp_row(s, np, 1.0f, m);
  for (int64_t c = n; c < np; ++c) s[c] = 0.0f;
  const float sum = vsum(s, np);
  if (key != nullptr) {
    const PhiloxKey k = *key;
    const float dropped = keep_scale / sum;
    for (int64_t c = 0; c < n; ++c) {
      const float w = philox_keep(row_base + static_cast<uint32_t>(cols[c]), bh, k) ? dropped : 0.0f;
      s[c] *= w;
    }
  } else {
    const float inv = 1.0f / sum;
    for (int64_t c = 0; c < n; ++c) s[c] *= inv;
  }
  return m + std::log(sum);
}

// Backward of one row, in place: on entry s holds the scores and dp = dO . V; on return s holds dS * scale (the
// gradient of the scaled scores, times the scale) and pd the dropped-out probabilities. Padding columns are 0.
FASTPROMPT_SIMD_CLONES
void softmax_backward_row(float* __restrict s, float* __restrict pd, float* __restrict dp, int64_t n, int64_t np,
                          float scale, float lse, const int32_t* __restrict cols, uint32_t row_base, uint32_t bh,
                          const PhiloxKey* key, float keep_scale) {
  exp_row(s, np, scale, lse);  // the probabilities
  for (int64_t c = n; c < np; ++c) s[c] = pd[c] = dp[c] = 0.0f;
  if (key != nullptr) {  // dp becomes the gradient of the probability before dropout
    const PhiloxKey k = *key;
    for (int64_t c = 0; c < n; ++c) {
      const float w = philox_keep(row_base + static_cast<uint32_t>(cols[c]), bh, k) ? keep_scale : 0.0f;
      pd[c] = s[c] * w;
      dp[c] *= w;
    }
  } else {
    std::memcpy(pd, s, n * sizeof(float));
  }
  const float delta = vdot(s, dp, np);  // sum_c p_c g_c = dO . O
  for (int64_t c = 0; c < n; ++c) s[c] = s[c] * (dp[c] - delta) * scale;
}

// --------------------------------------------------------------------------------------------------------
// operands

struct Operands {
  const float *q, *k, *v, *pk, *pv;
  const bool* mask;           // (B, S) or null
  const int64_t* pidx;        // (B,) or null
  int64_t B, H, S, D, P;
  int64_t sq[3], sk[3], sv[3];  // (b, h, s) strides of q, k, v (unit last stride)
  int64_t spk[3], spv[3];       // (t, h, p) strides of the prefixes
  float scale;
  bool dropout;
  PhiloxKey key;
  float keep_scale;
};

at::Tensor unit_last(const at::Tensor& x) { return x.stride(-1) == 1 ? x : x.contiguous(); }

Operands operands(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pk,
                  const at::Tensor& pv, const c10::optional<at::Tensor>& mask,
                  const c10::optional<at::Tensor>& pidx, double scale, double dropout_p, int64_t seed) {
  Operands o{};
  o.q = q.data_ptr<float>();
  o.k = k.data_ptr<float>();
  o.v = v.data_ptr<float>();
  o.pk = pk.data_ptr<float>();
  o.pv = pv.data_ptr<float>();
  o.mask = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  o.pidx = pidx.has_value() ? pidx->data_ptr<int64_t>() : nullptr;
  o.B = q.size(0);
  o.H = q.size(1);
  o.S = q.size(2);
  o.D = q.size(3);
  o.P = pk.size(-2);
  for (int i = 0; i < 3; ++i) {
    o.sq[i] = q.stride(i);
    o.sk[i] = k.stride(i);
    o.sv[i] = v.stride(i);
  }
  const bool shared = pk.dim() == 3;
  for (int i = 0; i < 3; ++i) {
    o.spk[i] = shared ? (i == 0 ? 0 : pk.stride(i - 1)) : pk.stride(i);
    o.spv[i] = shared ? (i == 0 ? 0 : pv.stride(i - 1)) : pv.stride(i);
  }
  o.scale = static_cast<float>(scale);
  o.dropout = dropout_p > 0.0;
  o.key = philox_key(seed, dropout_p);
  o.keep_scale = o.dropout ? 1.0f / (1.0f - static_cast<float>(dropout_p)) : 1.0f;
  return o;
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pk,
                  const at::Tensor& pv, const c10::optional<at::Tensor>& mask,
                  const c10::optional<at::Tensor>& pidx) {
  for (const at::Tensor* t : {&q, &k, &v, &pk, &pv}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat,
                "prefix_attention_cpu: q, k, v and the prefixes must be float32 CPU tensors");
  }
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.sizes() == q.sizes(),
              "prefix_attention_cpu: q, k, v must be (B, H, S, D) of one shape");
  TORCH_CHECK((pk.dim() == 3 || pk.dim() == 4) && pk.sizes() == pv.sizes() && pk.size(-3) == q.size(1) &&
                  pk.size(-1) == q.size(3),
              "prefix_attention_cpu: the prefixes must be (H, P, D) or (T, H, P, D)");
  TORCH_CHECK(pk.dim() == 3 || pidx.has_value(), "prefix_attention_cpu: a (T, H, P, D) prefix needs prompt_index");
  TORCH_CHECK(q.size(2) + pk.size(-2) < (int64_t(1) << 31), "prefix_attention_cpu: P + S must fit in 31 bits");
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 2 && mask->size(0) == q.size(0) &&
                    mask->size(1) == q.size(2) && mask->is_contiguous(),
                "prefix_attention_cpu: key_padding_mask must be a contiguous (B, S) bool tensor");
  }
  if (pidx.has_value()) {
    TORCH_CHECK(pk.dim() == 4 && pidx->scalar_type() == at::kLong && pidx->dim() == 1 &&
                    pidx->size(0) == q.size(0) && pidx->is_contiguous(),
                "prefix_attention_cpu: prompt_index must be a contiguous (B,) int64 tensor with a 4-D prefix");
    const int64_t* p = pidx->data_ptr<int64_t>();
    for (int64_t b = 0; b < pidx->size(0); ++b)
      TORCH_CHECK(p[b] >= 0 && p[b] < pk.size(0), "prefix_attention_cpu: prompt_index out of range");
  }
}

// The seed is a 0-d int64 tensor, so a compiled graph can draw it from torch's generator without a host sync.
int64_t seed_value(const at::Tensor& seed) {
  TORCH_CHECK(seed.device().is_cpu() && seed.scalar_type() == at::kLong && seed.numel() == 1,
              "prefix_attention_cpu: seed must be a one-element int64 CPU tensor");
  return seed.item<int64_t>();
}

bool poison_outputs() {  // tests: every output element must be written by the kernel
  const char* env = std::getenv("FASTPROMPT_CPU_POISON");
  return env != nullptr && env[0] == '1';
}

// Per-thread tiles. Column dims are padded to kLanes; tiles are zero-initialised once, and entries a work
// item leaves over from the previous one only ever reach rows or columns that are not read back.
struct Tiles {
  int64_t np, dp, rp;
  std::vector<float> kt, vt, ks, vs, q, dout, s, pd, dp_, o, dk, dv;
  std::vector<int32_t> cols;
  Tiles(int64_t n_max, int64_t D, int64_t rows, bool backward)
      : np(round_up(n_max, kLanes)), dp(round_up(D, kLanes)), rp(round_up(rows, kMr)) {
    kt.assign(D * np, 0.0f);
    q.assign(rp * dp, 0.0f);
    s.assign(rp * np, 0.0f);
    o.assign(rp * dp, 0.0f);
    cols.assign(np, 0);
    if (backward) {
      vt.assign(D * np, 0.0f);
      ks.assign(np * dp, 0.0f);
      dout.assign(rp * dp, 0.0f);
      pd.assign(rp * np, 0.0f);
      dp_.assign(rp * np, 0.0f);
      dk.assign(np * dp, 0.0f);
      dv.assign(np * dp, 0.0f);
    } else {
      vs.assign(np * dp, 0.0f);
    }
  }
};

// The keys example b sees for head h: prefix columns 0..P-1 then its real tokens (column P + s). Fills the
// tiles the pass needs (kt: D x np transposed keys; backward: vt transposed values and ks key rows; forward: vs
// value rows) and returns the number of visible columns n.
int64_t gather_keys(const Operands& o, int64_t b, int64_t h, Tiles& t, bool backward) {
  const int64_t D = o.D, P = o.P, np = t.np, dp = t.dp;
  const int64_t pt = o.pidx != nullptr ? o.pidx[b] : 0;
  const float* pk = o.pk + pt * o.spk[0] + h * o.spk[1];
  const float* pv = o.pv + pt * o.spv[0] + h * o.spv[1];
  const float* kb = o.k + b * o.sk[0] + h * o.sk[1];
  const float* vb = o.v + b * o.sv[0] + h * o.sv[1];
  const bool* mb = o.mask != nullptr ? o.mask + b * o.S : nullptr;
  int64_t n = 0;
  auto put = [&](const float* key, const float* value, int32_t col) {
    for (int64_t d = 0; d < D; ++d) t.kt[d * np + n] = key[d];
    if (backward) {
      for (int64_t d = 0; d < D; ++d) t.vt[d * np + n] = value[d];
      std::memcpy(&t.ks[n * dp], key, D * sizeof(float));
    } else {
      std::memcpy(&t.vs[n * dp], value, D * sizeof(float));
    }
    t.cols[n++] = col;
  };
  for (int64_t p = 0; p < P; ++p) put(pk + p * o.spk[2], pv + p * o.spv[2], static_cast<int32_t>(p));
  for (int64_t s = 0; s < o.S; ++s) {
    if (mb == nullptr || mb[s]) put(kb + s * o.sk[2], vb + s * o.sv[2], static_cast<int32_t>(P + s));
  }
  return n;
}

void copy_rows_in(const float* src, int64_t stride, int64_t rows, int64_t D, float* dst, int64_t dp) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * dp, src + r * stride, D * sizeof(float));
}

void copy_rows_out(const float* src, int64_t dp, int64_t rows, int64_t D, float* dst, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * stride, src + r * dp, D * sizeof(float));
}

// Runs f(item, tiles) for item in [0, n_items) on the intra-op threads, handing items out dynamically (a
// thread the OS preempts on a busy machine does not hold up the others); results do not depend on which
// thread runs an item.
template <typename F>
void parallel_items(int64_t n_items, int64_t n_max, int64_t D, int64_t rows, bool backward, const F& f) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Tiles tiles(n_max, D, rows, backward);
    for (int64_t item = next.fetch_add(1); item < n_items; item = next.fetch_add(1)) f(item, tiles);
  });
}

// --------------------------------------------------------------------------------------------------------
// forward

void forward_item(const Operands& o, int64_t b, int64_t h, Tiles& t, float* out, float* lse) {
  const int64_t D = o.D, S = o.S, np = t.np, dp = t.dp, n_cols = o.P + S;
  const int64_t n = gather_keys(o, b, h, t, false), nc = round_up(n, kLanes);  // columns computed
  const uint32_t bh = static_cast<uint32_t>(b * o.H + h);
  const float* qb = o.q + b * o.sq[0] + h * o.sq[1];
  for (int64_t i0 = 0; i0 < S; i0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, S - i0), rp = round_up(rows, kMr);
    copy_rows_in(qb + i0 * o.sq[2], o.sq[2], rows, D, t.q.data(), dp);
    gemm(t.q.data(), dp, 1, t.kt.data(), np, t.s.data(), np, rp, nc, D, false);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      lse[(b * o.H + h) * S + i] =
          softmax_row(t.s.data() + r * np, n, nc, o.scale, t.cols.data(), static_cast<uint32_t>(i * n_cols), bh,
                      o.dropout ? &o.key : nullptr, o.keep_scale);
    }
    gemm(t.s.data(), np, 1, t.vs.data(), dp, t.o.data(), dp, rp, dp, n, false);
    copy_rows_out(t.o.data(), dp, rows, D, out + ((b * S + i0) * o.H + h) * D, o.H * D);
  }
}

std::tuple<at::Tensor, at::Tensor> prefix_attention_cpu_fwd(
    const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& pk_, const at::Tensor& pv_,
    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& pidx, double scale, double dropout_p,
    const at::Tensor& seed_) {
  at::NoGradGuard no_grad;  // a kernel: autograd is registered around the op
  check_inputs(q_, k_, v_, pk_, pv_, mask, pidx);
  const int64_t seed = seed_value(seed_);
  const at::Tensor q = unit_last(q_), k = unit_last(k_), v = unit_last(v_), pk = unit_last(pk_),
                   pv = unit_last(pv_);
  const Operands o = operands(q, k, v, pk, pv, mask, pidx, scale, dropout_p, seed);
  const bool poison = poison_outputs();
  at::Tensor out = poison ? at::full({o.B, o.S, o.H, o.D}, NAN, q.options()) : at::empty({o.B, o.S, o.H, o.D}, q.options());
  at::Tensor lse = poison ? at::full({o.B, o.H, o.S}, NAN, q.options()) : at::empty({o.B, o.H, o.S}, q.options());
  float* out_p = out.data_ptr<float>();
  float* lse_p = lse.data_ptr<float>();
  parallel_items(o.B * o.H, o.P + o.S, o.D, std::min(kRowBlock, o.S), false, [&](int64_t item, Tiles& t) {
    forward_item(o, item / o.H, item % o.H, t, out_p, lse_p);
  });
  return {out.transpose(1, 2), lse};
}

// --------------------------------------------------------------------------------------------------------
// backward

struct Grads {
  float *dq, *dk, *dv;  // null when not wanted
  int64_t sdq[3], sdk[3], sdv[3];
  float *part_k, *part_v;  // prefix partial slots (n_slots, H, P, D), null when not wanted
  bool per_example;        // slot = example (a (T, H, P, D) prefix) or group of kGroup examples
};

void backward_example(const Operands& o, const Grads& g, const float* dout, const int64_t sdo[3], const float* lse,
                      int64_t b, int64_t h, int64_t slot, Tiles& t) {
  const int64_t D = o.D, S = o.S, P = o.P, np = t.np, dp = t.dp, n_cols = P + S;
  const int64_t n = gather_keys(o, b, h, t, true), nc = round_up(n, kLanes);  // columns computed
  const uint32_t bh = static_cast<uint32_t>(b * o.H + h);
  const bool want_kv = g.dk != nullptr, want_prefix = g.part_k != nullptr;
  // dK, dV rows to accumulate: every visible column, or only the prefix ones when the tokens' are not wanted
  const int64_t kv_rows = want_kv ? nc : (want_prefix ? round_up(std::min(P, n), kMr) : 0);
  std::fill(t.dk.begin(), t.dk.begin() + kv_rows * dp, 0.0f);
  std::fill(t.dv.begin(), t.dv.begin() + kv_rows * dp, 0.0f);
  const float* qb = o.q + b * o.sq[0] + h * o.sq[1];
  const float* dob = dout + b * sdo[0] + h * sdo[1];
  for (int64_t i0 = 0; i0 < S; i0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, S - i0), rp = round_up(rows, kMr);
    copy_rows_in(qb + i0 * o.sq[2], o.sq[2], rows, D, t.q.data(), dp);
    copy_rows_in(dob + i0 * sdo[2], sdo[2], rows, D, t.dout.data(), dp);
    gemm(t.q.data(), dp, 1, t.kt.data(), np, t.s.data(), np, rp, nc, D, false);
    gemm(t.dout.data(), dp, 1, t.vt.data(), np, t.dp_.data(), np, rp, nc, D, false);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      softmax_backward_row(t.s.data() + r * np, t.pd.data() + r * np, t.dp_.data() + r * np, n, nc, o.scale,
                           lse[(b * o.H + h) * S + i], t.cols.data(), static_cast<uint32_t>(i * n_cols), bh,
                           o.dropout ? &o.key : nullptr, o.keep_scale);
    }
    if (g.dq != nullptr) {
      gemm(t.s.data(), np, 1, t.ks.data(), dp, t.o.data(), dp, rp, dp, n, false);
      copy_rows_out(t.o.data(), dp, rows, D, g.dq + b * g.sdq[0] + h * g.sdq[1] + i0 * g.sdq[2], g.sdq[2]);
    }
    if (kv_rows > 0) {  // dK += dS^T Q, dV += Pdrop^T dO over this block's rows
      gemm(t.s.data(), 1, np, t.q.data(), dp, t.dk.data(), dp, kv_rows, dp, rows, true);
      gemm(t.pd.data(), 1, np, t.dout.data(), dp, t.dv.data(), dp, kv_rows, dp, rows, true);
    }
  }
  if (want_prefix) {
    const int64_t base = (slot * o.H + h) * P * D;
    for (int64_t p = 0; p < P; ++p) {
      float* gk = g.part_k + base + p * D;
      float* gv = g.part_v + base + p * D;
      for (int64_t d = 0; d < D; ++d) {
        gk[d] += t.dk[p * dp + d];
        gv[d] += t.dv[p * dp + d];
      }
    }
  }
  if (want_kv) {
    float* dkb = g.dk + b * g.sdk[0] + h * g.sdk[1];
    float* dvb = g.dv + b * g.sdv[0] + h * g.sdv[1];
    for (int64_t s = 0; s < S; ++s) {  // padded tokens get zeros
      std::memset(dkb + s * g.sdk[2], 0, D * sizeof(float));
      std::memset(dvb + s * g.sdv[2], 0, D * sizeof(float));
    }
    for (int64_t c = P; c < n; ++c) {
      const int64_t s = t.cols[c] - P;
      std::memcpy(dkb + s * g.sdk[2], &t.dk[c * dp], D * sizeof(float));
      std::memcpy(dvb + s * g.sdv[2], &t.dv[c * dp], D * sizeof(float));
    }
  }
}

void strides3(const at::Tensor& x, int64_t* s) {
  for (int i = 0; i < 3; ++i) s[i] = x.stride(i);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> prefix_attention_cpu_bwd(
    const at::Tensor& dout_, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& pk_,
    const at::Tensor& pv_, const at::Tensor& lse_, const c10::optional<at::Tensor>& mask,
    const c10::optional<at::Tensor>& pidx, double scale, double dropout_p, const at::Tensor& seed_, bool need_dq,
    bool need_dkv, bool need_dprefix) {
  at::NoGradGuard no_grad;
  check_inputs(q_, k_, v_, pk_, pv_, mask, pidx);
  const int64_t seed = seed_value(seed_);
  TORCH_CHECK(dout_.sizes() == q_.sizes() && dout_.scalar_type() == at::kFloat,
              "prefix_attention_cpu_bwd: dout must be a float32 tensor of q's shape");
  TORCH_CHECK(lse_.scalar_type() == at::kFloat && lse_.dim() == 3 && lse_.size(0) == q_.size(0) &&
                  lse_.size(1) == q_.size(1) && lse_.size(2) == q_.size(2),
              "prefix_attention_cpu_bwd: lse must be a float32 (B, H, S) tensor");
  const at::Tensor q = unit_last(q_), k = unit_last(k_), v = unit_last(v_), pk = unit_last(pk_),
                   pv = unit_last(pv_), dout = unit_last(dout_), lse = lse_.contiguous();
  const Operands o = operands(q, k, v, pk, pv, mask, pidx, scale, dropout_p, seed);
  const auto opts = q.options();
  const bool poison = poison_outputs();
  auto like = [&](const at::Tensor& x, bool wanted) {
    if (!wanted) return at::empty({0}, opts);
    at::Tensor y = at::empty_like(x);
    return poison ? y.fill_(NAN) : y;
  };
  at::Tensor dq = like(q_, need_dq), dk = like(k_, need_dkv), dv = like(v_, need_dkv);
  Grads g{};
  g.dq = need_dq ? dq.data_ptr<float>() : nullptr;
  g.dk = need_dkv ? dk.data_ptr<float>() : nullptr;
  g.dv = need_dkv ? dv.data_ptr<float>() : nullptr;
  if (need_dq) strides3(dq, g.sdq);
  if (need_dkv) {
    TORCH_CHECK(dk.stride(3) == 1 && dv.stride(3) == 1 && (!need_dq || dq.stride(3) == 1),
                "prefix_attention_cpu_bwd: gradients need a unit last stride");
    strides3(dk, g.sdk);
    strides3(dv, g.sdv);
  }
  TORCH_CHECK(!need_dq || dq.stride(3) == 1, "prefix_attention_cpu_bwd: gradients need a unit last stride");
  g.per_example = pk.dim() == 4;
  const int64_t n_groups = (o.B + kGroup - 1) / kGroup;
  const int64_t n_slots = g.per_example ? o.B : n_groups;
  at::Tensor part_k, part_v;
  if (need_dprefix) {
    part_k = at::zeros({n_slots, o.H, o.P, o.D}, opts);
    part_v = at::zeros({n_slots, o.H, o.P, o.D}, opts);
    g.part_k = part_k.data_ptr<float>();
    g.part_v = part_v.data_ptr<float>();
  }
  int64_t sdo[3];
  strides3(dout, sdo);
  const float* dout_p = dout.data_ptr<float>();
  const float* lse_p = lse.data_ptr<float>();
  if (need_dq || need_dkv || need_dprefix) {
    parallel_items(n_groups * o.H, o.P + o.S, o.D, std::min(kRowBlock, o.S), true, [&](int64_t item, Tiles& t) {
      const int64_t grp = item / o.H, h = item % o.H;
      for (int64_t b = grp * kGroup; b < std::min(o.B, (grp + 1) * kGroup); ++b)
        backward_example(o, g, dout_p, sdo, lse_p, b, h, g.per_example ? b : grp, t);
    });
  }
  at::Tensor dpk = at::empty({0}, opts), dpv = at::empty({0}, opts);
  if (need_dprefix) {  // sum the slots into each prompt, in slot order
    const int64_t T = g.per_example ? pk.size(0) : 1, HPD = o.H * o.P * o.D;
    dpk = at::zeros(pk_.sizes(), opts);
    dpv = at::zeros(pv_.sizes(), opts);
    float* dpk_p = dpk.data_ptr<float>();
    float* dpv_p = dpv.data_ptr<float>();
    at::parallel_for(0, T * o.H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t tt = item / o.H, h = item % o.H, PD = o.P * o.D;
        float* dst_k = dpk_p + tt * HPD + h * PD;
        float* dst_v = dpv_p + tt * HPD + h * PD;
        for (int64_t s = 0; s < n_slots; ++s) {
          if (g.per_example && o.pidx[s] != tt) continue;
          const float* src_k = g.part_k + s * HPD + h * PD;
          const float* src_v = g.part_v + s * HPD + h * PD;
          for (int64_t e = 0; e < PD; ++e) {
            dst_k[e] += src_k[e];
            dst_v[e] += src_v[e];
          }
        }
      }
    });
  }
  return {dq, dk, dv, dpk, dpv};
}

// The keep-mask (B, H, S, P + S) of the kernels' dropout (for tests and for the reference to replay).
at::Tensor prefix_attention_cpu_keep_mask(int64_t B, int64_t H, int64_t S, int64_t P, double dropout_p,
                                          int64_t seed) {
  TORCH_CHECK(B >= 0 && H >= 0 && S >= 0 && P >= 0, "prefix_attention_cpu_keep_mask: sizes must be >= 0");
  const PhiloxKey key = philox_key(seed, dropout_p);
  const int64_t n_cols = P + S;
  at::Tensor keep = at::empty({B, H, S, n_cols}, at::TensorOptions().dtype(at::kBool));
  bool* out = keep.data_ptr<bool>();
  at::parallel_for(0, B * H * S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const uint32_t bh = static_cast<uint32_t>(row / S), base = static_cast<uint32_t>((row % S) * n_cols);
      for (int64_t j = 0; j < n_cols; ++j) out[row * n_cols + j] = philox_keep(base + static_cast<uint32_t>(j), bh, key);
    }
  });
  return keep;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastprompt, m) {
  m.def(
      "prefix_attention_cpu_fwd(Tensor q, Tensor k, Tensor v, Tensor prefix_k, Tensor prefix_v, "
      "Tensor? key_padding_mask, Tensor? prompt_index, float scale, float dropout_p, Tensor seed) -> (Tensor, Tensor)");
  m.def(
      "prefix_attention_cpu_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor prefix_k, Tensor prefix_v, "
      "Tensor lse, Tensor? key_padding_mask, Tensor? prompt_index, float scale, float dropout_p, Tensor seed, "
      "bool need_dq, bool need_dkv, bool need_dprefix) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("prefix_attention_cpu_keep_mask(int B, int H, int S, int P, float dropout_p, int seed) -> Tensor",
        &prefix_attention_cpu_keep_mask);
}

TORCH_LIBRARY_IMPL(fastprompt, CPU, m) {
  m.impl("prefix_attention_cpu_fwd", &prefix_attention_cpu_fwd);
  m.impl("prefix_attention_cpu_bwd", &prefix_attention_cpu_bwd);
}

}  // namespace fastprompt
