// lesson01_safetensors: load a model directory, print its tensor table, and prove we read every byte
// exactly as Hugging Face wrote it.
//
//   build/bin/lesson01_safetensors [--model DIR] [--device auto|cpu|cuda] [--bench]
//
//   1. ModelDir::open: config.json and the weights, mapped and validated (any malformed input: exit 2)
//   2. the tensor table: name, dtype, shape, bytes, offset in its file
//   3. checks against DIR/reference/manifest.json: every weight's dtype, shape and FNV-1a 64 checksum
//   4. --device cuda: upload every weight into one device allocation, copy each back, compare bytes
//   5. --bench: upload throughput (pageable mmap vs pinned staging) beside the measured ceilings
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "common/bench.h"
#include "common/buffer.h"
#include "common/errors.h"
#include "common/lesson.h"
#include "common/validate.h"
#include "json_strict.h"
#include "model_dir.h"

namespace tvllm {
namespace {

// "0x00AB..." or "ab..." -> 16 lowercase hex digits, for a forgiving comparison.
std::string normalize_hex(std::string s) {
  if (s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) s = s.substr(2);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (s.size() < 16) s.insert(0, 16 - s.size(), '0');
  return s;
}

// What the manifest check found for one weight: "" when dtype, shape, size and checksum all agree.
struct ManifestCheck {
  bool have_manifest = false;
  std::map<std::string, std::string> problems;  // weight name -> what disagrees ("" = all equal)
  std::vector<std::string> missing_weights;     // in the manifest, absent from the files
};

// Checks every weight against reference/manifest.json, written by weights/tools/make_reference.py:
//   {"weights": {name: {"file", "dtype", "shape", "nbytes", "fnv1a64": "16 hex digits"}}, ...}
// ("tensors" is accepted as the key too). The checksum is over the tensor's raw bytes as stored.
ManifestCheck check_manifest(const ModelDir& model) {
  ManifestCheck out;
  const std::filesystem::path path = model.path / "reference" / "manifest.json";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return out;
  out.have_manifest = true;
  MappedFile file(path);
  nlohmann::json manifest =
      parse_json_strict(std::string_view(reinterpret_cast<const char*>(file.data()), file.size()), path.string());
  const char* key = manifest.is_object() && manifest.contains("weights") ? "weights" : "tensors";
  if (!manifest.is_object() || !manifest.contains(key) || !manifest[key].is_object())
    throw InputError(path.string() + ": expected an object with a \"weights\" object (per-weight checksums)");
  const nlohmann::json& table = manifest[key];

  const WeightStore& w = model.weights;
  for (const std::string& name : w.names()) {
    std::string& problems = out.problems[name];
    if (!table.contains(name)) {
      problems = "not in the manifest";
      continue;
    }
    const nlohmann::json& m = table[name];
    if (!m.is_object()) {
      problems = "manifest entry is not an object";
      continue;
    }
    const SafetensorsEntry& e = w.entry(name);
    auto field = [&](const char* f) { return m.contains(f) ? json_snippet(m[f]) : std::string("(none)"); };
    if (!m.contains("dtype") || m["dtype"] != std::string(dtype_name(e.dtype)))
      problems += "dtype " + std::string(dtype_name(e.dtype)) + " != manifest " + field("dtype") + "; ";
    nlohmann::json shape = e.shape;
    if (!m.contains("shape") || m["shape"] != shape)
      problems += "shape " + shape.dump() + " != manifest " + field("shape") + "; ";
    if (m.contains("nbytes") && m["nbytes"] != nlohmann::json(e.end - e.begin))
      problems += "nbytes " + std::to_string(e.end - e.begin) + " != manifest " + field("nbytes") + "; ";
    const std::string ours = fnv1a64_hex(fnv1a64(w.file_of(name).tensor_bytes(e), e.end - e.begin));
    if (!m.contains("fnv1a64") || !m["fnv1a64"].is_string())
      problems += "manifest has no fnv1a64 string; ";
    else if (normalize_hex(m["fnv1a64"].get<std::string>()) != ours)
      problems += "fnv1a64 " + ours + " != manifest " + m["fnv1a64"].get<std::string>() + "; ";
  }
  for (const auto& [name, _] : table.items())
    if (!w.contains(name)) out.missing_weights.push_back(name);
  return out;
}

// The lesson's picture of the model: every tensor, where it lives in its file, and its checksum.
void print_table(const ModelDir& model, const ManifestCheck& mc) {
  const WeightStore& w = model.weights;
  size_t name_w = 6;
  for (const std::string& name : w.names()) name_w = std::max(name_w, name.size());
  std::printf("\n%-*s %-5s %-14s %11s %11s  %-16s %s\n", (int)name_w, "tensor", "dtype", "shape", "bytes",
              "file offset", "fnv1a64", mc.have_manifest ? "manifest" : "");
  uint64_t params = 0;
  for (const std::string& name : w.names()) {
    const SafetensorsEntry& e = w.entry(name);
    const SafetensorsFile& f = w.file_of(name);
    params += static_cast<uint64_t>(shape_numel(e.shape));
    auto it = mc.problems.find(name);
    std::string verdict = !mc.have_manifest ? "" : (it != mc.problems.end() && !it->second.empty()) ? "MISMATCH" : "ok";
    std::printf("%-*s %-5s %-14s %11llu %11llu  %s %s\n", (int)name_w, name.c_str(),
                std::string(dtype_name(e.dtype)).c_str(), shape_str(e.shape).c_str(),
                static_cast<unsigned long long>(e.end - e.begin),
                static_cast<unsigned long long>(f.header().data_offset + e.begin),
                fnv1a64_hex(fnv1a64(f.tensor_bytes(e), e.end - e.begin)).c_str(), verdict.c_str());
  }
  std::printf("%zu tensors, %llu parameters, %llu bytes in %zu file(s)\n\n", w.size(),
              static_cast<unsigned long long>(params), static_cast<unsigned long long>(w.total_tensor_bytes()),
              w.files().size());
}

void report_manifest(const ManifestCheck& mc, Report& report) {
  size_t bad = 0;
  std::string first;
  for (const auto& [name, problems] : mc.problems) {
    if (problems.empty()) continue;
    if (bad++ == 0) first = name + ": " + problems;
  }
  report.add_check("weights == manifest", bad == 0,
                   std::to_string(bad) + " of " + std::to_string(mc.problems.size()) + " differ; first: " + first);
  report.add_check("manifest weights all present", mc.missing_weights.empty(),
                   mc.missing_weights.empty() ? ""
                                              : std::to_string(mc.missing_weights.size()) +
                                                    " missing from the files, e.g. \"" + mc.missing_weights[0] + "\"");
}

// Uploads, then copies every tensor back and compares it byte for byte with the file.
void check_device_round_trip(WeightStore& w, Report& report) {
  w.upload_to_device();
  size_t misaligned = 0, different = 0;
  std::string first_bad;
  std::vector<uint8_t> back;
  for (const std::string& name : w.names()) {
    const SafetensorsEntry& e = w.entry(name);
    TensorView d = w.device(name);
    if (reinterpret_cast<uintptr_t>(d.data) % 256 != 0) ++misaligned;
    const size_t n = e.end - e.begin;
    back.assign(n, 0xFF);  // poison: a tensor that was never copied cannot match by accident
    if (n) TVLLM_CUDA_CHECK(cudaMemcpy(back.data(), d.data, n, cudaMemcpyDeviceToHost));
    if (n && std::memcmp(back.data(), w.file_of(name).tensor_bytes(e), n) != 0 && different++ == 0) first_bad = name;
  }
  report.add_check("device copies byte-identical", different == 0,
                   different == 0 ? std::to_string(w.size()) + " tensors"
                                  : std::to_string(different) + " differ, e.g. \"" + first_bad + "\"");
  report.add_check("device offsets 256-byte aligned", misaligned == 0,
                   std::to_string(w.device_bytes()) + " bytes in one allocation");
}

// Upload throughput: the ways of getting the file's bytes to the GPU, beside the measured ceilings.
void bench_upload(const ModelDir& model) {
  const WeightStore& w = model.weights;
  const double bytes = static_cast<double>(w.total_tensor_bytes());
  std::vector<BenchRow> rows;

  // a) what upload_to_device() does: per-tensor cudaMemcpy straight from the pageable mapping
  //    (including the cudaMalloc). Timed on the host: the copies are synchronous.
  {
    BenchResult r;
    std::vector<double> ms;
    for (int i = 0; i < 5; ++i) {
      WeightStore fresh = WeightStore::open(model.path);
      auto t0 = std::chrono::steady_clock::now();
      fresh.upload_to_device();
      TVLLM_CUDA_CHECK(cudaDeviceSynchronize());
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    r.median_ms = ms[ms.size() / 2];
    r.min_ms = ms.front();
    r.max_ms = ms.back();
    r.iters = static_cast<int>(ms.size());
    rows.push_back({"upload_to_device (pageable mmap)", r, bytes});
  }
  // b) one cudaMemcpy of the first file's whole data section from the mapping (pageable)
  const SafetensorsFile& f0 = w.file_of(w.names().front());
  const size_t n0 = f0.header().entries.empty() ? 0 : f0.header().entries.back().end;
  if (n0 > 0) {
    DeviceBuffer dst(n0);
    const uint8_t* src = f0.tensor_bytes(f0.header().entries.front());
    BenchOptions opt;
    opt.flush_l2 = false;
    rows.push_back({"one memcpy, pageable mmap (file 0)",
                    bench_gpu([&] { TVLLM_CUDA_CHECK(cudaMemcpy(dst.data(), src, n0, cudaMemcpyHostToDevice)); }, opt),
                    static_cast<double>(n0)});
    // c) the same bytes from pinned memory: the link's ceiling. Staging costs a host copy first.
    HostBuffer pinned(n0, HostBuffer::Kind::Pinned);
    BenchResult stage = bench_cpu([&] { std::memcpy(pinned.data(), src, n0); }, 1, 3);
    rows.push_back({"host memcpy mmap -> pinned (CPU)", stage, static_cast<double>(n0)});
    rows.push_back({"one memcpy, pinned (file 0)",
                    bench_gpu([&] { TVLLM_CUDA_CHECK(cudaMemcpy(dst.data(), pinned.data(), n0, cudaMemcpyHostToDevice)); }, opt),
                    static_cast<double>(n0)});
  }
  Ceilings ceilings = measure_ceilings(false);
  print_bench_table(std::cout, "weight upload (host -> device); % is of the device's own copy bandwidth", rows, ceilings);
  std::printf("(the host->device link, not device memory, bounds these: compare with the pinned row)\n");
}

int run(const LessonOptions& opt) {
  ModelDir model = ModelDir::open(opt.model_dir);  // every validation rule of the chapter runs here
  const ModelConfig& c = model.config;
  std::printf("model %s: %s, hidden %lld, %lld layers, %lld heads (%lld KV), head_dim %lld, vocab %lld\n",
              model.path.string().c_str(), c.model_type.c_str(), (long long)c.hidden_size,
              (long long)c.num_hidden_layers, (long long)c.num_attention_heads, (long long)c.num_key_value_heads,
              (long long)c.head_dim, (long long)c.vocab_size);
  ManifestCheck mc = check_manifest(model);
  print_table(model, mc);
  if (!mc.have_manifest)
    std::printf("notice: %s/reference/manifest.json is missing: checksums not compared "
                "(make it with weights/tools/make_reference.py)\n", model.path.string().c_str());

  Report report("lesson 01: safetensors -> " + std::string(device_name(opt.device)));
  report.add_check("weights match config.json", true);  // ModelDir::open threw otherwise
  if (mc.have_manifest) report_manifest(mc, report);
  if (opt.device == Device::CUDA) check_device_round_trip(model.weights, report);
  report.print(std::cout);
  if (opt.bench && opt.device == Device::CUDA) bench_upload(model);
  return report.exit_code();
}

}  // namespace
}  // namespace tvllm

int main(int argc, char** argv) {
  tvllm::LessonCli cli("lesson01_safetensors", "safetensors: parse and validate a model, map it, upload it to the GPU");
  return cli.run(argc, argv, tvllm::run);
}
