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
