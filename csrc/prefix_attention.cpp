// Fused prefix attention on the CPU: every query row attends to [prefix ; tokens] of its sequence, forward and
// backward, without expanding the prefix over the batch, concatenating it with the token keys/values, expanding
// grouped-query keys/values over their query heads, or storing the attention probabilities or a dropout mask.
//
// A sequence is an example of the padded layout (q (B, H, S, D), a key padding mask) or one of the back-to-back
// sequences of a packed batch (q (1, H, N, D), offsets cu_seqlens); k, v have Hkv heads (H a multiple of Hkv:
// query head h reads KV head h / (H / Hkv)). Forward items are (sequence, KV head): one item gathers the keys its
// rows can see (the P prefix rows of its prompt, then the sequence's real tokens; padded tokens are skipped, not
// masked) into small per-thread tiles and, for each query head reading that KV head, computes blocks of query rows
// against them (scores, the additive bias on the token block, an exact softmax over the row's visible keys,
// dropout, the product with the values) and writes its output rows straight into a (B, S, H, D) buffer (packed:
// (1, N, H, D)): the layout the attention function hands back to transformers, so no permute follows. Under a
// causal mask or a sliding window, a block of kBandBlock rows computes only the token columns its rows' bands
// reach (rounded to kLanes): the masked work is skipped, not computed and discarded. The prefix columns are
// visible to every row. Only the per-row natural-log log-sum-exp is saved; the backward recomputes the
// probabilities from it and regenerates the dropout mask from the seed (philox.h: the same keep decisions as the
// Triton kernels; a packed sequence draws what the same sequence right-padded to max_seqlen draws).
//
// The products run on a register-blocked micro-kernel written with GCC/Clang vector extensions and compiled
// for several x86-64 levels (AVX-512, AVX2+FMA, baseline; prefix_attention_simd.h), the best one the CPU
// supports chosen at run time unless FASTPROMPT_CPU_ISA names one; elementwise work (exp, the Philox rounds)
// is written so the compiler vectorises it in the same levels.
//
// Prefix gradients are reduced without atomics and independently of the thread count: the backward's items
// are (group of kGroup sequences, KV head) with a fixed grouping; an item accumulates its KV head's key/value
// gradients over the query heads that read it, writes its prefix partial sum to its own slot (one per group for
// a shared (Hkv, P, D) prefix, one per sequence for a (T, Hkv, P, D) prefix picked by prompt_index), and the
// slots are then summed into each prompt in slot order. The bias gradient is written per (sequence, query head)
// in full (B, H, L, L); the Python side sums it over the bias's broadcast dimensions.
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

#include "cpu_levels.h"
#include "philox.h"

// The vector helpers are always inlined, so the AVX-512 argument-passing ABI note does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

// The inner loops (prefix_attention_simd.h) are compiled once per x86-64 level of cpu_levels.h.

