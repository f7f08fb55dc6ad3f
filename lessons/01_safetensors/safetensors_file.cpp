// MappedFile, SafetensorsFile and WeightStore: from validated headers to tensors on the GPU.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <set>

#include "common/buffer.h"
#include "common/errors.h"
#include "common/tensor.h"
#include "json_strict.h"
#include "safetensors.h"

namespace tvllm {

namespace fs = std::filesystem;

// ---- MappedFile -----------------------------------------------------------------------------------

MappedFile::MappedFile(const fs::path& path) : path_(path) {
  const std::string p = path.string();
  // O_NONBLOCK: opening a FIFO ("model.safetensors" could be one) would otherwise wait for a writer
  // forever; fstat below then refuses anything that is not a regular file. No effect on regular files.
  int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) throw InputError(p + ": no such file");
    throw InputError(p + ": cannot open: " + std::strerror(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw InputError(p + ": cannot stat: " + std::strerror(err));
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    throw InputError(p + ": is a directory, expected a file");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw InputError(p + ": not a regular file");
  }
  if (st.st_size == 0) {
    ::close(fd);
    throw InputError(p + ": file is empty (0 bytes)");
  }
  size_ = static_cast<uint64_t>(st.st_size);
  // MAP_PRIVATE + PROT_READ: the kernel pages the file in on first touch and may drop clean pages under
  // memory pressure; nothing is copied until someone reads it.
  void* m = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  int err = errno;
  ::close(fd);  // the mapping keeps the file alive; the descriptor is no longer needed
  if (m == MAP_FAILED) throw InputError(p + ": mmap of " + std::to_string(size_) + " bytes failed: " + std::strerror(err));
  data_ = static_cast<const uint8_t*>(m);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

// ---- SafetensorsFile ------------------------------------------------------------------------------

SafetensorsFile::SafetensorsFile(const fs::path& path) : file_(path) {
  try {
    header_ = parse_safetensors_header(file_.data(), file_.size(), file_.size());
  } catch (const InputError& e) {
    throw InputError(path.string() + ": " + e.what());
  }
  // The format does not align tensors: a BF16 tensor of odd length puts the next F32 tensor at an
  // address that is not a multiple of 4, and reading a float* there is undefined behaviour in C++.
  // Such tensors (rare: never in HF weight files) get an aligned host copy; all others are read in place.
  for (size_t i = 0; i < header_.entries.size(); ++i) by_name_.emplace(header_.entries[i].name, i);
  for (const SafetensorsEntry& e : header_.entries) {
    const uint8_t* p = tensor_bytes(e);
    size_t nbytes = e.end - e.begin;
    if (nbytes == 0 || reinterpret_cast<uintptr_t>(p) % dtype_size(e.dtype) == 0) continue;
    auto copy = std::make_shared<HostBuffer>(nbytes);
    std::memcpy(copy->data(), p, nbytes);
    aligned_copies_.emplace(e.name, std::move(copy));
  }
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const fs::path& path) {
  return std::unique_ptr<SafetensorsFile>(new SafetensorsFile(path));
}

const SafetensorsEntry* SafetensorsFile::find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &header_.entries[it->second];
}

const uint8_t* SafetensorsFile::tensor_bytes(const SafetensorsEntry& entry) const {
  return file_.data() + header_.data_offset + entry.begin;
}

TensorView SafetensorsFile::host_view(std::string_view name) const {
  const SafetensorsEntry* e = find(name);
  if (!e) throw InputError(path().string() + ": no tensor named \"" + std::string(name) + "\"");
  auto it = aligned_copies_.find(e->name);
  const void* p = it != aligned_copies_.end() ? it->second->data() : tensor_bytes(*e);
  // The mapping is read-only (PROT_READ): writing through this view would crash. TensorView has no
  // const flavour, so the constness is a promise the callers keep.
  return TensorView::contiguous(const_cast<void*>(p), e->dtype, Device::CPU, e->shape);
}

// ---- WeightStore ----------------------------------------------------------------------------------

namespace {

constexpr size_t kDeviceAlignment = 256;  // cudaMalloc's own alignment: vector loads of any width are safe

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

std::string read_text_file(const fs::path& path) {
  MappedFile f(path);
  return std::string(reinterpret_cast<const char*>(f.data()), f.size());
}

// A shard name from the index must be a plain file name beside the index: "../../etc/passwd" or
// "/dev/zero" must not be opened because a downloaded JSON file asked for it.
void check_shard_name(const std::string& shard, const fs::path& index_path) {
  bool plain = !shard.empty() && shard != "." && shard != ".." && shard.find('/') == std::string::npos &&
               shard.find('\\') == std::string::npos && shard.find('\0') == std::string::npos;
  if (!plain)
    throw InputError(index_path.string() + ": weight_map names shard \"" + shard +
                     "\": a shard must be a plain file name in the same directory");
}

}  // namespace

struct WeightStore::Impl {
  // A tensor replaced by replace_in_memory(): its own entry (begin 0, end = bytes) and bytes.
  struct InMemory {
    SafetensorsEntry entry;
    HostBuffer bytes;
  };
  struct Location {
    const SafetensorsFile* file = nullptr;
    const SafetensorsEntry* entry = nullptr;
    size_t device_offset = 0;  // where upload_to_device() put it
    std::shared_ptr<InMemory> in_memory;  // set when the tensor no longer comes from `file`

