// InputError: the user gave us something wrong (a malformed file, a bad argument). Exit code 2.
//
// This header has no CUDA dependency on purpose: the safetensors parser and its fuzz target, which are
// built without the CUDA toolkit, throw it. common/errors.h includes it, so most code never names it.
#pragma once

#include <stdexcept>
#include <string>

namespace tvllm {

// Bad input from the user: a file, a config field, a command-line argument. Exit code 2.
class InputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace tvllm

// Input validation: TVLLM_REQUIRE(n > 0, "hidden_size must be positive, got " + std::to_string(n));
#define TVLLM_REQUIRE(cond, message)                                               \
  do {                                                                             \
    if (!(cond)) throw ::tvllm::InputError(message);                               \
  } while (0)
