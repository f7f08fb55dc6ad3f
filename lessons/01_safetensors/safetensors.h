// Lesson 01: the safetensors format, read and validated from the bytes up.
//
//   [8 bytes: N, little-endian u64][N bytes: JSON header][data section: raw tensor bytes]
//
// The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets into
// the data section), plus an optional "__metadata__" object of string -> string.
//
// Three layers, each usable alone:
//   parse_safetensors_header()  pure parsing and validation of bytes in memory (no files, no CUDA):
//                               what the fuzz target exercises
//   SafetensorsFile             one file, memory-mapped (no second host copy), validated
//   WeightStore                 a model's weights: one file or a sharded set (model.safetensors.index.json),
//                               uploaded into ONE device allocation, typed views by name
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/device.h"
#include "common/dtype.h"

namespace tvllm {

struct TensorView;  // common/tensor.h
class HostBuffer;   // common/buffer.h

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the data section, [begin, end)
  uint64_t end = 0;
};

struct SafetensorsHeader {
  uint64_t header_bytes = 0;                     // N
  uint64_t data_offset = 0;                      // 8 + N: where the data section starts in the file
  std::vector<SafetensorsEntry> entries;         // sorted by begin offset
  std::map<std::string, std::string> metadata;   // "__metadata__"
};

// Parses and validates the first bytes of a safetensors file whose total size is file_size.
// `bytes` must hold at least the 8-byte length and the header (it may hold the whole file).
// Throws InputError naming the problem for every malformed input; never reads out of bounds.
SafetensorsHeader parse_safetensors_header(const uint8_t* bytes, size_t size, uint64_t file_size);

// FNV-1a, 64-bit: a simple, fast checksum of a tensor's bytes. reference/manifest.json stores it per weight
// ("fnv1a64": 16 hex digits) so a loader can prove it read exactly the bytes Hugging Face wrote.
// Pass the previous result as `hash` to continue over several pieces.
inline constexpr uint64_t kFnv1a64Offset = 0xcbf29ce484222325ull;
uint64_t fnv1a64(const void* data, size_t size, uint64_t hash = kFnv1a64Offset);
std::string fnv1a64_hex(uint64_t hash);  // "0123456789abcdef": 16 lowercase hex digits

// A read-only memory mapping of a whole file (RAII: unmapped on destruction).
class MappedFile {
 public:
  explicit MappedFile(const std::filesystem::path& path);  // throws InputError if it cannot be opened
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

class SafetensorsFile {
 public:
  // Maps and validates the file. Throws InputError ("FILE: problem") on any malformed input.
  static std::unique_ptr<SafetensorsFile> open(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return file_.path(); }
  const SafetensorsHeader& header() const { return header_; }
  const std::vector<SafetensorsEntry>& entries() const { return header_.entries; }
  const SafetensorsEntry* find(std::string_view name) const;  // nullptr if absent
  // A view into the mapped bytes (device CPU). Throws InputError if the name is absent.
  TensorView host_view(std::string_view name) const;
  // The raw bytes of one tensor inside the mapping.
  const uint8_t* tensor_bytes(const SafetensorsEntry& entry) const;

 private:
  explicit SafetensorsFile(const std::filesystem::path& path);
  MappedFile file_;
  SafetensorsHeader header_;
  // Aligned host copies of the (rare) tensors whose bytes in the file are not aligned to their element
  // size; every other tensor is read in place from the mapping.
  std::map<std::string, std::shared_ptr<HostBuffer>, std::less<>> aligned_copies_;
  std::map<std::string, size_t, std::less<>> by_name_;  // name -> index into header_.entries
};

// All the weights of a model: model.safetensors, or the shards named by model.safetensors.index.json.
class WeightStore {
 public:
  // path: a .safetensors file, a model.safetensors.index.json, or a directory holding either.
  static WeightStore open(const std::filesystem::path& path);
  WeightStore(WeightStore&&) noexcept;
  WeightStore& operator=(WeightStore&&) noexcept;
  ~WeightStore();

  std::vector<std::string> names() const;  // sorted
  bool contains(std::string_view name) const;
  const SafetensorsEntry& entry(std::string_view name) const;  // throws InputError if absent
  // A view into the mapped file (device CPU), as stored (BF16, F16 or F32).
  TensorView host(std::string_view name) const;
  // The file that holds a tensor (for its raw bytes: file_of(name).tensor_bytes(entry(name))).
  const SafetensorsFile& file_of(std::string_view name) const;
  size_t size() const;  // number of tensors

  // Copies every tensor into one cudaMalloc, each at a 256-byte aligned offset, as stored. Idempotent.
  void upload_to_device();
  // The same, converting every floating tensor to `floating_dtype` on the way (e.g. an F32 or F16
  // checkpoint for the bf16 GPU path); integer tensors stay as stored. device() views then carry that
  // dtype. Calling it again with another dtype re-uploads.
  void upload_to_device(DType floating_dtype);
  bool on_device() const;
  size_t device_bytes() const;  // the size of the one allocation (with alignment padding)
  // A view into the device allocation (upload_to_device() first).
  TensorView device(std::string_view name) const;
  TensorView get(std::string_view name, Device where) const;  // host() or device()

  // Replaces a tensor by one held in host memory: `bytes` (taken over) holds prod(shape) elements of
  // `dtype`. From then on host() views that memory, upload_to_device() copies it, and file_of() refuses
  // the name (the tensor is no longer the file's bytes). Used by ModelDir::open to dequantize an FP8
  // checkpoint's weights to bf16 at load (lesson 16). Drops any device copy: upload again.
  void replace_in_memory(std::string_view name, DType dtype, std::vector<int64_t> shape, HostBuffer bytes);
  // Forgets a tensor (a consumed weight_scale, say). Drops any device copy.
  void erase(std::string_view name);

  const std::vector<std::filesystem::path>& files() const;
  const SafetensorsFile& shard(size_t i) const;  // the i-th of files(), opened
  uint64_t total_tensor_bytes() const;  // as held now: replaced tensors count their in-memory bytes

 private:
  WeightStore();
  void upload(std::optional<DType> floating_dtype);
  struct Impl;
  static void open_index(Impl& impl, const std::filesystem::path& index_path);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tvllm
