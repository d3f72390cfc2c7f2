// Fused dropout + residual add + LayerNorm on the CPU: y = LayerNorm(dropout(x) + residual), the closing step of
// a BERT-style attention or feed-forward block (dense -> dropout -> LayerNorm(h + input)), forward and backward,
// over the rows of (N, C) float32 inputs.
//
// Eager PyTorch runs it as four ops (bernoulli_ into a mask, two multiplies, an add, native_layer_norm) and
// keeps the mask (a byte per element) besides the LayerNorm's input; here one pass per row draws the dropout
// decisions, adds the residual, normalises and writes y, and the backward is one pass per row as well. Saved for
// the backward: the normalised row xhat (N, C), 1 / std per row (N), and the keep decisions as bits (N, ceil(C/8)
// uint8), an eighth of the byte mask. Without dropout (dropout_p = 0) nothing is drawn and no bits are kept.
//
// The dropout decisions come from Philox4x32-10 (philox.h; the attention kernels' generator, here with all four
// output words used): element e of the flat (N, C) input is kept when word e % 4 at counter
// (e / 4 mod 2^32, e / 4 div 2^32, seed_hi, 0), key (seed_lo, sign(seed_lo) ? ~0 : 0), is >= round(p * 2^32). The
// same distribution as torch's dropout (keep with probability 1 - p, kept values scaled by 1 / (1 - p)), other
// draws; they depend only on the seed and the element's index, so they are the same on every machine, level and
// thread count (dropout_add_layer_norm_cpu_keep_mask returns them, for tests and the reference).
//
// The gradients of the LayerNorm's weight and bias, needed only when those train, are left to the Python side
// (sums over the rows of dy * xhat and dy).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_levels.h"
#include "philox.h"

namespace fastprompt {
namespace {

constexpr int64_t kLanes = 16;  // partial sums per row reduction (fixed: the order of every sum)
constexpr int64_t kRowGrain = 16;  // rows per parallel work item at least

namespace add_norm_baseline {
#include "dropout_add_norm_rows.h"
}  // namespace add_norm_baseline
#ifdef FASTPROMPT_ISA_LEVELS
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
namespace add_norm_v3 {
#include "dropout_add_norm_rows.h"
}  // namespace add_norm_v3
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
namespace add_norm_v4 {
#include "dropout_add_norm_rows.h"
}  // namespace add_norm_v4
#pragma GCC pop_options
#endif

struct RowKernels {
  decltype(&add_norm_baseline::keep_row) keep_row;
  decltype(&add_norm_baseline::forward_row) forward_row;
  decltype(&add_norm_baseline::backward_row) backward_row;
  decltype(&add_norm_baseline::unpack_row) unpack_row;
};

const RowKernels kRowLevels[] = {  // the order of kIsaLevels
#ifdef FASTPROMPT_ISA_LEVELS
    {&add_norm_v4::keep_row, &add_norm_v4::forward_row, &add_norm_v4::backward_row, &add_norm_v4::unpack_row},
    {&add_norm_v3::keep_row, &add_norm_v3::forward_row, &add_norm_v3::backward_row, &add_norm_v3::unpack_row},
#endif
    {&add_norm_baseline::keep_row, &add_norm_baseline::forward_row, &add_norm_baseline::backward_row,
     &add_norm_baseline::unpack_row},
};
static_assert(sizeof(kRowLevels) / sizeof(kRowLevels[0]) == kIsaLevelCount, "one copy per level of kIsaLevels");

// Keep when the Philox word is >= this: round(p * 2^32), at most 2^32 - 1.
uint32_t keep_threshold(double dropout_p) {
  return static_cast<uint32_t>(std::min<long long>(std::llround(dropout_p * 4294967296.0), 4294967295LL));
}

void check_dropout(double dropout_p) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "dropout_add_layer_norm_cpu: dropout_p must be in [0, 1), got ",
              dropout_p);
}

void check_rows(const at::Tensor& t, const char* name, int64_t N, int64_t C) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 &&
                  t.size(0) == N && t.size(1) == C,
              "dropout_add_layer_norm_cpu: ", name, " must be a contiguous float32 CPU tensor of shape (", N, ", ", C,
              "), got ", t.scalar_type(), " ", t.sizes());
}

