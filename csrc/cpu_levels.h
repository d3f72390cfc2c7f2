// The x86-64 levels the C++ CPU kernels are compiled for and the one that runs, shared by every kernel file:
// x86-64-v4 (AVX-512), x86-64-v3 (AVX2 + FMA) and the baseline the rest of a file is compiled for. A kernel file
// includes its inner loops once per level, each copy inside its own namespace and under
// `#pragma GCC target(...)`, and keeps a table of the copies in the order of kIsaLevels. Other compilers and
// architectures get the baseline only. FASTPROMPT_CPU_ISA picks a level; unset or "auto", the best one the CPU
// supports runs. It is read on every call, so tests run each level on one machine (what a CPU without AVX-512
// runs is then tested on one with it).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(FASTPROMPT_NO_ISA_LEVELS)
#define FASTPROMPT_ISA_LEVELS 1
#endif

namespace fastprompt {

// Best first; a kernel's table of compiled copies follows this order.
inline constexpr const char* kIsaLevels[] = {
#ifdef FASTPROMPT_ISA_LEVELS
    "x86-64-v4",
    "x86-64-v3",
#endif
    "baseline",
};
inline constexpr std::size_t kIsaLevelCount = sizeof(kIsaLevels) / sizeof(kIsaLevels[0]);

inline bool isa_supported(const char* name) {
#ifdef FASTPROMPT_ISA_LEVELS
  __builtin_cpu_init();
  if (std::strcmp(name, "x86-64-v4") == 0) return __builtin_cpu_supports("x86-64-v4");
  if (std::strcmp(name, "x86-64-v3") == 0) return __builtin_cpu_supports("x86-64-v3");
#endif
  return std::strcmp(name, "baseline") == 0;
}

// The levels this build has and this CPU supports, best first.
inline std::vector<std::string> isa_supported_levels() {
  std::vector<std::string> names;
  for (const char* name : kIsaLevels)
    if (isa_supported(name)) names.emplace_back(name);
  return names;
}

// The index in kIsaLevels of the level to run: FASTPROMPT_CPU_ISA's (which must be compiled in and supported by
// this CPU), or the best supported one when it is unset, empty or "auto".
inline std::size_t isa_level_index() {
  const char* env = std::getenv("FASTPROMPT_CPU_ISA");
  const std::string requested = env == nullptr ? std::string() : std::string(env);
  if (requested.empty() || requested == "auto") {
    for (std::size_t i = 0; i < kIsaLevelCount; ++i)
      if (isa_supported(kIsaLevels[i])) return i;
  }
  std::string known;
  for (std::size_t i = 0; i < kIsaLevelCount; ++i) {
    if (requested == kIsaLevels[i]) {
      TORCH_CHECK(isa_supported(kIsaLevels[i]), "FASTPROMPT_CPU_ISA=", requested,
                  ": this CPU does not support that level; unset it or choose one of ",
                  c10::Join(", ", isa_supported_levels()));
      return i;
    }
    known += known.empty() ? kIsaLevels[i] : std::string(", ") + kIsaLevels[i];
  }
  TORCH_CHECK(false, "FASTPROMPT_CPU_ISA=", requested, " is not a level of this build (auto, ", known, ")");
}

// Tests (FASTPROMPT_CPU_POISON=1): the kernels fill their outputs with NaN before writing them, so an element
// a kernel forgets shows up.
inline bool poison_outputs() {
  const char* env = std::getenv("FASTPROMPT_CPU_POISON");
  return env != nullptr && env[0] == '1';
}

}  // namespace fastprompt
