// write_safetensors: header JSON, then the tensors' bytes (see safetensors_writer.h).
#include "safetensors_writer.h"

#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "common/errors.h"
#include "common/tensor.h"

namespace tvllm {

namespace fs = std::filesystem;

void write_safetensors(const fs::path& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  // nlohmann's ordered_json keeps the tensors in the order they are written, so the header reads like
  // the file.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__" || !names.insert(t.name).second)
      throw InputError(path.string() + ": cannot write tensor \"" + t.name + "\" (empty, reserved or duplicate name)");
    const uint64_t want = static_cast<uint64_t>(shape_numel(t.shape)) * dtype_size(t.dtype);
    if (t.bytes.size() != want)
      throw InputError(path.string() + ": tensor \"" + t.name + "\" " + shape_str(t.shape) + " " +
                       std::string(dtype_name(t.dtype)) + " needs " + std::to_string(want) + " bytes, got " +
                       std::to_string(t.bytes.size()));
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))}, {"shape", t.shape},
                      {"data_offsets", {offset, offset + want}}};
    offset += want;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned

  const fs::path tmp = path.string() + ".partial";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw InputError(tmp.string() + ": cannot open for writing");
    uint8_t length[8];
    const uint64_t n = text.size();
    for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(n >> (8 * i));  // little-endian
    out.write(reinterpret_cast<const char*>(length), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const TensorToWrite& t : tensors)
      out.write(reinterpret_cast<const char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
    out.flush();
    if (!out) throw InputError(tmp.string() + ": write failed (disk full?)");
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) throw InputError(path.string() + ": cannot move the written file into place: " + ec.message());
}

}  // namespace tvllm