    const uint8_t* bytes() const {
      return in_memory ? static_cast<const uint8_t*>(in_memory->bytes.data()) : file->tensor_bytes(*entry);
    }
    TensorView host_view() const {
      if (!in_memory) return file->host_view(entry->name);
      return TensorView::contiguous(in_memory->bytes.data(), entry->dtype, Device::CPU, entry->shape);
    }
  };
  std::vector<std::unique_ptr<SafetensorsFile>> shards;
  std::vector<fs::path> paths;
  std::map<std::string, Location, std::less<>> tensors;  // by name (sorted)
  DeviceBuffer device;
  bool uploaded = false;
  std::optional<DType> device_dtype;  // nullopt: as stored; else floating tensors converted to it

  const Location& find(std::string_view name) const {
    auto it = tensors.find(name);
    if (it == tensors.end()) {
      std::string where = paths.size() == 1 ? paths[0].string() : "the weights";
      throw InputError(where + ": no tensor named \"" + std::string(name) + "\"");
    }
    return it->second;
  }

  void add_shard(const fs::path& path) {
    shards.push_back(SafetensorsFile::open(path));
    paths.push_back(path);
  }

  // After all shards are open: every tensor name once across all of them.
  void index_tensors() {
    for (const auto& shard : shards) {
      for (const SafetensorsEntry& e : shard->entries()) {
        auto [it, inserted] = tensors.emplace(e.name, Location{shard.get(), &e, 0, nullptr});
        if (!inserted)
          throw InputError("tensor \"" + e.name + "\" is stored twice: in " + it->second.file->path().string() +
                           " and in " + shard->path().string());
      }
    }
  }