namespace fastprompt {
namespace {

constexpr int64_t kRowBlock = 64;   // query rows per tile
constexpr int64_t kBandBlock = 16;  // query rows per tile under a causal mask or a window (row_block)
constexpr int64_t kLanes = 16;     // floats per vector of the micro-kernel; column dims are padded to it
constexpr int64_t kMr = 4;         // rows of the micro-kernel's register block
constexpr int64_t kGroup = 8;      // examples per backward item (fixed: the prefix reduction order)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Which columns of one score row are visible. Tile columns: the prefix in [0, P) (always visible), padding up to
// t0 (P rounded up to kLanes), then the block's token columns; the row sees the token columns [ta, tb)
// (t0 <= ta <= tb) and nothing else.
struct RowSpan {
  int64_t P, t0, ta, tb;
  const int32_t* cols;  // key column of token tile column c in the virtual [prefix ; tokens] (the dropout
                        // counter's column, P + position): cols[c - t0]
};

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

static_assert(sizeof(kSimdLevels) / sizeof(kSimdLevels[0]) == kIsaLevelCount, "one copy per level of kIsaLevels");

// The compiled copy of the level to run (cpu_levels.h: FASTPROMPT_CPU_ISA, or the best level this CPU supports).
const SimdKernels& simd_kernels() { return kSimdLevels[isa_level_index()]; }

// --------------------------------------------------------------------------------------------------------
// operands

struct Operands {
  const float *q, *k, *v, *pk, *pv;
  const bool* mask;             // (B, S) or null
  const int64_t* pidx;          // (B,) or null
  const int64_t* cu;            // (B + 1,) offsets of a packed batch, or null (padded)
  const float* bias;            // additive bias on the token block, or null
  int64_t B;                    // examples (padded) or sequences (packed)
  int64_t H, Hkv, S, D, P;      // S: q's rows per batch entry (padded: tokens per example; packed: N)
  int64_t L;                    // key positions per sequence: S padded, max_seqlen packed (dropout counter, bias)
  int64_t sq[3], sk[3], sv[3];  // (batch, head, row) strides of q, k, v (unit last stride)
  int64_t spk[3], spv[3];       // (t, h, p) strides of the prefixes
  int64_t sb[3];                // (b, h, i) strides of the bias (0 along a broadcast dim; unit last stride)
  bool causal;
  int64_t left, right;          // sliding window, -1 = unbounded
  float scale;
  bool dropout;
  PhiloxKey key;
  float keep_scale;
};

at::Tensor unit_last(const at::Tensor& x) { return x.stride(-1) == 1 ? x : x.contiguous(); }

c10::optional<at::Tensor> unit_last(const c10::optional<at::Tensor>& x) {
  return x.has_value() ? c10::optional<at::Tensor>(unit_last(*x)) : c10::nullopt;
}

Operands operands(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pk,
                  const at::Tensor& pv, const c10::optional<at::Tensor>& mask,
                  const c10::optional<at::Tensor>& pidx, double scale, double dropout_p, int64_t seed, bool causal,
                  int64_t left, int64_t right, const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& cu, int64_t L) {
  Operands o{};
  o.q = q.data_ptr<float>();
  o.k = k.data_ptr<float>();
  o.v = v.data_ptr<float>();
  o.pk = pk.data_ptr<float>();
  o.pv = pv.data_ptr<float>();
  o.mask = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  o.pidx = pidx.has_value() ? pidx->data_ptr<int64_t>() : nullptr;
  o.cu = cu.has_value() ? cu->data_ptr<int64_t>() : nullptr;
  o.bias = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  o.B = cu.has_value() ? cu->numel() - 1 : q.size(0);
  o.H = q.size(1);
  o.Hkv = k.size(1);
  o.S = q.size(2);
  o.D = q.size(3);
  o.P = pk.size(-2);
  o.L = L;
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
  if (bias.has_value()) {
    for (int i = 0; i < 3; ++i) o.sb[i] = bias->size(i) == 1 ? 0 : bias->stride(i);
  }
  o.causal = causal;
  o.left = left;
  o.right = right;
  o.scale = static_cast<float>(scale);
  o.dropout = dropout_p > 0.0;
  o.key = philox_key(seed, dropout_p);
  o.keep_scale = o.dropout ? 1.0f / (1.0f - static_cast<float>(dropout_p)) : 1.0f;
  return o;
}

// Checks everything the kernels index with (the Python side raises clearer errors first; this guards the raw ops)
// and returns L, the key positions per sequence: S padded, max_seqlen (or the longest sequence when it is < 0)
// packed.
int64_t check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pk,
                     const at::Tensor& pv, const c10::optional<at::Tensor>& mask,
                     const c10::optional<at::Tensor>& pidx, int64_t left, int64_t right,
                     const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& cu, int64_t max_seqlen) {
  for (const at::Tensor* t : {&q, &k, &v, &pk, &pv}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat,
                "prefix_attention_cpu: q, k, v and the prefixes must be float32 CPU tensors");
  }
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == q.size(0) &&
                  k.size(2) == q.size(2) && k.size(3) == q.size(3) && k.size(1) >= 1 && q.size(1) % k.size(1) == 0,
              "prefix_attention_cpu: q must be (B, H, S, D) and k, v (B, Hkv, S, D) with H a multiple of Hkv");
  TORCH_CHECK((pk.dim() == 3 || pk.dim() == 4) && pk.sizes() == pv.sizes() && pk.size(-3) == k.size(1) &&
                  pk.size(-1) == q.size(3),
              "prefix_attention_cpu: the prefixes must be (Hkv, P, D) or (T, Hkv, P, D)");
  TORCH_CHECK(pk.dim() == 3 || pidx.has_value(), "prefix_attention_cpu: a (T, Hkv, P, D) prefix needs prompt_index");
  TORCH_CHECK(left >= -1 && right >= -1, "prefix_attention_cpu: window sizes must be >= -1 (-1 = unbounded)");
  int64_t B = q.size(0), L = q.size(2);
  if (cu.has_value()) {
    TORCH_CHECK(cu->device().is_cpu() && cu->scalar_type() == at::kLong && cu->dim() == 1 && cu->numel() >= 2 &&
                    cu->is_contiguous() && q.size(0) == 1,
                "prefix_attention_cpu: cu_seqlens must be a contiguous (B + 1,) int64 tensor, q (1, H, N, D)");
    TORCH_CHECK(!mask.has_value(), "prefix_attention_cpu: a packed batch takes no key_padding_mask");
    const int64_t* c = cu->data_ptr<int64_t>();
    B = cu->numel() - 1;
    int64_t longest = 0;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(c[b + 1] >= c[b], "prefix_attention_cpu: cu_seqlens must be non-decreasing");
      longest = std::max(longest, c[b + 1] - c[b]);
    }
    TORCH_CHECK(c[0] == 0 && c[B] == q.size(2), "prefix_attention_cpu: cu_seqlens must run from 0 to N = q.size(2)");
    TORCH_CHECK(max_seqlen < 0 || longest <= max_seqlen, "prefix_attention_cpu: a sequence is longer than max_seqlen");
    L = max_seqlen < 0 ? longest : max_seqlen;
  } else {
    TORCH_CHECK(max_seqlen < 0, "prefix_attention_cpu: max_seqlen is only for a packed batch (cu_seqlens)");
  }
  TORCH_CHECK(L + pk.size(-2) < (int64_t(1) << 31), "prefix_attention_cpu: P + S must fit in 31 bits");
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->dim() == 2 && mask->size(0) == q.size(0) &&
                    mask->size(1) == q.size(2) && mask->is_contiguous(),
                "prefix_attention_cpu: key_padding_mask must be a contiguous (B, S) bool tensor");
  }
  if (pidx.has_value()) {
    TORCH_CHECK(pk.dim() == 4 && pidx->scalar_type() == at::kLong && pidx->dim() == 1 && pidx->size(0) == B &&
                    pidx->is_contiguous(),
                "prefix_attention_cpu: prompt_index must be a contiguous (B,) int64 tensor with a 4-D prefix");
    const int64_t* p = pidx->data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(p[b] >= 0 && p[b] < pk.size(0), "prefix_attention_cpu: prompt_index out of range");
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->dim() == 4 &&
                    (bias->size(0) == 1 || bias->size(0) == B) && (bias->size(1) == 1 || bias->size(1) == q.size(1)) &&
                    bias->size(2) == L && bias->size(3) == L && bias->stride(3) == 1,
                "prefix_attention_cpu: attn_bias must be a float32 (1 or B, 1 or H, L, L) tensor, L = S padded or "
                "max_seqlen packed, with a unit last stride");
  }
  return L;
}

