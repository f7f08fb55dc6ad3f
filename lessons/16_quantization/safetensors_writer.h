// Writing a .safetensors file: the inverse of lesson 01's parser, for `tiny-vllm quantize`.
//
//   [8 bytes: N, little-endian u64][N bytes: JSON header, padded with spaces to a multiple of 8][data]
//
// Tensors are laid out in the order given, back to back, each at the offset the header names; the
// header is padded so the data section starts 8-byte aligned (as the reference writer does), which
// keeps every F32 tensor of the file aligned for a reader that maps it.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "common/dtype.h"

namespace tvllm {

struct TensorToWrite {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // prod(shape) * dtype_size(dtype) bytes, little-endian
};

// Writes `tensors` (unique names, byte counts matching their shapes: InputError otherwise) and the
// string metadata (transformers expects {"format": "pt"}) to `path`, through a temporary file renamed
// into place, so a failure never leaves a half-written checkpoint under the final name.
void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

}  // namespace tvllm
