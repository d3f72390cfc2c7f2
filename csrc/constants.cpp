// Exposes the constants of constants.h to Python, so that tests can check the Python side uses the same values.
#include <torch/library.h>

#include "constants.h"

namespace fastprompt {
namespace {

double cosine_eps() { return kCosEps; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(fastprompt, m) { m.def("cosine_eps() -> float", &cosine_eps); }

}  // namespace fastprompt