// The seed is a 0-d int64 tensor, so a compiled graph can draw it from torch's generator without a host sync.
int64_t seed_value(const at::Tensor& seed) {
  TORCH_CHECK(seed.device().is_cpu() && seed.scalar_type() == at::kLong && seed.numel() == 1,
              "prefix_attention_cpu: seed must be a one-element int64 CPU tensor");
  return seed.item<int64_t>();
}

// Query rows per tile: fewer under a causal mask or a window, so a block's token columns follow its rows' band
// (a causal block of 16 rows computes at most 16 token columns past its last row's diagonal).
int64_t row_block(const Operands& o) { return o.causal || o.left >= 0 || o.right >= 0 ? kBandBlock : kRowBlock; }

// One sequence as the kernels see it: example b of the padded layout, or sequence b of the packed one.
struct Seq {
  int64_t b;            // its index: dropout counter, prompt_index, bias
  int64_t batch, row0;  // where its rows start in q, k, v: batch entry and row
  int64_t len;          // its rows (queries) and key positions: S padded, its length packed
  int64_t out_row0;     // its first row in the (rows, H, D) output buffer
  int64_t lse0, lse_h;  // the log-sum-exp of head h, row i is at lse0 + h * lse_h + i
};

Seq sequence(const Operands& o, int64_t b) {
  if (o.cu != nullptr) return {b, 0, o.cu[b], o.cu[b + 1] - o.cu[b], o.cu[b], o.cu[b], o.S};
  return {b, b, 0, o.S, b * o.S, b * o.H * o.S, o.S};
}

// Per-thread tiles. Tile columns: the P prefix keys in [0, P), zeros up to t0 = P rounded up to kLanes, then the
// sequence's gathered tokens from t0; column dims are padded to kLanes. Tiles are zero-initialised once, and
// entries a work item leaves over from the previous one only ever reach rows or columns that are hidden or not
// read back.
struct Tiles {
  int64_t t0, np, dp, rp;
  std::vector<float> kt, vt, ks, vs, q, dout, s, pd, dp_, o, dk, dv, bias, ds;
  std::vector<int32_t> cols;  // per gathered token: its key column P + position in the virtual concatenation
  std::vector<int64_t> cnt;   // cnt[j]: gathered tokens at positions < j, j = 0..len
  std::vector<const float*> krows, vrows;  // the gathered key / value rows (the prefix's, then the tokens)
  Tiles(const Operands& op, int64_t rows, bool backward, bool want_ds)
      : t0(round_up(op.P, kLanes)), np(t0 + round_up(op.L, kLanes)), dp(round_up(op.D, kLanes)),
        rp(round_up(rows, kMr)) {
    const int64_t D = op.D;
    kt.assign(D * np, 0.0f);
    q.assign(rp * dp, 0.0f);
    s.assign(rp * np, 0.0f);
    o.assign(rp * dp, 0.0f);
    cols.assign(std::max<int64_t>(op.L, 1), 0);
    cnt.assign(op.L + 1, 0);
    krows.assign(op.P + op.L, nullptr);
    vrows.assign(op.P + op.L, nullptr);
    if (op.bias != nullptr) bias.assign(np, 0.0f);
    if (backward) {
      vt.assign(D * np, 0.0f);
      ks.assign(np * dp, 0.0f);
      dout.assign(rp * dp, 0.0f);
      pd.assign(rp * np, 0.0f);
      dp_.assign(rp * np, 0.0f);
      dk.assign(np * dp, 0.0f);
      dv.assign(np * dp, 0.0f);
      if (want_ds) ds.assign(np, 0.0f);
    } else {
      vs.assign(np * dp, 0.0f);
    }
  }
};

