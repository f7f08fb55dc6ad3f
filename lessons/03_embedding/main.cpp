// lesson03_embedding: turn the reference prompts' token ids into rows of the embedding table and compare
// them with Hugging Face's embed_tokens output. A gather copies values, so "correct" means identical.
//
//   build/bin/lesson03_embedding [--model DIR] [--device auto|cpu|cuda] [--kernel v1|v2|v3] [--bench]
//   [--tokens N]
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "common/bench.h"
#include "common/errors.h"
#include "common/lesson.h"
#include "common/random.h"
#include "common/validate.h"
#include "embedding.h"
#include "model_dir.h"

namespace tvllm {
namespace {

// bf16 -> fp32 widening is exact and a gather does no arithmetic: our rows must equal HF's bit for bit.
constexpr Tolerance kExact{0.0, 0.0};

TensorView host_ids(std::vector<int32_t>& ids) {
  return TensorView::contiguous(ids.data(), DType::I32, Device::CPU, {static_cast<int64_t>(ids.size())});
}

// Fill with 0xFF bytes (NaN in every float format) so that an element the kernel forgets fails the check.
void poison(const TensorView& t) {
  if (t.device == Device::CUDA)
    TVLLM_CUDA_CHECK(cudaMemset(t.data, 0xFF, t.nbytes()));
  else
    std::memset(t.data, 0xFF, t.nbytes());
}

// Out-of-range ids must be refused with an InputError (never read past the table): on the CPU by the
// reference's host check, on the GPU by the kernel through the flag.
bool refuses(int32_t bad_id, const TensorView& table, Device device, EmbeddingKernel kernel, BadTokenFlag* flag) {
  std::vector<int32_t> ids{0, bad_id};
  Tensor out = Tensor::empty({2, table.dim(1)}, device == Device::CPU ? DType::F32 : table.dtype, device);
  try {
    if (device == Device::CPU) {
      embedding_cpu(out, host_ids(ids), table);
    } else {
      Tensor device_ids = Tensor::from_i32(ids, {2}, Device::CUDA);
      embedding(out, device_ids, table, *flag, kernel);
    }
  } catch (const InputError&) {
    return true;
  }
  return false;
}

void run_bench(const ModelDir& model, const TensorView& table, const LessonOptions& opt) {
  const int64_t T = opt.bench_tokens, vocab = table.dim(0), hidden = table.dim(1);
  std::vector<int32_t> ids(static_cast<size_t>(T));  // [T] random rows of the real table
  Rng rng(2024);
  for (int32_t& id : ids) id = static_cast<int32_t>(rng.below(vocab));
  Tensor device_ids = Tensor::from_i32(ids, {T}, Device::CUDA);
  Tensor out = Tensor::empty({T, hidden}, table.dtype, Device::CUDA);  // [T, hidden]
  // bytes moved by one run: each row read once, written once, plus the ids
  const double bytes = 2.0 * static_cast<double>(T) * static_cast<double>(hidden) * dtype_size(table.dtype) +
                       4.0 * static_cast<double>(T);
  BadTokenFlag flag;  // one flag for every call, as an engine would hold it
  std::vector<BenchRow> rows;
  for (EmbeddingKernel k : all_embedding_kernels()) {
    BenchResult r = bench_gpu([&] { embedding_async(out, device_ids, table, flag, k); });
    rows.push_back({"embedding " + std::string(embedding_kernel_name(k)) + " (async check)", r, bytes});
  }
  flag.check();  // every id was valid: this must not throw
  BenchResult checked = bench_gpu([&] { embedding(out, device_ids, table, flag, kDefaultEmbeddingKernel); });
  rows.push_back(
      {"embedding " + std::string(embedding_kernel_name(kDefaultEmbeddingKernel)) + " + sync check", checked,
       bytes});
  print_bench_table(std::cout,
                    "embedding gather: " + std::to_string(T) + " tokens x hidden " + std::to_string(hidden) +
                        " " + std::string(dtype_name(table.dtype)) + ", vocab " + std::to_string(vocab) +
                        ", L2 flushed",
                    rows, measure_ceilings(false));

  // The CPU reference, for scale, on at most 1024 tokens.
  const int64_t cpu_tokens = std::min<int64_t>(T, 1024);
  TensorView host_table = model.weights.host("model.embed_tokens.weight");
  Tensor host_out = Tensor::empty({cpu_tokens, hidden}, DType::F32, Device::CPU);
  TensorView cpu_ids = host_ids(ids).rows(0, cpu_tokens);
  BenchResult cpu = bench_cpu([&] { embedding_cpu(host_out, cpu_ids, host_table); });
  std::printf("cpu reference: %lld tokens in %.3f ms\n", static_cast<long long>(cpu_tokens), cpu.median_ms);
}

int run(const LessonOptions& opt) {
  ModelDir model = ModelDir::open(opt.model_dir);
  ReferenceSet refs = ReferenceSet::open(opt.model_dir);
  // The GPU path is bf16: an F32 or F16 checkpoint is converted once, here, at load (each weight rounded
  // once to nearest even); a BF16 checkpoint is uploaded as stored.
  if (opt.device == Device::CUDA) model.weights.upload_to_device(DType::BF16);
  const TensorView table = model.weights.get("model.embed_tokens.weight", opt.device);  // [vocab, hidden]
  const EmbeddingKernel chosen = parse_embedding_kernel(opt.kernel);
  std::printf("model %s: vocab %lld, hidden %lld, table %s; %d prompts; device %s%s\n",
              opt.model_dir.string().c_str(), static_cast<long long>(table.dim(0)),
              static_cast<long long>(table.dim(1)), std::string(dtype_name(table.dtype)).c_str(),
              refs.num_prompts(), std::string(device_name(opt.device)).c_str(),
              opt.device == Device::CUDA ? (", kernel " + opt.kernel).c_str() : "");

  Report report("lesson 03 embedding (" + std::string(device_name(opt.device)) + ")");
  // The GPU path's bad-token flag: allocated once here and passed to every call.
  std::optional<BadTokenFlag> flag;
  if (opt.device == Device::CUDA) flag.emplace();
  // The chosen kernel first, one row per prompt; on the GPU every other version too, one summary row each.
  std::vector<EmbeddingKernel> kernels{chosen};
  if (opt.device == Device::CUDA)
    for (EmbeddingKernel k : all_embedding_kernels())
      if (k != chosen) kernels.push_back(k);
  for (EmbeddingKernel k : kernels) {
    const std::string tag =
        opt.device == Device::CUDA ? " [" + std::string(embedding_kernel_name(k)) + "]" : "";
    int failed = 0;
    std::string first_failure;
    for (int i = 0; i < refs.num_prompts(); ++i) {
      std::vector<int32_t> ids = refs.prompt_ids(i);
      const int64_t T = static_cast<int64_t>(ids.size());
      // [T, hidden] fp32, from the checkpoint's weights. The GPU's table holds them rounded once to bf16,
      // so its rows must equal the reference rounded once to bf16: exact either way, and for a BF16
      // checkpoint that rounding changes nothing (README "What correct means").
      const Tensor expected = Tensor::copy_of(refs.prompt(i, "embed_tokens"), Device::CPU,
                                              opt.device == Device::CUDA ? table.dtype : DType::F32);
      Tensor out =
          Tensor::empty({T, table.dim(1)}, opt.device == Device::CPU ? DType::F32 : table.dtype, opt.device);
      poison(out);
      if (opt.device == Device::CUDA) {
        Tensor device_ids = Tensor::from_i32(ids, {T}, Device::CUDA);  // the prompt's ids, uploaded once
        embedding(out, device_ids, table, *flag, k);
      } else {
        embedding_cpu(out, host_ids(ids), table);
      }
      CompareResult r = compare("p" + std::to_string(i) + ".embed_tokens" + tag, out, expected, kExact);
      if (k == chosen) {
        report.add(std::move(r));
      } else if (!r.pass()) {
        if (failed++ == 0)
          first_failure =
              r.name + ": " + (r.error.empty() ? std::to_string(r.bad) + " elements differ" : r.error);
      }
    }
    if (k != chosen) report.add_check("every prompt" + tag + " (exact)", failed == 0, first_failure);
  }

  // Out-of-range ids are an input error: on the CPU by the host check, on the GPU (every kernel) through
  // the kernel's flag.
  const int32_t vocab = static_cast<int32_t>(table.dim(0));
  bool refused = true;
  for (EmbeddingKernel k : opt.device == Device::CUDA ? all_embedding_kernels() : std::vector{chosen})
    refused = refused && refuses(-1, table, opt.device, k, flag ? &*flag : nullptr) &&
              refuses(vocab, table, opt.device, k, flag ? &*flag : nullptr);
  report.add_check("ids -1 and vocab (" + std::to_string(vocab) + ") refused", refused,
                   "an out-of-range id was accepted");

  report.print(std::cout);
  if (opt.bench && opt.device == Device::CUDA) run_bench(model, table, opt);
  return report.exit_code();
}

}  // namespace
}  // namespace tvllm

int main(int argc, char** argv) {
  tvllm::LessonCli cli("lesson03_embedding", "Embedding: token ids to rows of the embedding table");
  cli.kernels({"v1", "v2", "v3"}, std::string(tvllm::embedding_kernel_name(tvllm::kDefaultEmbeddingKernel)));
  return cli.run(argc, argv, [](const tvllm::LessonOptions& opt) { return tvllm::run(opt); });
}
