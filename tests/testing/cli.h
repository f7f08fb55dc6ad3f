// What the suites that run the built programs share: the tiny-vllm binary, shell quoting, the bundled model as
// an argument. Header-only.
#pragma once

#include <string>

#include "testing/testing.h"

namespace tvllm::testing {

inline std::string tiny_vllm_bin() { return (bin_dir() / "tiny-vllm").string(); }

// `s` single-quoted for sh: a quote inside becomes '\'' (close, escaped quote, reopen).
inline std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

inline std::string tiny_model_arg() { return shell_quote(tiny_model_dir().string()); }

inline bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace tvllm::testing