// dst[d * ld + c] = rows[c][d] for c < n, d < D, sixteen rows at a time: each write of a row of dst fills a whole
// cache line and the sixteen source rows stay in L1 (a row-by-row transpose writes D lines per key).
void transpose_rows(const float* const* rows, int64_t n, int64_t D, float* dst, int64_t ld) {
  for (int64_t c0 = 0; c0 < n; c0 += kLanes) {
    const int64_t m = std::min(kLanes, n - c0);
    const float* const* r = rows + c0;
    for (int64_t d = 0; d < D; ++d) {
      float* out = dst + d * ld + c0;
      for (int64_t c = 0; c < m; ++c) out[c] = r[c][d];
    }
  }
}

// The keys sequence sq sees through KV head hk: its prompt's P prefix rows in tile columns [0, P), then its real
// tokens (every token of a packed sequence; the unmasked ones of a padded example) from column t0. Fills the
// tiles the pass needs (kt: D x np transposed keys; backward: vt transposed values and ks key rows; forward: vs
// value rows), t.cols and t.cnt; returns the number of tokens.
int64_t gather_keys(const Operands& o, const Seq& sq, int64_t hk, Tiles& t, bool backward) {
  const int64_t D = o.D, P = o.P, np = t.np, dp = t.dp;
  const int64_t pt = o.pidx != nullptr ? o.pidx[sq.b] : 0;
  const float* pk = o.pk + pt * o.spk[0] + hk * o.spk[1];
  const float* pv = o.pv + pt * o.spv[0] + hk * o.spv[1];
  const float** kr = t.krows.data();  // the rows of tile columns [0, P), then of [t0, t0 + n) from kr + P
  const float** vr = t.vrows.data();
  for (int64_t p = 0; p < P; ++p) {
    kr[p] = pk + p * o.spk[2];
    vr[p] = pv + p * o.spv[2];
  }
  const float* kb = o.k + sq.batch * o.sk[0] + hk * o.sk[1] + sq.row0 * o.sk[2];
  const float* vb = o.v + sq.batch * o.sv[0] + hk * o.sv[1] + sq.row0 * o.sv[2];
  const bool* mb = o.mask != nullptr ? o.mask + sq.b * o.S : nullptr;
  int64_t n = 0;
  for (int64_t j = 0; j < sq.len; ++j) {
    t.cnt[j] = n;
    if (mb == nullptr || mb[j]) {
      kr[P + n] = kb + j * o.sk[2];
      vr[P + n] = vb + j * o.sv[2];
      t.cols[n++] = static_cast<int32_t>(P + j);
    }
  }
  t.cnt[sq.len] = n;
  transpose_rows(kr, P, D, t.kt.data(), np);
  transpose_rows(kr + P, n, D, t.kt.data() + t.t0, np);
  auto copy_rows = [&](const float* const* rows, float* dst) {
    for (int64_t c = 0; c < P; ++c) std::memcpy(dst + c * dp, rows[c], D * sizeof(float));
    for (int64_t c = 0; c < n; ++c) std::memcpy(dst + (t.t0 + c) * dp, rows[P + c], D * sizeof(float));
  };
  if (backward) {
    transpose_rows(vr, P, D, t.vt.data(), np);
    transpose_rows(vr + P, n, D, t.vt.data() + t.t0, np);
    copy_rows(kr, t.ks.data());
  } else {
    copy_rows(vr, t.vs.data());
  }
  return n;
}

// A block of query rows [i0, i0 + rows) of a sequence: each row's visible tokens [ta, tb) (gathered token indices:
// the real tokens at positions j with j <= i under the causal mask and i - left <= j <= i + right in the window),
// and the tokens the block computes, [cs, ce): cs is rounded down to kLanes, so a token's tile column (and with
// it the association of the row sums) is the same in every block, padded or packed.
struct Block {
  int64_t i0, rows, rp, cs, ce, nc;  // nc: computed tile columns (prefix and token block)
  int64_t ta[kRowBlock], tb[kRowBlock];

  RowSpan span(const Operands& o, const Tiles& t, int64_t r) const {
    return {o.P, t.t0, t.t0 + ta[r] - cs, t.t0 + tb[r] - cs, t.cols.data() + cs};
  }
};

Block make_block(const Operands& o, const Seq& sq, const Tiles& t, int64_t i0) {
  Block blk;
  blk.i0 = i0;
  blk.rows = std::min(row_block(o), sq.len - i0);
  blk.rp = round_up(blk.rows, kMr);
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
  for (int64_t r = 0; r < blk.rows; ++r) {
    const int64_t i = i0 + r;
    const int64_t first = o.left >= 0 ? std::max<int64_t>(i - o.left, 0) : 0;
    int64_t last = sq.len - 1;
    if (o.causal) last = std::min(last, i);
    if (o.right >= 0) last = std::min(last, i + o.right);
    blk.ta[r] = first <= last ? t.cnt[first] : 0;
    blk.tb[r] = first <= last ? t.cnt[last + 1] : 0;
    if (blk.tb[r] > blk.ta[r]) {
      lo = std::min(lo, blk.ta[r]);
      hi = std::max(hi, blk.tb[r]);
    }
  }
  blk.cs = hi > 0 ? lo / kLanes * kLanes : 0;
  blk.ce = hi;
  for (int64_t r = 0; r < blk.rows; ++r) {
    if (blk.tb[r] <= blk.ta[r]) blk.ta[r] = blk.tb[r] = blk.cs;  // no token: an empty span
  }
  blk.nc = t.t0 + round_up(blk.ce - blk.cs, kLanes);
  return blk;
}

