// Constants the C++ kernels share with the Python side of fastprompt.
#pragma once

namespace fastprompt {

// Norm floor of the cosine similarity: a row z is normalised as z / max(||z||, kCosEps), as F.normalize does.
// The reference and fastprompt/ops/contrastive.py (which computes the inverse norms every contrastive-loss kernel
// takes, C++ and Triton) use fastprompt.constants.COSINE_EPS; the extension exposes this
// value as torch.ops.fastprompt.cosine_eps() and tests/ops/test_kernels_common.py checks that they are equal.
inline constexpr double kCosEps = 1e-8;

}  // namespace fastprompt
