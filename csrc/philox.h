// The counter-based random numbers of the prefix-attention dropout, bit for bit those of the Triton kernels
// (kernels/prefix_attention.py: _keep = tl.philox + tl.uint_to_uniform_float), so a seed drops the same
// attention probabilities on the CPU kernel as on a GPU; the fused dropout + add + LayerNorm (dropout_add_norm.cpp)
// draws from the same generator.
//
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) with Triton's
// constants and round order; each counter gives four output words, which serve four consecutive elements. The
// keep decision of probability (b, h, i, j) (example b, head h, query row i, key column j of the virtual
// [prefix ; tokens] concatenation of P + S columns), with e = i * (P + S) + j mod 2^32, is
//     counter = (e / 4, b * H + h, seed_hi, 0),  key = (seed_lo, sign(seed_lo) ? ~0 : 0),  r = word e % 4
//     keep    = float(r >= 0 ? r : -r - 1) * 4.6566127342e-10f >= dropout_p      (r as int32)
// where seed_lo / seed_hi are the low and high 32-bit words of the 64-bit seed: Triton receives seed_lo as a
// signed 32-bit argument and widens it to 64 bits with sign extension before splitting it into its key
// words. All of it is integer arithmetic plus one rounded float product and a comparison, so it is exact
// and the same on every machine. One Philox call per four probabilities (the rounds are most of the dropout's
// cost on a CPU).
#pragma once

#include <cstdint>
#include <utility>

// Inlined into the callers' per-level copies (GCC does not inline a plain inline function into a function
// compiled for another -march, even when the callee's ISA is a subset).
#if defined(__GNUC__) || defined(__clang__)
#define FASTPROMPT_INLINE inline __attribute__((always_inline))
#else
#define FASTPROMPT_INLINE inline
#endif

namespace fastprompt {

struct PhiloxKey {
  uint32_t k0, k1, c2;  // key words and the third counter word (seed_hi)
  float p;              // dropout probability, as the fp32 kernel argument Triton receives
};

FASTPROMPT_INLINE PhiloxKey philox_key(int64_t seed, double dropout_p) {
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint32_t lo = static_cast<uint32_t>(s), hi = static_cast<uint32_t>(s >> 32);
  return {lo, (lo >> 31) ? 0xFFFFFFFFu : 0u, hi, static_cast<float>(dropout_p)};
}

// The ten rounds of Philox4x32-10 on the counter (c0, c1, c2, c3) with key (k0, k1), in place: the counter
// words become the four output words. Branch-free integer code: loops over counters vectorise.
FASTPROMPT_INLINE void philox_rounds(uint32_t& c0, uint32_t& c1, uint32_t& c2, uint32_t& c3, uint32_t k0,
                                     uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;  // A * c0
    const uint64_t p2 = static_cast<uint64_t>(0xCD9E8D57u) * c2;  // B * c2
    const uint32_t n0 = static_cast<uint32_t>(p2 >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p2);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

// Whether a Philox word keeps its probability (Triton's uint_to_uniform_float(r) >= p).
FASTPROMPT_INLINE bool philox_word_keeps(uint32_t word, float p) {
  const int32_t r = static_cast<int32_t>(word);
  const int32_t x = r ^ (r >> 31);  // r >= 0 ? r : -r - 1, without the overflow of -INT32_MIN
  return static_cast<float>(x) * 4.6566127342e-10f >= p;
}

// Whether the probability of element e (= i * (P + S) + j mod 2^32) of stream c1 (= b * H + h) is kept: word e % 4
// of Philox4x32-10 at counter (e / 4, c1, key.c2, 0). One call per element: for single decisions (the keep-mask
// op); rows use philox_row_words.
FASTPROMPT_INLINE bool philox_keep(uint32_t e, uint32_t c1, const PhiloxKey& key) {
  uint32_t w[4] = {e >> 2, c1, key.c2, 0};
  philox_rounds(w[0], w[1], w[2], w[3], key.k0, key.k1);
  return philox_word_keeps(w[e & 3], key.p);
}

// The four words of Philox4x32-10 at nq counters, in element order: out[4 j + k] = word k of counter j, whose
// first two words are counter(j) (a pair) and last two (key.c2, 0). `scratch` holds 4 * nq uint32 (the words
// word by word first: that loop vectorises). Inlined into each caller's per-level copy.
template <class Counter>
FASTPROMPT_INLINE void philox_words(int64_t nq, Counter counter, const PhiloxKey& key, uint32_t* __restrict scratch,
                                    uint32_t* __restrict out) {
  uint32_t* __restrict w0 = scratch;
  uint32_t* __restrict w1 = scratch + nq;
  uint32_t* __restrict w2 = scratch + 2 * nq;
  uint32_t* __restrict w3 = scratch + 3 * nq;
  for (int64_t j = 0; j < nq; ++j) {
    const auto c = counter(j);
    uint32_t c0 = c.first, c1 = c.second, c2 = key.c2, c3 = 0;
    philox_rounds(c0, c1, c2, c3, key.k0, key.k1);
    w0[j] = c0;
    w1[j] = c1;
    w2[j] = c2;
    w3[j] = c3;
  }
  for (int64_t j = 0; j < nq; ++j) {
    out[4 * j] = w0[j];
    out[4 * j + 1] = w1[j];
    out[4 * j + 2] = w2[j];
    out[4 * j + 3] = w3[j];
  }
}

// The prefix attention's words of elements e0, e0 + 1, ..., e0 + n - 1 (mod 2^32) of stream c1: returns w with w[j]
// the word of element e0 + j (see philox_keep). `buffer` holds 8 * (n / 4 + 2) uint32.
FASTPROMPT_INLINE const uint32_t* philox_row_words(uint32_t e0, int64_t n, uint32_t c1, const PhiloxKey& key,
                                                   uint32_t* buffer) {
  const uint32_t base = e0 & ~3u;
  const int64_t nq = (static_cast<int64_t>(e0 & 3u) + n + 3) / 4;
  philox_words(
      nq, [&](int64_t j) { return std::pair<uint32_t, uint32_t>((base + 4u * static_cast<uint32_t>(j)) >> 2, c1); },
      key, buffer, buffer + 4 * nq);
  return buffer + 4 * nq + (e0 & 3u);
}

}  // namespace fastprompt