// The block products. s (rp x np) = a (the block's rows, rp x dp) times the transposed keys or values kt of the
// block's columns: the prefix into s[:, 0:t0], the tokens [cs, ce) from s[:, t0].
void block_scores(const SimdKernels& simd, const Operands& o, const Tiles& t, const Block& blk, const float* a,
                  const float* kt, float* s) {
  if (o.P > 0) simd.gemm(a, t.dp, 1, kt, t.np, s, t.np, blk.rp, t.t0, o.D, false);
  if (blk.nc > t.t0) simd.gemm(a, t.dp, 1, kt + t.t0 + blk.cs, t.np, s + t.t0, t.np, blk.rp, blk.nc - t.t0, o.D, false);
}

// c (rp x dp) = s's block columns times the matching rows of x (np x dp: prefix rows, then token rows from t0),
// the prefix first.
void block_apply(const SimdKernels& simd, const Operands& o, const Tiles& t, const Block& blk, const float* s,
                 const float* x, float* c) {
  if (o.P > 0) simd.gemm(s, t.np, 1, x, t.dp, c, t.dp, blk.rp, t.dp, o.P, false);
  simd.gemm(s + t.t0, t.np, 1, x + (t.t0 + blk.cs) * t.dp, t.dp, c, t.dp, blk.rp, t.dp, blk.ce - blk.cs, o.P > 0);
}

// Rows of x (np x dp) += s's block columns transposed times a (the block's rows x dp): key and value gradients,
// of the prefix and, with `tokens`, of the block's tokens.
void block_apply_t(const SimdKernels& simd, const Operands& o, const Tiles& t, const Block& blk, const float* s,
                   const float* a, float* x, bool tokens) {
  if (o.P > 0) simd.gemm(s, 1, t.np, a, t.dp, x, t.dp, round_up(o.P, kMr), t.dp, blk.rows, true);
  if (tokens && blk.ce > blk.cs) {
    simd.gemm(s + t.t0, 1, t.np, a, t.dp, x + (t.t0 + blk.cs) * t.dp, t.dp, round_up(blk.ce - blk.cs, kMr), t.dp,
              blk.rows, true);
  }
}

// The bias row `row` (over key positions) at the tile columns of a row's visible tokens, in t.bias (its prefix
// columns stay 0; hidden columns are overwritten by the softmax).
const float* gather_bias(const Operands& o, Tiles& t, const RowSpan& sp, const float* row) {
  float* bb = t.bias.data();
  for (int64_t c = sp.ta; c < sp.tb; ++c) bb[c] = row[sp.cols[c - sp.t0] - o.P];
  return bb;
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
void parallel_items(int64_t n_items, const Operands& o, bool backward, bool want_ds, const F& f) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Tiles tiles(o, row_block(o), backward, want_ds);
    for (int64_t item = next.fetch_add(1); item < n_items; item = next.fetch_add(1)) f(item, tiles);
  });
}

// --------------------------------------------------------------------------------------------------------
// forward

// The rows of sequence sq for query head h, against the keys gathered in t.
void forward_head(const SimdKernels& simd, const Operands& o, const Seq& sq, int64_t h, Tiles& t, float* out,
                  float* lse) {
  const int64_t D = o.D, np = t.np, dp = t.dp, n_cols = o.P + o.L;
  const uint32_t bh = static_cast<uint32_t>(sq.b * o.H + h);
  const float* qb = o.q + sq.batch * o.sq[0] + h * o.sq[1] + sq.row0 * o.sq[2];
  const float* bias = o.bias != nullptr ? o.bias + sq.b * o.sb[0] + h * o.sb[1] : nullptr;
  for (int64_t i0 = 0; i0 < sq.len; i0 += row_block(o)) {
    const Block blk = make_block(o, sq, t, i0);
    copy_rows_in(qb + i0 * o.sq[2], o.sq[2], blk.rows, D, t.q.data(), dp);
    block_scores(simd, o, t, blk, t.q.data(), t.kt.data(), t.s.data());
    for (int64_t r = 0; r < blk.rows; ++r) {
      const int64_t i = i0 + r;
      const RowSpan sp = blk.span(o, t, r);
      lse[sq.lse0 + h * sq.lse_h + i] = simd.softmax_row(
          t.s.data() + r * np, bias != nullptr ? gather_bias(o, t, sp, bias + i * o.sb[2]) : nullptr, sp, blk.nc,
          o.scale, static_cast<uint32_t>(i * n_cols), bh, o.dropout ? &o.key : nullptr, o.keep_scale);
    }
    block_apply(simd, o, t, blk, t.s.data(), t.vs.data(), t.o.data());
    copy_rows_out(t.o.data(), dp, blk.rows, D, out + ((sq.out_row0 + i0) * o.H + h) * D, o.H * D);
  }
}

