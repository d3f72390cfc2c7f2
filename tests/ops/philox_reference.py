"""Philox4x32-10 in Python integers (Salmon et al., SC'11), written from the paper, independently of the kernels:
the ground truth of the C++ and Triton dropout decisions (csrc/philox.h). tests/ops/test_dropout_add_norm.py checks
it against Random123's known-answer vectors."""
M32 = 0xFFFFFFFF


def philox(counter, key):
    """The four output words of Philox4x32-10 at ``counter`` (four uint32) with ``key`` (two uint32)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p2 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p2 >> 32) ^ c1 ^ k0) & M32, p2 & M32, ((p0 >> 32) ^ c3 ^ k1) & M32, p0 & M32
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


def seed_words(seed: int) -> tuple[int, int, tuple[int, int]]:
    """(seed_lo, seed_hi, key) of a 64-bit seed: the key is (seed_lo, seed_lo's sign bit extended), as Triton
    widens its signed 32-bit seed argument."""
    s = seed & 0xFFFF_FFFF_FFFF_FFFF
    lo, hi = s & M32, s >> 32
    return lo, hi, (lo, M32 if lo >> 31 else 0)


def uniform(r: int) -> float:
    """Triton's ``uint_to_uniform_float`` of one 32-bit word (float32 arithmetic): the word as int32, negatives
    mirrored (-x - 1), times 2^-31."""
    import numpy as np

    r = r - (1 << 32) if r >> 31 else r
    x = r if r >= 0 else -r - 1
    return float(np.float32(x) * np.float32(4.6566127342e-10))


def keep_mask(B: int, H: int, S: int, P: int, p: float, seed: int):
    """The documented dropout decision of prefix attention, (B, H, S, P + S) bool: probability (b, h, i, j) is kept
    iff word e % 4 of Philox at counter (e // 4, b * H + h, seed_hi, 0), key (seed_lo, sign of seed_lo), read as
    ``uniform``, is >= p, where e = i * (P + S) + j (mod 2^32). One Philox call per group of four elements."""
    import torch

    n = P + S
    _, hi, key = seed_words(seed)
    keep = torch.empty(B, H, S * n, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for g in range((S * n + 3) // 4):
                words = philox((g, b * H + h, hi, 0), key)
                for w in range(min(4, S * n - 4 * g)):
                    keep[b, h, 4 * g + w] = uniform(words[w]) >= p
    return keep.view(B, H, S, n)
