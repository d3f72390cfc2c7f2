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
// for several x86-64 levels (AVX-512, AVX2+FMA, baseline; prefix_attention_simd.h), the best one the CPU
// supports chosen at run time unless FASTPROMPT_CPU_ISA names one; elementwise work (exp, the Philox rounds)
// is written so the compiler vectorises it in the same levels.
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
#include <string>
#include <vector>

#include "philox.h"

// The vector helpers are always inlined, so the AVX-512 argument-passing ABI note does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

// Several x86-64 levels of the inner loops (prefix_attention_simd.h) are compiled side by side with GCC:
// x86-64-v4 (AVX-512), x86-64-v3 (AVX2 + FMA) and the baseline the rest of the file is compiled for. Other
// compilers and architectures get the baseline only. FASTPROMPT_CPU_ISA picks one (see simd_kernels below).
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(FASTPROMPT_NO_ISA_LEVELS)
#define FASTPROMPT_ISA_LEVELS 1
#endif

namespace fastprompt {
namespace {

constexpr int64_t kRowBlock = 64;  // query rows per tile
constexpr int64_t kLanes = 16;     // floats per vector of the micro-kernel; column dims are padded to it
constexpr int64_t kMr = 4;         // rows of the micro-kernel's register block
constexpr int64_t kGroup = 8;      // examples per backward item (fixed: the prefix reduction order)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

#define FASTPROMPT_SIMD_BYTES 16
namespace isa_baseline {
#include "prefix_attention_simd.h"
}  // namespace isa_baseline
#undef FASTPROMPT_SIMD_BYTES
#ifdef FASTPROMPT_ISA_LEVELS
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define FASTPROMPT_SIMD_BYTES 32
namespace isa_v3 {
#include "prefix_attention_simd.h"
}  // namespace isa_v3
#undef FASTPROMPT_SIMD_BYTES
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
#define FASTPROMPT_SIMD_BYTES 64
namespace isa_v4 {
#include "prefix_attention_simd.h"
}  // namespace isa_v4
#undef FASTPROMPT_SIMD_BYTES
#pragma GCC pop_options
#endif

// One compiled level of the inner loops. The levels differ only in rounding (x86-64-v3 and v4 contract a * b + c
// into one fused multiply-add, the baseline rounds twice), never in what they compute.
struct SimdKernels {
  const char* name;
  decltype(&isa_baseline::gemm) gemm;
  decltype(&isa_baseline::softmax_row) softmax_row;
  decltype(&isa_baseline::softmax_backward_row) softmax_backward_row;
};

const SimdKernels kSimdLevels[] = {  // best first
#ifdef FASTPROMPT_ISA_LEVELS
    {"x86-64-v4", &isa_v4::gemm, &isa_v4::softmax_row, &isa_v4::softmax_backward_row},
    {"x86-64-v3", &isa_v3::gemm, &isa_v3::softmax_row, &isa_v3::softmax_backward_row},
#endif
    {"baseline", &isa_baseline::gemm, &isa_baseline::softmax_row, &isa_baseline::softmax_backward_row},
};

bool cpu_supports(const SimdKernels& level) {
#ifdef FASTPROMPT_ISA_LEVELS
  __builtin_cpu_init();
  if (std::strcmp(level.name, "x86-64-v4") == 0) return __builtin_cpu_supports("x86-64-v4");
  if (std::strcmp(level.name, "x86-64-v3") == 0) return __builtin_cpu_supports("x86-64-v3");
#endif
  return std::strcmp(level.name, "baseline") == 0;
}

// The levels this build has and this CPU supports, best first.
std::vector<std::string> supported_levels() {
  std::vector<std::string> names;
  for (const SimdKernels& level : kSimdLevels)
    if (cpu_supports(level)) names.emplace_back(level.name);
  return names;
}

// The level to run: `requested` is "auto" (or empty: the best level this CPU supports) or a level's name, which
// must be compiled in and supported by this CPU. Read on every call from FASTPROMPT_CPU_ISA, so tests can run
// each level on one machine (what a CPU without AVX-512 runs is then tested on one with it).
const SimdKernels& simd_kernels(const std::string& requested) {
  if (requested.empty() || requested == "auto") {
    for (const SimdKernels& level : kSimdLevels)
      if (cpu_supports(level)) return level;
  }
  std::string known;
  for (const SimdKernels& level : kSimdLevels) {
    if (requested == level.name) {
      TORCH_CHECK(cpu_supports(level), "FASTPROMPT_CPU_ISA=", requested,
                  ": this CPU does not support that level; unset it or choose one of ", c10::Join(", ", supported_levels()));
      return level;
    }
    known += known.empty() ? level.name : std::string(", ") + level.name;
  }
  TORCH_CHECK(false, "FASTPROMPT_CPU_ISA=", requested, " is not a level of this build (auto, ", known, ")");
}

const SimdKernels& simd_kernels() {
  const char* env = std::getenv("FASTPROMPT_CPU_ISA");
  return simd_kernels(env == nullptr ? std::string() : std::string(env));
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

void forward_item(const SimdKernels& simd, const Operands& o, int64_t b, int64_t h, Tiles& t, float* out, float* lse) {
  const int64_t D = o.D, S = o.S, np = t.np, dp = t.dp, n_cols = o.P + S;
  const int64_t n = gather_keys(o, b, h, t, false), nc = round_up(n, kLanes);  // columns computed
  const uint32_t bh = static_cast<uint32_t>(b * o.H + h);
  const float* qb = o.q + b * o.sq[0] + h * o.sq[1];
  for (int64_t i0 = 0; i0 < S; i0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, S - i0), rp = round_up(rows, kMr);
    copy_rows_in(qb + i0 * o.sq[2], o.sq[2], rows, D, t.q.data(), dp);
    simd.gemm(t.q.data(), dp, 1, t.kt.data(), np, t.s.data(), np, rp, nc, D, false);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      lse[(b * o.H + h) * S + i] =
          simd.softmax_row(t.s.data() + r * np, n, nc, o.scale, t.cols.data(), static_cast<uint32_t>(i * n_cols), bh,
                      o.dropout ? &o.key : nullptr, o.keep_scale);
    }
    simd.gemm(t.s.data(), np, 1, t.vs.data(), dp, t.o.data(), dp, rp, dp, n, false);
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
  const SimdKernels& simd = simd_kernels();
  const bool poison = poison_outputs();
  at::Tensor out = poison ? at::full({o.B, o.S, o.H, o.D}, NAN, q.options()) : at::empty({o.B, o.S, o.H, o.D}, q.options());
  at::Tensor lse = poison ? at::full({o.B, o.H, o.S}, NAN, q.options()) : at::empty({o.B, o.H, o.S}, q.options());
  float* out_p = out.data_ptr<float>();
  float* lse_p = lse.data_ptr<float>();
  parallel_items(o.B * o.H, o.P + o.S, o.D, std::min(kRowBlock, o.S), false, [&](int64_t item, Tiles& t) {
    forward_item(simd, o, item / o.H, item % o.H, t, out_p, lse_p);
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

void backward_example(const SimdKernels& simd, const Operands& o, const Grads& g, const float* dout, const int64_t sdo[3], const float* lse,
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
    simd.gemm(t.q.data(), dp, 1, t.kt.data(), np, t.s.data(), np, rp, nc, D, false);
    simd.gemm(t.dout.data(), dp, 1, t.vt.data(), np, t.dp_.data(), np, rp, nc, D, false);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      simd.softmax_backward_row(t.s.data() + r * np, t.pd.data() + r * np, t.dp_.data() + r * np, n, nc, o.scale,
                           lse[(b * o.H + h) * S + i], t.cols.data(), static_cast<uint32_t>(i * n_cols), bh,
                           o.dropout ? &o.key : nullptr, o.keep_scale);
    }
    if (g.dq != nullptr) {
      simd.gemm(t.s.data(), np, 1, t.ks.data(), dp, t.o.data(), dp, rp, dp, n, false);
      copy_rows_out(t.o.data(), dp, rows, D, g.dq + b * g.sdq[0] + h * g.sdq[1] + i0 * g.sdq[2], g.sdq[2]);
    }
    if (kv_rows > 0) {  // dK += dS^T Q, dV += Pdrop^T dO over this block's rows
      simd.gemm(t.s.data(), 1, np, t.q.data(), dp, t.dk.data(), dp, kv_rows, dp, rows, true);
      simd.gemm(t.pd.data(), 1, np, t.dout.data(), dp, t.dv.data(), dp, kv_rows, dp, rows, true);
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
  const SimdKernels& simd = simd_kernels();
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
        backward_example(simd, o, g, dout_p, sdo, lse_p, b, h, g.per_example ? b : grp, t);
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

// The level FASTPROMPT_CPU_ISA selects now, and the levels this build has and this CPU supports.
std::string prefix_attention_cpu_isa() { return simd_kernels().name; }
std::vector<std::string> prefix_attention_cpu_isa_levels() { return supported_levels(); }

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
  m.def("prefix_attention_cpu_isa() -> str", &prefix_attention_cpu_isa);
  m.def("prefix_attention_cpu_isa_levels() -> str[]", &prefix_attention_cpu_isa_levels);
}

TORCH_LIBRARY_IMPL(fastprompt, CPU, m) {
  m.impl("prefix_attention_cpu_fwd", &prefix_attention_cpu_fwd);
  m.impl("prefix_attention_cpu_bwd", &prefix_attention_cpu_bwd);
}

}  // namespace fastprompt