const float* vector_or_null(const c10::optional<at::Tensor>& t, const char* name, int64_t C) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 1 &&
                  t->size(0) == C,
              "dropout_add_layer_norm_cpu: ", name, " must be a contiguous float32 CPU vector of size ", C);
  return t->data_ptr<float>();
}

int64_t seed_of(const at::Tensor& seed) {
  TORCH_CHECK(seed.device().is_cpu() && seed.scalar_type() == at::kLong && seed.numel() == 1,
              "dropout_add_layer_norm_cpu: seed must be a one-element int64 CPU tensor");
  return seed.item<int64_t>();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dropout_add_layer_norm_cpu_fwd(
    const at::Tensor& x, const at::Tensor& residual, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, double eps, double dropout_p, const at::Tensor& seed) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "dropout_add_layer_norm_cpu: x must be (rows, C) with C > 0, got ",
              x.sizes());
  const int64_t N = x.size(0), C = x.size(1);
  check_rows(x, "x", N, C);
  check_rows(residual, "residual", N, C);
  check_dropout(dropout_p);
  const float* w = vector_or_null(weight, "weight", C);
  const float* b = vector_or_null(bias, "bias", C);
  const bool drop = dropout_p > 0.0;
  const PhiloxKey key = philox_key(drop ? seed_of(seed) : 0, dropout_p);
  const uint32_t threshold = keep_threshold(dropout_p);
  const float scale = static_cast<float>(1.0 / (1.0 - dropout_p));
  const int64_t row_bytes = drop ? (C + 7) / 8 : 0;
  const bool poison = poison_outputs();
  const auto opts = x.options();
  at::Tensor y = poison ? at::full({N, C}, NAN, opts) : at::empty({N, C}, opts);
  at::Tensor xhat = poison ? at::full({N, C}, NAN, opts) : at::empty({N, C}, opts);
  at::Tensor rstd = poison ? at::full({N}, NAN, opts) : at::empty({N}, opts);
  const auto byte_opts = opts.dtype(at::kByte);
  at::Tensor bits = poison ? at::full({N, row_bytes}, 0xA5, byte_opts) : at::empty({N, row_bytes}, byte_opts);
  const RowKernels& k = kRowLevels[isa_level_index()];
  const float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* hp = xhat.data_ptr<float>();
  float* sp = rstd.data_ptr<float>();
  uint8_t* bp = bits.data_ptr<uint8_t>();
  at::parallel_for(0, N, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> m(drop ? C : 0);
    std::vector<uint32_t> words(drop ? 8 * (C / 4 + 2) : 0);
    for (int64_t n = begin; n < end; ++n) {
      if (drop)
        k.keep_row(static_cast<uint64_t>(n) * static_cast<uint64_t>(C), C, threshold, scale, key, words.data(),
                   m.data(), bp + n * row_bytes);
      sp[n] = k.forward_row(xp + n * C, rp + n * C, drop ? m.data() : nullptr, w, b, C, static_cast<float>(eps),
                            hp + n * C, yp + n * C);
    }
  });
  return {y, xhat, rstd, bits};
}