// Sequence b, query heads [h0, h1) of one KV head: the keys are gathered once for them.
void forward_item(const SimdKernels& simd, const Operands& o, int64_t b, int64_t h0, int64_t h1, Tiles& t,
                  float* out, float* lse) {
  const Seq sq = sequence(o, b);
  gather_keys(o, sq, h0 / (o.H / o.Hkv), t, false);
  for (int64_t h = h0; h < h1; ++h) forward_head(simd, o, sq, h, t, out, lse);
}

std::tuple<at::Tensor, at::Tensor> prefix_attention_cpu_fwd(
    const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& pk_, const at::Tensor& pv_,
    const c10::optional<at::Tensor>& mask, const c10::optional<at::Tensor>& pidx, double scale, double dropout_p,
    const at::Tensor& seed_, bool causal, int64_t window_left, int64_t window_right,
    const c10::optional<at::Tensor>& attn_bias, const c10::optional<at::Tensor>& cu_seqlens, int64_t max_seqlen) {
  at::NoGradGuard no_grad;  // a kernel: autograd is registered around the op
  const int64_t seed = seed_value(seed_);
  const at::Tensor q = unit_last(q_), k = unit_last(k_), v = unit_last(v_), pk = unit_last(pk_),
                   pv = unit_last(pv_);
  const c10::optional<at::Tensor> bias = unit_last(attn_bias);
  const int64_t L = check_inputs(q, k, v, pk, pv, mask, pidx, window_left, window_right, bias, cu_seqlens, max_seqlen);
  const Operands o = operands(q, k, v, pk, pv, mask, pidx, scale, dropout_p, seed, causal, window_left, window_right,
                              bias, cu_seqlens, L);
  const SimdKernels& simd = simd_kernels();
  const bool poison = poison_outputs();
  const int64_t nb = q.size(0);
  at::Tensor out = poison ? at::full({nb, o.S, o.H, o.D}, NAN, q.options()) : at::empty({nb, o.S, o.H, o.D}, q.options());
  at::Tensor lse = poison ? at::full({nb, o.H, o.S}, NAN, q.options()) : at::empty({nb, o.H, o.S}, q.options());
  float* out_p = out.data_ptr<float>();
  float* lse_p = lse.data_ptr<float>();
  // Items: (sequence, KV head), the keys gathered once for the KV head's query heads; (sequence, query head) when
  // that leaves too few items for the threads (the results are the same: every row is computed alike).
  const int64_t group = o.H / o.Hkv, per_item = o.B * o.Hkv >= 2 * at::get_num_threads() ? group : 1;
  const int64_t chunks = o.H / per_item;
  parallel_items(o.B * chunks, o, false, false, [&](int64_t item, Tiles& t) {
    const int64_t h0 = item % chunks * per_item;
    forward_item(simd, o, item / chunks, h0, h0 + per_item, t, out_p, lse_p);
  });
  return {out.transpose(1, 2), lse};
}

// --------------------------------------------------------------------------------------------------------
// backward

struct Grads {
  float *dq, *dk, *dv;  // null when not wanted
  int64_t sdq[3], sdk[3], sdv[3];
  float *part_k, *part_v;  // prefix partial slots (n_slots, Hkv, P, D), null when not wanted
  bool per_example;        // slot = example (a (T, Hkv, P, D) prefix) or group of kGroup examples
  float* dbias;            // (B, H, L, L) gradient of the bias, null when not wanted
};

