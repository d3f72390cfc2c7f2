// The per-row loops of the fused dropout + residual add + LayerNorm (dropout_add_norm.cpp). No include guard on
// purpose: dropout_add_norm.cpp includes this file once per x86-64 level of cpu_levels.h, each time inside its
// own namespace and under `#pragma GCC target(...)`, so each level gets its own compiled copy. Expects kLanes,
// PhiloxKey and philox_words (philox.h) from the includer. Plain loops written for the compiler to vectorise; the row
// sums accumulate in kLanes fixed partial sums combined in a fixed order, so the levels differ only in rounding
// (x86-64-v3 and v4 contract a * b + c into one fused multiply-add), never in the order of a sum.

// Sum of x[0, n) and of x[c] * y[c] (y nullptr: x[c] * x[c]).
FASTPROMPT_INLINE float lane_sum(const float* acc) {
  float total = 0.0f;
  for (int64_t j = 0; j < kLanes; ++j) total += acc[j];
  return total;
}

float row_sum(const float* __restrict x, int64_t n) {
  float acc[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += x[c + j];
  for (int64_t j = 0; c + j < n; ++j) acc[j] += x[c + j];
  return lane_sum(acc);
}

float row_dot(const float* __restrict x, const float* __restrict y, int64_t n) {
  float acc[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += x[c + j] * y[c + j];
  for (int64_t j = 0; c + j < n; ++j) acc[j] += x[c + j] * y[c + j];
  return lane_sum(acc);
}

// The keep factors of row elements [e0, e0 + n) of the flat (rows, C) input: m[c] = scale when element e0 + c is
// kept, else 0, and the same decisions as bits (bit c % 8 of bits[c / 8]). Element e's decision is word e % 4 of
// Philox4x32-10 at counter (e / 4 mod 2^32, e / 4 div 2^32, key.c2, 0): kept when that word >= threshold.
// `words` holds 8 * (n / 4 + 2) uint32.
void keep_row(uint64_t e0, int64_t n, uint32_t threshold, float scale, const PhiloxKey& key,
              uint32_t* __restrict words, float* __restrict m, uint8_t* __restrict bits) {
  const uint64_t q0 = e0 >> 2, q1 = (e0 + static_cast<uint64_t>(n) + 3) >> 2;  // the counters the row reads
  const int64_t nq = static_cast<int64_t>(q1 - q0);
  uint32_t* __restrict seq = words + 4 * nq;  // seq[4 j + k] = word k of counter q0 + j
  philox_words(
      nq,
      [&](int64_t j) {
        const uint64_t q = q0 + static_cast<uint64_t>(j);
        return std::pair<uint32_t, uint32_t>(static_cast<uint32_t>(q), static_cast<uint32_t>(q >> 32));
      },
      key, words, seq);
  const uint32_t* __restrict row = seq + (e0 & 3);  // row[c]: the word of element e0 + c
  for (int64_t c = 0; c < n; ++c) m[c] = row[c] >= threshold ? scale : 0.0f;
  const int64_t full = n / 8;
  for (int64_t byte = 0; byte < full; ++byte) {
    uint32_t packed = 0;
    for (int k = 0; k < 8; ++k) packed |= static_cast<uint32_t>(row[8 * byte + k] >= threshold) << k;
    bits[byte] = static_cast<uint8_t>(packed);
  }
  if (full * 8 < n) {
    uint32_t packed = 0;
    for (int64_t k = 0; full * 8 + k < n; ++k) packed |= static_cast<uint32_t>(row[8 * full + k] >= threshold) << k;
    bits[full] = static_cast<uint8_t>(packed);
  }
}

// One row of the forward: s = x * m + r (m: the keep factors, nullptr without dropout), xhat = (s - mean) * rstd,
// y = xhat * weight + bias (weight / bias nullptr: 1 / 0). Returns rstd.
float forward_row(const float* __restrict x, const float* __restrict r, const float* __restrict m,
                  const float* __restrict weight, const float* __restrict bias, int64_t n, float eps,
                  float* __restrict xhat, float* __restrict y) {
  if (m != nullptr) {
    for (int64_t c = 0; c < n; ++c) xhat[c] = x[c] * m[c] + r[c];
  } else {
    for (int64_t c = 0; c < n; ++c) xhat[c] = x[c] + r[c];
  }
  const float mean = row_sum(xhat, n) / static_cast<float>(n);
  for (int64_t c = 0; c < n; ++c) xhat[c] -= mean;
  const float var = row_dot(xhat, xhat, n) / static_cast<float>(n);
  const float rstd = 1.0f / std::sqrt(var + eps);
  for (int64_t c = 0; c < n; ++c) xhat[c] *= rstd;
  if (weight != nullptr && bias != nullptr) {
    for (int64_t c = 0; c < n; ++c) y[c] = xhat[c] * weight[c] + bias[c];
  } else if (weight != nullptr) {
    for (int64_t c = 0; c < n; ++c) y[c] = xhat[c] * weight[c];
  } else if (bias != nullptr) {
    for (int64_t c = 0; c < n; ++c) y[c] = xhat[c] + bias[c];
  } else {
    for (int64_t c = 0; c < n; ++c) y[c] = xhat[c];
  }
  return rstd;
}

// One row of the backward: g = dy * weight, ds = rstd * (g - mean(g) - xhat * mean(g * xhat)); d_residual = ds,
// dx = ds * m (m: the keep factors rebuilt from the saved bits; nullptr without dropout: dx = ds). `g` is scratch
// of n floats; dr or dx may be nullptr (not needed).
void backward_row(const float* __restrict dy, const float* __restrict xhat, const float* __restrict weight,
                  const float* __restrict m, float rstd, int64_t n, float* __restrict g, float* __restrict dr,
                  float* __restrict dx) {
  if (weight != nullptr) {
    for (int64_t c = 0; c < n; ++c) g[c] = dy[c] * weight[c];
  } else {
    for (int64_t c = 0; c < n; ++c) g[c] = dy[c];
  }
  const float mean_g = row_sum(g, n) / static_cast<float>(n);
  const float mean_gx = row_dot(g, xhat, n) / static_cast<float>(n);
  for (int64_t c = 0; c < n; ++c) g[c] = rstd * (g[c] - mean_g - xhat[c] * mean_gx);
  if (dr != nullptr)
    for (int64_t c = 0; c < n; ++c) dr[c] = g[c];
  if (dx != nullptr) {
    if (m != nullptr) {
      for (int64_t c = 0; c < n; ++c) dx[c] = g[c] * m[c];
    } else {
      for (int64_t c = 0; c < n; ++c) dx[c] = g[c];
    }
  }
}

// The keep factors m[c] = scale or 0 of one row from its saved bits.
void unpack_row(const uint8_t* __restrict bits, int64_t n, float scale, float* __restrict m) {
  for (int64_t c = 0; c < n; ++c) m[c] = (bits[c >> 3] >> (c & 7)) & 1 ? scale : 0.0f;
}
