// The vectorised inner loops of the CPU prefix attention (prefix_attention.cpp): the register-blocked product,
// exp, the row reductions and the per-row softmax steps. No include guard on purpose: prefix_attention.cpp
// includes this file once per x86-64 level, each time inside its own namespace and under
// `#pragma GCC target(...)`, so each level gets its own compiled copy (see kSimdLevels there). Expects kLanes,
// kMr, kNegInf, PhiloxKey, philox_row_words, philox_word_keeps, RowSpan and FASTPROMPT_SIMD_BYTES (the level's
// vector width) from the includer.

// Each level's vector is its register width (FASTPROMPT_SIMD_BYTES, defined by the includer: 64 for AVX-512, 32
// for AVX2, 16 for SSE); a strip of kLanes = 16 columns (the tiles' padding) is kNv such vectors. A vector wider
// than the level's registers would be lowered by GCC through the stack (measured: AVX2 then ran 4x slower than
// AVX-512 and slower than SSE).
constexpr int kV = FASTPROMPT_SIMD_BYTES / static_cast<int>(sizeof(float));  // floats per vector
constexpr int kNv = static_cast<int>(kLanes) / kV;                             // vectors per 16-column strip
constexpr int kRb = kNv > 2 ? 2 : static_cast<int>(kMr);  // rows per register block: kRb * kNv + kNv registers
static_assert(kLanes % kV == 0 && kMr % kRb == 0, "a strip is whole vectors, kMr whole register blocks");

typedef float vfloat __attribute__((vector_size(FASTPROMPT_SIMD_BYTES)));

FASTPROMPT_INLINE vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

FASTPROMPT_INLINE void store(float* p, const vfloat& v) { std::memcpy(p, &v, sizeof(v)); }

// C (M x N, row stride ldc) = [C +] sum_k A(r, k) B(k, :), with A(r, k) = a[r * ars + k * aks] and B row-major
// (row stride ldb). M must be a multiple of kMr and N of kLanes (callers pad their tiles with zeros).
void gemm(const float* __restrict a, int64_t ars, int64_t aks, const float* __restrict b, int64_t ldb,
          float* __restrict c, int64_t ldc, int64_t M, int64_t N, int64_t K, bool accumulate) {
  for (int64_t i = 0; i < M; i += kRb) {
    for (int64_t j = 0; j < N; j += kLanes) {
      vfloat acc[kRb][kNv];
      for (int r = 0; r < kRb; ++r)
        for (int v = 0; v < kNv; ++v) acc[r][v] = accumulate ? load(c + (i + r) * ldc + j + v * kV) : vfloat{};
      const float* ai = a + i * ars;
      for (int64_t k = 0; k < K; ++k) {
        vfloat bk[kNv];
        for (int v = 0; v < kNv; ++v) bk[v] = load(b + k * ldb + j + v * kV);
        for (int r = 0; r < kRb; ++r) {
          const float ark = ai[r * ars + k * aks];
          for (int v = 0; v < kNv; ++v) acc[r][v] += ark * bk[v];
        }
      }
      for (int r = 0; r < kRb; ++r)
        for (int v = 0; v < kNv; ++v) store(c + (i + r) * ldc + j + v * kV, acc[r][v]);
    }
  }
}

typedef int32_t vint __attribute__((vector_size(FASTPROMPT_SIMD_BYTES)));

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
  for (int64_t c = 0; c < np; c += kV) store(s + c, vexp_nonpositive(load(s + c) * mul - sub));
}

// Sums and maxima over np = a multiple of kLanes entries, with a fixed association whatever the level's vector
// width: 16 partial results (column c goes to c mod 16), then those in order. (The compiler does not vectorise a
// float reduction written as a plain loop.)
FASTPROMPT_INLINE float vsum(const float* x, int64_t np) {
  vfloat acc[kNv] = {};
  for (int64_t c = 0; c < np; c += kLanes)
    for (int v = 0; v < kNv; ++v) acc[v] += load(x + c + v * kV);
  float s = 0.0f;
  for (int v = 0; v < kNv; ++v)
    for (int l = 0; l < kV; ++l) s += acc[v][l];
  return s;
}

FASTPROMPT_INLINE float vdot(const float* x, const float* y, int64_t np) {
  vfloat acc[kNv] = {};
  for (int64_t c = 0; c < np; c += kLanes)
    for (int v = 0; v < kNv; ++v) acc[v] += load(x + c + v * kV) * load(y + c + v * kV);
  float s = 0.0f;
  for (int v = 0; v < kNv; ++v)
    for (int l = 0; l < kV; ++l) s += acc[v][l];
  return s;
}

FASTPROMPT_INLINE float vmax(const float* x, int64_t np) {
  vfloat acc[kNv];
  for (int v = 0; v < kNv; ++v) acc[v] = load(x + v * kV);
  for (int64_t c = kLanes; c < np; c += kLanes) {
    for (int v = 0; v < kNv; ++v) {
      const vfloat w = load(x + c + v * kV);
      acc[v] = w > acc[v] ? w : acc[v];
    }
  }
  float m = acc[0][0];
  for (int v = 0; v < kNv; ++v)
    for (int l = 0; l < kV; ++l) m = std::max(m, acc[v][l]);
  return m;
}

// --------------------------------------------------------------------------------------------------------
// row-wise steps of the softmax over the visible columns of a score row (RowSpan: the prefix columns and one
// range of token columns; every other column of the nc computed ones is hidden)