// Sequence b through KV head hk: its query heads' rows, accumulating the key/value gradients of its tokens and
// prompt over them (no atomics: one item owns the KV head of b).
void backward_sequence(const SimdKernels& simd, const Operands& o, const Grads& g, const float* dout,
                       const int64_t sdo[3], const float* lse, int64_t b, int64_t hk, int64_t slot, Tiles& t) {
  const Seq sq = sequence(o, b);
  const int64_t D = o.D, P = o.P, np = t.np, dp = t.dp, n_cols = P + o.L, group = o.H / o.Hkv;
  const int64_t n = gather_keys(o, sq, hk, t, true);
  const bool want_kv = g.dk != nullptr, want_prefix = g.part_k != nullptr;
  // dK, dV rows to accumulate: every gathered column, or only the prefix ones when the tokens' are not wanted
  const int64_t kv_rows = want_kv ? t.t0 + round_up(n, kLanes) : (want_prefix ? round_up(P, kMr) : 0);
  std::fill(t.dk.begin(), t.dk.begin() + kv_rows * dp, 0.0f);
  std::fill(t.dv.begin(), t.dv.begin() + kv_rows * dp, 0.0f);
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    const uint32_t bh = static_cast<uint32_t>(b * o.H + h);
    const float* qb = o.q + sq.batch * o.sq[0] + h * o.sq[1] + sq.row0 * o.sq[2];
    const float* dob = dout + sq.batch * sdo[0] + h * sdo[1] + sq.row0 * sdo[2];
    const float* bias = o.bias != nullptr ? o.bias + b * o.sb[0] + h * o.sb[1] : nullptr;
    float* dbias = g.dbias != nullptr ? g.dbias + (b * o.H + h) * o.L * o.L : nullptr;
    if (dbias != nullptr) std::fill(dbias, dbias + o.L * o.L, 0.0f);
    for (int64_t i0 = 0; i0 < sq.len; i0 += row_block(o)) {
      const Block blk = make_block(o, sq, t, i0);
      copy_rows_in(qb + i0 * o.sq[2], o.sq[2], blk.rows, D, t.q.data(), dp);
      copy_rows_in(dob + i0 * sdo[2], sdo[2], blk.rows, D, t.dout.data(), dp);
      block_scores(simd, o, t, blk, t.q.data(), t.kt.data(), t.s.data());
      block_scores(simd, o, t, blk, t.dout.data(), t.vt.data(), t.dp_.data());
      for (int64_t r = 0; r < blk.rows; ++r) {
        const int64_t i = i0 + r;
        const RowSpan sp = blk.span(o, t, r);
        simd.softmax_backward_row(t.s.data() + r * np, t.pd.data() + r * np, t.dp_.data() + r * np,
                                  dbias != nullptr ? t.ds.data() : nullptr,
                                  bias != nullptr ? gather_bias(o, t, sp, bias + i * o.sb[2]) : nullptr, sp, blk.nc,
                                  o.scale, lse[sq.lse0 + h * sq.lse_h + i], static_cast<uint32_t>(i * n_cols), bh,
                                  o.dropout ? &o.key : nullptr, o.keep_scale);
        if (dbias != nullptr) {
          for (int64_t c = sp.ta; c < sp.tb; ++c) dbias[i * o.L + sp.cols[c - sp.t0] - P] = t.ds[c];
        }
      }
      if (g.dq != nullptr) {
        block_apply(simd, o, t, blk, t.s.data(), t.ks.data(), t.o.data());
        copy_rows_out(t.o.data(), dp, blk.rows, D, g.dq + sq.batch * g.sdq[0] + h * g.sdq[1] + (sq.row0 + i0) * g.sdq[2],
                      g.sdq[2]);
      }
      if (kv_rows > 0) {  // dK += dS^T Q, dV += Pdrop^T dO over this block's rows
        block_apply_t(simd, o, t, blk, t.s.data(), t.q.data(), t.dk.data(), want_kv);
        block_apply_t(simd, o, t, blk, t.pd.data(), t.dout.data(), t.dv.data(), want_kv);
      }
    }
  }
  if (want_prefix) {
    const int64_t base = (slot * o.Hkv + hk) * P * D;
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
    float* dkb = g.dk + sq.batch * g.sdk[0] + hk * g.sdk[1] + sq.row0 * g.sdk[2];
    float* dvb = g.dv + sq.batch * g.sdv[0] + hk * g.sdv[1] + sq.row0 * g.sdv[2];
    for (int64_t j = 0; j < sq.len; ++j) {  // padded tokens get zeros
      std::memset(dkb + j * g.sdk[2], 0, D * sizeof(float));
      std::memset(dvb + j * g.sdv[2], 0, D * sizeof(float));
    }
    for (int64_t c = 0; c < n; ++c) {
      const int64_t j = t.cols[c] - P;
      std::memcpy(dkb + j * g.sdk[2], &t.dk[(t.t0 + c) * dp], D * sizeof(float));
      std::memcpy(dvb + j * g.sdv[2], &t.dv[(t.t0 + c) * dp], D * sizeof(float));
    }
  }
}

