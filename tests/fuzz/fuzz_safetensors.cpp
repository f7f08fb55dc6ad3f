// libFuzzer target for lesson 01's safetensors parser: the whole input is a "file" of `size` bytes.
//
// The contract under test (lessons/01_safetensors/safetensors.h): for ANY bytes, parse_safetensors_header
// either returns a header whose every tensor lies inside the file, or throws tvllm::InputError. Anything
// else - another exception, a crash, an out-of-bounds read (ASan), undefined behaviour (UBSan), a broken
// invariant (trap below) - is a finding. Build and run with tests/fuzz/run_fuzz.sh.
#include <cstddef>
#include <cstdint>

#include "common/input_error.h"
#include "safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    tvllm::SafetensorsHeader h = tvllm::parse_safetensors_header(data, size, size);
    // What the rest of the loader relies on, checked on every accepted input.
    if (h.data_offset != 8 + h.header_bytes || h.data_offset > size) __builtin_trap();
    const uint64_t data_bytes = size - h.data_offset;
    uint64_t cursor = 0;
    for (const tvllm::SafetensorsEntry& e : h.entries) {
      if (e.begin != cursor || e.end < e.begin || e.end > data_bytes) __builtin_trap();  // contiguous, in bounds
      uint64_t count = 1;
      for (int64_t d : e.shape) {
        if (d < 0) __builtin_trap();
        count *= static_cast<uint64_t>(d);  // cannot wrap: the parser checked the product
      }
      if (count * tvllm::dtype_size(e.dtype) != e.end - e.begin) __builtin_trap();
      cursor = e.end;
    }
    if (cursor != data_bytes) __builtin_trap();  // no trailing bytes
  } catch (const tvllm::InputError&) {
    // rejected with a message: the expected outcome for malformed input
  }
  return 0;
}