  DType stored_or_converted(DType stored) const {
    return device_dtype && is_floating(stored) ? *device_dtype : stored;
  }
};

WeightStore::WeightStore() : impl_(std::make_unique<Impl>()) {}
WeightStore::WeightStore(WeightStore&&) noexcept = default;
WeightStore& WeightStore::operator=(WeightStore&&) noexcept = default;
WeightStore::~WeightStore() = default;

void WeightStore::open_index(Impl& impl, const fs::path& index_path) {
  const std::string where = index_path.string();
  nlohmann::json j = parse_json_strict(read_text_file(index_path), where);
  if (!j.is_object()) throw InputError(where + ": must be a JSON object, got " + json_snippet(j));
  if (!j.contains("weight_map")) throw InputError(where + ": missing \"weight_map\"");
  const nlohmann::json& map = j["weight_map"];
  if (!map.is_object() || map.empty())
    throw InputError(where + ": \"weight_map\" must be a non-empty object of tensor name -> shard file, got " +
                     json_snippet(map));

  // Open each distinct shard once, in name order (deterministic device layout).
  std::map<std::string, std::string> shard_of;  // tensor -> shard
  std::set<std::string> shard_names;
  for (const auto& [tensor, shard] : map.items()) {
    if (!shard.is_string())
      throw InputError(where + ": weight_map[\"" + tensor + "\"] must be a file name string, got " + json_snippet(shard));
    const std::string& s = shard.get_ref<const std::string&>();
    check_shard_name(s, index_path);
    shard_of[tensor] = s;
    shard_names.insert(s);
  }
  const fs::path dir = index_path.parent_path();
  for (const std::string& s : shard_names) {
    fs::path p = dir / s;
    std::error_code ec;
    if (!fs::exists(p, ec))
      throw InputError(where + ": shard \"" + s + "\" named in weight_map does not exist (" + p.string() + ")");
    impl.add_shard(p);
  }
  impl.index_tensors();  // rejects a tensor stored in two shards

  // The index and the shards must agree both ways.
  for (const auto& [tensor, s] : shard_of) {
    auto it = impl.tensors.find(tensor);
    if (it == impl.tensors.end() || it->second.file->path().filename() != s)
      throw InputError(where + ": weight_map puts tensor \"" + tensor + "\" in " + s + ", but " + s +
                       " does not contain it");
  }
  for (const auto& [name, loc] : impl.tensors) {
    if (!shard_of.count(name))
      throw InputError(loc.file->path().string() + ": tensor \"" + name + "\" is not listed in " + where +
                       "'s weight_map");
  }
}

WeightStore WeightStore::open(const fs::path& path) {
  WeightStore ws;
  Impl& impl = *ws.impl_;
  std::error_code ec;
  fs::path target = path;
  if (fs::is_directory(path, ec)) {
    if (fs::exists(path / "model.safetensors.index.json", ec)) target = path / "model.safetensors.index.json";
    else if (fs::exists(path / "model.safetensors", ec)) target = path / "model.safetensors";
    else
      throw InputError(path.string() + ": no model.safetensors or model.safetensors.index.json in this directory");
  } else if (!fs::exists(path, ec)) {
    throw InputError(path.string() + ": no such file or directory");
  }
  const std::string fname = target.filename().string();
  if (fname.size() >= 5 && fname.compare(fname.size() - 5, 5, ".json") == 0) {
    open_index(impl, target);
  } else {
    impl.add_shard(target);
    impl.index_tensors();
  }
  return ws;
}

std::vector<std::string> WeightStore::names() const {
  std::vector<std::string> out;
  out.reserve(impl_->tensors.size());
  for (const auto& [name, _] : impl_->tensors) out.push_back(name);
  return out;
}

bool WeightStore::contains(std::string_view name) const { return impl_->tensors.count(name) > 0; }

const SafetensorsEntry& WeightStore::entry(std::string_view name) const { return *impl_->find(name).entry; }

TensorView WeightStore::host(std::string_view name) const { return impl_->find(name).host_view(); }

const SafetensorsFile& WeightStore::file_of(std::string_view name) const {
  const Impl::Location& loc = impl_->find(name);
  if (loc.in_memory)
    throw InputError("tensor \"" + std::string(name) + "\" was replaced in memory at load (" +
                     std::string(dtype_name(loc.entry->dtype)) + "): its bytes are no longer the file's");
  return *loc.file;
}

void WeightStore::replace_in_memory(std::string_view name, DType dtype, std::vector<int64_t> shape, HostBuffer bytes) {
  auto it = impl_->tensors.find(name);
  if (it == impl_->tensors.end()) impl_->find(name);  // throws, naming the tensor
  const uint64_t want = static_cast<uint64_t>(shape_numel(shape)) * dtype_size(dtype);
  TVLLM_REQUIRE(bytes.bytes() == want, "WeightStore::replace_in_memory(\"" + std::string(name) + "\"): " +
                                           std::to_string(bytes.bytes()) + " bytes for " + shape_str(shape) + " " +
                                           std::string(dtype_name(dtype)) + " (" + std::to_string(want) + " expected)");
  auto held = std::make_shared<Impl::InMemory>();
  held->entry = SafetensorsEntry{std::string(name), dtype, std::move(shape), 0, want};
  held->bytes = std::move(bytes);
  it->second.entry = &held->entry;
  it->second.in_memory = std::move(held);
  impl_->device = DeviceBuffer();
  impl_->uploaded = false;
}

void WeightStore::erase(std::string_view name) {
  auto it = impl_->tensors.find(name);
  if (it == impl_->tensors.end()) impl_->find(name);  // throws, naming the tensor
  impl_->tensors.erase(it);
  impl_->device = DeviceBuffer();
  impl_->uploaded = false;
}

void WeightStore::upload_to_device() { upload(std::nullopt); }

void WeightStore::upload_to_device(DType floating_dtype) {
  TVLLM_REQUIRE(is_floating(floating_dtype),
                "upload_to_device: the target dtype must be floating, got " + std::string(dtype_name(floating_dtype)));
  upload(floating_dtype);
}

void WeightStore::upload(std::optional<DType> floating_dtype) {
  Impl& impl = *impl_;
  if (impl.uploaded && impl.device_dtype == floating_dtype) return;  // idempotent
  impl.device = DeviceBuffer();
  impl.uploaded = false;
  impl.device_dtype = floating_dtype;

  // 1. Lay out: each tensor at the next 256-byte boundary of one allocation.
  size_t total = 0;
  for (auto& [name, loc] : impl.tensors) {
    total = align_up(total, kDeviceAlignment);
    loc.device_offset = total;
    const SafetensorsEntry& e = *loc.entry;
    DType dt = impl.stored_or_converted(e.dtype);
    total += static_cast<size_t>(shape_numel(e.shape)) * dtype_size(dt);
  }
  // 2. One cudaMalloc for the whole model: one free, no fragmentation, and every weight view is
  //    base + offset.
  DeviceBuffer buf(std::max<size_t>(total, 1));
  // 3. Copy straight from the mapping (the page cache): no second host copy of the model. A pageable
  //    source makes the driver stage through its own pinned buffer; README.md discusses the trade-off.
  for (const auto& [name, loc] : impl.tensors) {
    const SafetensorsEntry& e = *loc.entry;
    const size_t stored_bytes = e.end - e.begin;
    if (stored_bytes == 0) continue;
    DType dt = impl.stored_or_converted(e.dtype);
    if (dt == e.dtype) {
      buf.copy_from_host(loc.bytes(), stored_bytes, loc.device_offset);
    } else {
      // Conversion (e.g. an F32 checkpoint for the bf16 GPU path): through fp32 on the host, one tensor
      // at a time, so the staging memory is one tensor, not the model.
      TensorView src = loc.host_view();
      const size_t n = static_cast<size_t>(src.numel());
      HostBuffer staging(n * dtype_size(dt));
      for (size_t i = 0; i < n; ++i) store_from_f32(staging.data(), dt, i, load_as_f32(src.data, e.dtype, i));
      buf.copy_from_host(staging.data(), staging.bytes(), loc.device_offset);
    }
  }
  impl.device = std::move(buf);
  impl.uploaded = true;
}

bool WeightStore::on_device() const { return impl_->uploaded; }

size_t WeightStore::device_bytes() const { return impl_->uploaded ? impl_->device.bytes() : 0; }

TensorView WeightStore::device(std::string_view name) const {
  const Impl::Location& loc = impl_->find(name);
  TVLLM_REQUIRE(impl_->uploaded, "WeightStore::device(\"" + std::string(name) +
                                     "\"): the weights are not on the device; call upload_to_device() first");
  void* p = static_cast<char*>(impl_->device.data()) + loc.device_offset;
  return TensorView::contiguous(p, impl_->stored_or_converted(loc.entry->dtype), Device::CUDA, loc.entry->shape);
}

TensorView WeightStore::get(std::string_view name, Device where) const {
  return where == Device::CUDA ? device(name) : host(name);
}

const std::vector<fs::path>& WeightStore::files() const { return impl_->paths; }

const SafetensorsFile& WeightStore::shard(size_t i) const {
  TVLLM_REQUIRE(i < impl_->shards.size(), "WeightStore::shard: index " + std::to_string(i) + " out of range");
  return *impl_->shards[i];
}

uint64_t WeightStore::total_tensor_bytes() const {
  uint64_t total = 0;
  for (const auto& [name, loc] : impl_->tensors) total += loc.entry->end - loc.entry->begin;
  return total;
}

size_t WeightStore::size() const { return impl_->tensors.size(); }

}  // namespace tvllm