void strides3(const at::Tensor& x, int64_t* s) {
  for (int i = 0; i < 3; ++i) s[i] = x.stride(i);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> prefix_attention_cpu_bwd(
    const at::Tensor& dout_, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& pk_,
    const at::Tensor& pv_, const at::Tensor& lse_, const c10::optional<at::Tensor>& mask,
    const c10::optional<at::Tensor>& pidx, double scale, double dropout_p, const at::Tensor& seed_, bool need_dq,
    bool need_dkv, bool need_dprefix, bool causal, int64_t window_left, int64_t window_right,
    const c10::optional<at::Tensor>& attn_bias, const c10::optional<at::Tensor>& cu_seqlens, int64_t max_seqlen,
    bool need_dbias) {
  at::NoGradGuard no_grad;
  const int64_t seed = seed_value(seed_);
  const at::Tensor q = unit_last(q_), k = unit_last(k_), v = unit_last(v_), pk = unit_last(pk_),
                   pv = unit_last(pv_), dout = unit_last(dout_), lse = lse_.contiguous();
  const c10::optional<at::Tensor> bias = unit_last(attn_bias);
  const int64_t L = check_inputs(q, k, v, pk, pv, mask, pidx, window_left, window_right, bias, cu_seqlens, max_seqlen);
  TORCH_CHECK(dout_.sizes() == q_.sizes() && dout_.scalar_type() == at::kFloat,
              "prefix_attention_cpu_bwd: dout must be a float32 tensor of q's shape");
  TORCH_CHECK(lse_.scalar_type() == at::kFloat && lse_.dim() == 3 && lse_.size(0) == q_.size(0) &&
                  lse_.size(1) == q_.size(1) && lse_.size(2) == q_.size(2),
              "prefix_attention_cpu_bwd: lse must be a float32 (B, H, S) tensor");
  TORCH_CHECK(!need_dbias || bias.has_value(), "prefix_attention_cpu_bwd: need_dbias without an attn_bias");
  const Operands o = operands(q, k, v, pk, pv, mask, pidx, scale, dropout_p, seed, causal, window_left, window_right,
                              bias, cu_seqlens, L);
  const SimdKernels& simd = simd_kernels();
  const auto opts = q.options();
  const bool poison = poison_outputs();
  auto like = [&](const at::Tensor& x, bool wanted) {
    if (!wanted) return at::empty({0}, opts);
    at::Tensor y = at::empty_like(x);
    return poison ? y.fill_(NAN) : y;
  };
  at::Tensor dq = like(q_, need_dq), dk = like(k_, need_dkv), dv = like(v_, need_dkv);
  at::Tensor dbias = need_dbias ? like(at::empty({o.B, o.H, L, L}, opts), true) : at::empty({0}, opts);
  Grads g{};
  g.dq = need_dq ? dq.data_ptr<float>() : nullptr;
  g.dk = need_dkv ? dk.data_ptr<float>() : nullptr;
  g.dv = need_dkv ? dv.data_ptr<float>() : nullptr;
  g.dbias = need_dbias ? dbias.data_ptr<float>() : nullptr;
  TORCH_CHECK((!need_dq || dq.stride(3) == 1) && (!need_dkv || (dk.stride(3) == 1 && dv.stride(3) == 1)),
              "prefix_attention_cpu_bwd: gradients need a unit last stride");
  if (need_dq) strides3(dq, g.sdq);
  if (need_dkv) {
    strides3(dk, g.sdk);
    strides3(dv, g.sdv);
  }
  g.per_example = pk.dim() == 4;
  const int64_t n_groups = (o.B + kGroup - 1) / kGroup;
  const int64_t n_slots = g.per_example ? o.B : n_groups;
  at::Tensor part_k, part_v;
  if (need_dprefix) {
    part_k = at::zeros({n_slots, o.Hkv, o.P, o.D}, opts);
    part_v = at::zeros({n_slots, o.Hkv, o.P, o.D}, opts);
    g.part_k = part_k.data_ptr<float>();
    g.part_v = part_v.data_ptr<float>();
  }
  int64_t sdo[3];
  strides3(dout, sdo);
  const float* dout_p = dout.data_ptr<float>();
  const float* lse_p = lse.data_ptr<float>();
  if (need_dq || need_dkv || need_dprefix || need_dbias) {
    parallel_items(n_groups * o.Hkv, o, true, need_dbias, [&](int64_t item, Tiles& t) {
      const int64_t grp = item / o.Hkv, hk = item % o.Hkv;
      for (int64_t b = grp * kGroup; b < std::min(o.B, (grp + 1) * kGroup); ++b)
        backward_sequence(simd, o, g, dout_p, sdo, lse_p, b, hk, g.per_example ? b : grp, t);
    });
  }
  at::Tensor dpk = at::empty({0}, opts), dpv = at::empty({0}, opts);
  if (need_dprefix) {  // sum the slots into each prompt, in slot order
    const int64_t T = g.per_example ? pk.size(0) : 1, HPD = o.Hkv * o.P * o.D;
    dpk = at::zeros(pk_.sizes(), opts);
    dpv = at::zeros(pv_.sizes(), opts);
    float* dpk_p = dpk.data_ptr<float>();
    float* dpv_p = dpv.data_ptr<float>();
    at::parallel_for(0, T * o.Hkv, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t tt = item / o.Hkv, h = item % o.Hkv, PD = o.P * o.D;
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
  return {dq, dk, dv, dpk, dpv, dbias};
}

// The level FASTPROMPT_CPU_ISA selects now, and the levels this build has and this CPU supports.
std::string prefix_attention_cpu_isa() { return simd_kernels().name; }
std::vector<std::string> prefix_attention_cpu_isa_levels() { return isa_supported_levels(); }

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
  // window_left / window_right: -1 = unbounded; max_seqlen: -1 = the longest packed sequence (or padded: unused)
  m.def(
      "prefix_attention_cpu_fwd(Tensor q, Tensor k, Tensor v, Tensor prefix_k, Tensor prefix_v, "
      "Tensor? key_padding_mask, Tensor? prompt_index, float scale, float dropout_p, Tensor seed, "
      "bool causal=False, int window_left=-1, int window_right=-1, Tensor? attn_bias=None, "
      "Tensor? cu_seqlens=None, int max_seqlen=-1) -> (Tensor, Tensor)");
  m.def(
      "prefix_attention_cpu_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor prefix_k, Tensor prefix_v, "
      "Tensor lse, Tensor? key_padding_mask, Tensor? prompt_index, float scale, float dropout_p, Tensor seed, "
      "bool need_dq, bool need_dkv, bool need_dprefix, bool causal=False, int window_left=-1, int window_right=-1, "
      "Tensor? attn_bias=None, Tensor? cu_seqlens=None, int max_seqlen=-1, bool need_dbias=False) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
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