// s[c] = s[c] * scale (+ bias[c]) for c < nc (a multiple of kLanes).
FASTPROMPT_INLINE void scale_row(float* __restrict s, const float* __restrict bias, int64_t nc, float scale) {
  if (bias == nullptr) {
    for (int64_t c = 0; c < nc; c += kV) store(s + c, load(s + c) * scale);
  } else {
    for (int64_t c = 0; c < nc; c += kV) store(s + c, load(s + c) * scale + load(bias + c));
  }
}

// Sets the hidden columns of [0, nc) to `value`: [P, ta) (the padding up to the token block and the tokens
// before the row's span) and [tb, nc).
FASTPROMPT_INLINE void hide(float* s, const RowSpan& sp, int64_t nc, float value) {
  for (int64_t c = sp.P; c < sp.ta; ++c) s[c] = value;
  for (int64_t c = sp.tb; c < nc; ++c) s[c] = value;
}

// x[c] *= (kept ? w : 0) over the visible columns, the keep decision of column c drawn at its key column of the
// virtual concatenation (c for the prefix, sp.cols[c - t0] for a token); y[c] = x[c] before the product times the
// same factor when y is not null (the backward: probabilities and their gradient). The row's Philox words are
// drawn once for its key columns up to the last visible one (four per Philox call, philox.h).
FASTPROMPT_INLINE void drop_row(float* __restrict x, float* __restrict y, const RowSpan& sp, uint32_t row_base,
                                uint32_t bh, const PhiloxKey& key, float w) {
  int64_t n = sp.P;  // key columns [0, n) cover every visible column
  for (int64_t c = sp.ta; c < sp.tb; ++c) n = std::max<int64_t>(n, sp.cols[c - sp.t0] + 1);
  static thread_local std::vector<uint32_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < 8 * (n / 4 + 2)) buffer.resize(8 * (n / 4 + 2));
  const uint32_t* words = philox_row_words(row_base, n, bh, key, buffer.data());
  for (int64_t c = 0; c < sp.P; ++c) {
    const float f = philox_word_keeps(words[c], key.p) ? w : 0.0f;
    if (y != nullptr) y[c] *= f;
    x[c] *= f;
  }
  for (int64_t c = sp.ta; c < sp.tb; ++c) {
    const float f = philox_word_keeps(words[sp.cols[c - sp.t0]], key.p) ? w : 0.0f;
    if (y != nullptr) y[c] *= f;
    x[c] *= f;
  }
}

// Scores (s * scale + bias) -> dropped-out probabilities in place over the nc computed columns (hidden ones 0);
// returns the row's natural-log log-sum-exp, -inf when it sees no key (no visible column, or only scores of -inf).
float softmax_row(float* __restrict s, const float* __restrict bias, const RowSpan& sp, int64_t nc, float scale,
                  uint32_t row_base, uint32_t bh, const PhiloxKey* key, float keep_scale) {
  if (sp.P + sp.tb - sp.ta > 0) {
    scale_row(s, bias, nc, scale);
    hide(s, sp, nc, kNegInf);
    const float m = vmax(s, nc);
    if (m > kNegInf) {
      exp_row(s, nc, 1.0f, m);
      hide(s, sp, nc, 0.0f);
      const float sum = vsum(s, nc);
      if (key != nullptr) {
        drop_row(s, nullptr, sp, row_base, bh, *key, keep_scale / sum);
      } else {
        const float inv = 1.0f / sum;
        for (int64_t c = 0; c < nc; c += kV) store(s + c, load(s + c) * inv);
      }
      return m + std::log(sum);
    }
  }
  std::memset(s, 0, nc * sizeof(float));
  return kNegInf;
}

// Backward of one row, in place: on entry s holds the raw products q . k and dp = dO . V; on return s holds
// dS * scale (dS: the gradient of the biased, scaled scores) and pd the dropped-out probabilities, hidden columns
// 0. dS itself is copied to ds over the visible token columns [ta, tb) when ds is not null (the bias gradient).
void softmax_backward_row(float* __restrict s, float* __restrict pd, float* __restrict dp, float* __restrict ds,
                          const float* __restrict bias, const RowSpan& sp, int64_t nc, float scale, float lse,
                          uint32_t row_base, uint32_t bh, const PhiloxKey* key, float keep_scale) {
  if (!(lse > kNegInf)) {  // a row that saw no key: no gradient
    std::memset(s, 0, nc * sizeof(float));
    std::memset(pd, 0, nc * sizeof(float));
    std::memset(dp, 0, nc * sizeof(float));
    if (ds != nullptr) std::memset(ds + sp.ta, 0, (sp.tb - sp.ta) * sizeof(float));
    return;
  }
  // the probabilities (hidden columns may overflow here: they are zeroed next)
  if (bias != nullptr) {
    scale_row(s, bias, nc, scale);
    exp_row(s, nc, 1.0f, lse);
  } else {
    exp_row(s, nc, scale, lse);
  }
  hide(s, sp, nc, 0.0f);
  hide(dp, sp, nc, 0.0f);
  std::memcpy(pd, s, nc * sizeof(float));
  if (key != nullptr) drop_row(dp, pd, sp, row_base, bh, *key, keep_scale);  // dp: the gradient before dropout
  const float delta = vdot(s, dp, nc);  // sum_c p_c g_c = dO . O
  if (ds != nullptr) {
    for (int64_t c = 0; c < nc; c += kV) store(s + c, load(s + c) * (load(dp + c) - delta));
    std::memcpy(ds + sp.ta, s + sp.ta, (sp.tb - sp.ta) * sizeof(float));
    for (int64_t c = 0; c < nc; c += kV) store(s + c, load(s + c) * scale);
  } else {
    for (int64_t c = 0; c < nc; c += kV) store(s + c, load(s + c) * (load(dp + c) - delta) * scale);
  }
}
