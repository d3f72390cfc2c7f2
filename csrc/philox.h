// The counter-based random numbers of the prefix-attention dropout, bit for bit those of the Triton kernels
// (kernels/prefix_attention.py: _keep = tl.philox + tl.uint_to_uniform_float), so a seed drops the same
// attention probabilities on the CPU kernel as on a GPU.
//
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) with Triton's
// constants and round order; only the first of its four output words is used. The keep decision of
// probability (b, h, i, j) (example b, head h, query row i, key column j of the virtual [prefix ; tokens]
// concatenation of P + S columns) is
//     counter = (i * (P + S) + j mod 2^32, b * H + h, seed_hi, 0),  key = (seed_lo, sign(seed_lo) ? ~0 : 0)
//     keep    = float(r >= 0 ? r : -r - 1) * 4.6566127342e-10f >= dropout_p      (r: word 0 as int32)
// where seed_lo / seed_hi are the low and high 32-bit words of the 64-bit seed: Triton receives seed_lo as a
// signed 32-bit argument and widens it to 64 bits with sign extension before splitting it into its key
// words. All of it is integer arithmetic plus one rounded float product and a comparison, so it is exact
// and the same on every machine.
#pragma once

#include <cstdint>

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

// Word 0 of Philox4x32-10 at counter (c0, c1, key.c2, 0).
FASTPROMPT_INLINE uint32_t philox_word0(uint32_t c0, uint32_t c1, const PhiloxKey& key) {
  uint32_t c2 = key.c2, c3 = 0;
  philox_rounds(c0, c1, c2, c3, key.k0, key.k1);
  return c0;
}

// Whether the probability at counter (c0, c1) is kept (Triton's uint_to_uniform_float(r) >= p).
FASTPROMPT_INLINE bool philox_keep(uint32_t c0, uint32_t c1, const PhiloxKey& key) {
  const int32_t r = static_cast<int32_t>(philox_word0(c0, c1, key));
  const int32_t x = r ^ (r >> 31);  // r >= 0 ? r : -r - 1, without the overflow of -INT32_MIN
  return static_cast<float>(x) * 4.6566127342e-10f >= key.p;
}

}  // namespace fastprompt