std::tuple<at::Tensor, at::Tensor> dropout_add_layer_norm_cpu_bwd(const at::Tensor& dy, const at::Tensor& xhat,
                                                                  const at::Tensor& rstd,
                                                                  const c10::optional<at::Tensor>& weight,
                                                                  const at::Tensor& bits, double dropout_p,
                                                                  bool need_dx, bool need_dresidual) {
  TORCH_CHECK(xhat.dim() == 2 && xhat.size(1) > 0, "dropout_add_layer_norm_cpu: xhat must be (rows, C)");
  const int64_t N = xhat.size(0), C = xhat.size(1);
  check_rows(dy, "dy", N, C);
  check_rows(xhat, "xhat", N, C);
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.is_contiguous() && rstd.numel() == N,
              "dropout_add_layer_norm_cpu: rstd must be a contiguous float32 vector of size ", N);
  check_dropout(dropout_p);
  const float* w = vector_or_null(weight, "weight", C);
  const bool drop = dropout_p > 0.0;
  const int64_t row_bytes = drop ? (C + 7) / 8 : 0;
  TORCH_CHECK(bits.scalar_type() == at::kByte && bits.is_contiguous() && bits.dim() == 2 && bits.size(0) == N &&
                  bits.size(1) == row_bytes,
              "dropout_add_layer_norm_cpu: keep bits must be uint8 (", N, ", ", row_bytes, ")");
  const float scale = static_cast<float>(1.0 / (1.0 - dropout_p));
  const bool poison = poison_outputs();
  const auto opts = dy.options();
  auto out = [&](bool needed) {
    const std::vector<int64_t> shape = needed ? std::vector<int64_t>{N, C} : std::vector<int64_t>{0};
    return poison ? at::full(shape, NAN, opts) : at::empty(shape, opts);
  };
  at::Tensor dx = out(need_dx), dres = out(need_dresidual);
  if (!need_dx && !need_dresidual) return {dx, dres};
  const RowKernels& k = kRowLevels[isa_level_index()];
  const float* gp = dy.data_ptr<float>();
  const float* hp = xhat.data_ptr<float>();
  const float* sp = rstd.data_ptr<float>();
  const uint8_t* bp = bits.data_ptr<uint8_t>();
  float* dxp = need_dx ? dx.data_ptr<float>() : nullptr;
  float* drp = need_dresidual ? dres.data_ptr<float>() : nullptr;
  at::parallel_for(0, N, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> g(C), m(drop && need_dx ? C : 0);
    for (int64_t n = begin; n < end; ++n) {
      if (!m.empty()) k.unpack_row(bp + n * row_bytes, C, scale, m.data());
      k.backward_row(gp + n * C, hp + n * C, w, m.empty() ? nullptr : m.data(), sp[n], C, g.data(),
                     drp == nullptr ? nullptr : drp + n * C, dxp == nullptr ? nullptr : dxp + n * C);
    }
  });
  return {dx, dres};
}

// The keep decisions (rows, cols) bool of the kernel's dropout for a seed (True = kept): for tests and for the
// reference to replay.
at::Tensor dropout_add_layer_norm_cpu_keep_mask(int64_t rows, int64_t cols, double dropout_p, int64_t seed) {
  TORCH_CHECK(rows >= 0 && cols > 0, "dropout_add_layer_norm_cpu_keep_mask: rows must be >= 0 and cols > 0");
  check_dropout(dropout_p);
  const PhiloxKey key = philox_key(seed, dropout_p);
  const uint32_t threshold = keep_threshold(dropout_p);
  at::Tensor keep = at::empty({rows, cols}, at::TensorOptions().dtype(at::kBool));
  bool* out = keep.data_ptr<bool>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> m(cols);
    std::vector<uint32_t> words(8 * (cols / 4 + 2));
    std::vector<uint8_t> bits((cols + 7) / 8);
    for (int64_t n = begin; n < end; ++n) {
      add_norm_baseline::keep_row(static_cast<uint64_t>(n) * static_cast<uint64_t>(cols), cols, threshold, 1.0f,
                                  key, words.data(), m.data(), bits.data());
      for (int64_t c = 0; c < cols; ++c) out[n * cols + c] = m[c] != 0.0f;
    }
  });
  return keep;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastprompt, m) {
  m.def(
      "dropout_add_layer_norm_cpu_fwd(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, "
      "float dropout_p, Tensor seed) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "dropout_add_layer_norm_cpu_bwd(Tensor dy, Tensor xhat, Tensor rstd, Tensor? weight, Tensor keep_bits, "
      "float dropout_p, bool need_dx, bool need_dresidual) -> (Tensor, Tensor)");
  m.def("dropout_add_layer_norm_cpu_keep_mask(int rows, int cols, float dropout_p, int seed) -> Tensor",
        &dropout_add_layer_norm_cpu_keep_mask);
}

TORCH_LIBRARY_IMPL(fastprompt, CPU, m) {
  m.impl("dropout_add_layer_norm_cpu_fwd", &dropout_add_layer_norm_cpu_fwd);
  m.impl("dropout_add_layer_norm_cpu_bwd", &dropout_add_layer_norm_cpu_bwd);
}

}  // namespace fastprompt
