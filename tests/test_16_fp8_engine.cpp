// Lesson 16, CPU: the pieces of FP8 weights resident in the engine that need no GPU. Lesson 01 leaves the codes
// and scales when asked (Fp8Load::Resident), lesson 08 accepts them and refuses to bind them on the CPU, the CPU
// dequantizer equals lesson 01's dequantize-at-load bit for bit, and the --fp8-weights choice and its refusals.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/errors.h"
#include "fp8_resident.h"
#include "model_dir.h"
#include "model_weights.h"
#include "quantize.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

struct Quantized {
  testing::TempDir tmp;
  Quantized() { quantize_checkpoint(testing::tiny_model_dir(), tmp / "fp8", QuantizeOptions{}); }
  std::filesystem::path dir() const { return tmp / "fp8"; }
};
const Quantized& quantized() {
  static const Quantized q;
  return q;
}

TEST(Fp8Resident16, OpeningResidentKeepsTheCodesAndScales) {
  const ModelDir r = ModelDir::open(quantized().dir(), Fp8Load::Resident);
  const ModelDir d = ModelDir::open(quantized().dir());
  EXPECT_TRUE(r.fp8_resident);
  EXPECT_FALSE(d.fp8_resident);
  const std::string q = "model.layers.0.self_attn.q_proj.weight";
  EXPECT_EQ(r.weights.entry(q).dtype, DType::F8_E4M3);
  EXPECT_TRUE(r.weights.contains(q + "_scale"));
  EXPECT_EQ(d.weights.entry(q).dtype, DType::BF16);
  EXPECT_FALSE(d.weights.contains(q + "_scale"));
  EXPECT_NO_THROW(check_llama_weights(r.config, r.weights));  // codes + scales are a model lesson 08 computes
  // A bf16 checkpoint opened "resident" is simply the bf16 checkpoint.
  EXPECT_FALSE(ModelDir::open(testing::tiny_model_dir(), Fp8Load::Resident).fp8_resident);
}

TEST(Fp8Resident16, ResidentWeightsAreRefusedOnTheCpu) {
  const ModelDir r = ModelDir::open(quantized().dir(), Fp8Load::Resident);
  try {
    ModelWeights::bind(r, Device::CPU);
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("only on CUDA"), std::string::npos) << e.what();
  }
}

TEST(Fp8Resident16, TheCpuDequantizerEqualsDequantizeAtLoadBitForBit) {
  const ModelDir r = ModelDir::open(quantized().dir(), Fp8Load::Resident);
  const ModelDir d = ModelDir::open(quantized().dir());
  for (const char* name : {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"}) {
    const TensorView codes = r.weights.host(name);
    const TensorView stored = r.weights.host(std::string(name) + "_scale");  // BF16 [rows, 1]
    Tensor scale = Tensor::copy_of(stored, Device::CPU, DType::F32);  // widening BF16 is exact
    const TensorView want = d.weights.host(name);
    Tensor got = Tensor::empty(codes.shape, DType::BF16, Device::CPU);
    dequantize_fp8_weight(got, codes, scale.view().reshape({codes.shape[0]}));
    EXPECT_EQ(0, std::memcmp(got.data(), want.data, want.nbytes())) << name;
  }
}

TEST(Fp8Resident16, TheDequantizerChecksItsOperands) {
  std::vector<uint8_t> codes(4 * 16, 0x38);
  Tensor q = Tensor::empty({4, 16}, DType::F8_E4M3, Device::CPU);
  std::memcpy(q.data(), codes.data(), codes.size());
  Tensor dst = Tensor::empty({4, 16}, DType::BF16, Device::CPU);
  Tensor s4 = Tensor::from_f32({1, 2, 3, 4}, {4}, DType::F32, Device::CPU);
  dequantize_fp8_weight(dst, q, s4);
  const std::vector<float> v = to_f32_vector(dst);
  EXPECT_EQ(v[0], 1.0f);
  EXPECT_EQ(v[16 * 3 + 5], 4.0f);  // row 3 times its scale
  Tensor s3 = Tensor::from_f32({1, 2, 3}, {3}, DType::F32, Device::CPU);
  EXPECT_THROW(dequantize_fp8_weight(dst, q, s3), InputError);
  Tensor bad_dst = Tensor::empty({4, 16}, DType::F32, Device::CPU);
  EXPECT_THROW(dequantize_fp8_weight(bad_dst, q, s4), InputError);
  EXPECT_THROW(dequantize_fp8_weight(dst, dst, s4), InputError);  // bf16 "codes"
}

TEST(Fp8Resident16, TheChoiceAndItsRefusals) {
  const ModelConfig fp8 = ModelDir::open(quantized().dir()).config;
  const ModelConfig bf16 = ModelDir::open(testing::tiny_model_dir()).config;
  // auto: resident exactly where the fused decode runs on CUDA.
  EXPECT_EQ(fp8_weights_mode("auto", fp8, true, true), Fp8Load::Resident);
  EXPECT_EQ(fp8_weights_mode("auto", fp8, false, true), Fp8Load::Dequantize);
  EXPECT_EQ(fp8_weights_mode("auto", fp8, true, false), Fp8Load::Dequantize);
  EXPECT_EQ(fp8_weights_mode("auto", bf16, true, true), Fp8Load::Dequantize);
  EXPECT_EQ(fp8_weights_mode("dequantize", fp8, true, true), Fp8Load::Dequantize);
  EXPECT_EQ(fp8_weights_mode("resident", fp8, true, true), Fp8Load::Resident);
  // resident: every condition required.
  EXPECT_THROW(fp8_weights_mode("resident", fp8, false, true), InputError);  // the CPU
  EXPECT_THROW(fp8_weights_mode("resident", fp8, true, false), InputError);  // --no-fused
  EXPECT_THROW(fp8_weights_mode("resident", bf16, true, true), InputError);  // not an FP8 checkpoint
  EXPECT_THROW(fp8_weights_mode("sometimes", fp8, true, true), InputError);
  EXPECT_EQ(describe_fp8_weights(bf16, Fp8Load::Resident), "");
  EXPECT_NE(describe_fp8_weights(fp8, Fp8Load::Resident).find("resident"), std::string::npos);
  EXPECT_NE(describe_fp8_weights(fp8, Fp8Load::Dequantize).find("dequantized"), std::string::npos);
}

TEST(Fp8Resident16, WithoutADequantizerAnFp8WeightAtAGemmIsAClearError) {
  // weight_for_gemm (lesson 08) before lesson 16 installs its kernel: a message, not a crash. (Install order is
  // process-wide; this test's process installs nothing before it runs.)
  if (fp8_weight_dequantizer_installed()) GTEST_SKIP() << "a dequantizer is installed in this process";
  Tensor q = Tensor::empty({2, 16}, DType::F8_E4M3, Device::CPU);
  Tensor s = Tensor::from_f32({1, 1}, {2}, DType::F32, Device::CPU);
  Tensor scratch = Tensor::empty({32}, DType::BF16, Device::CPU);
  EXPECT_THROW(weight_for_gemm(q, s, scratch, nullptr), InputError);
  install_fp8_resident_weights();
  EXPECT_TRUE(fp8_weight_dequantizer_installed());
  std::memset(q.data(), 0x38, 32);
  const TensorView w = weight_for_gemm(q, s, scratch, nullptr);
  EXPECT_EQ(w.dtype, DType::BF16);
  EXPECT_EQ(to_f32_vector(w)[31], 1.0f);
}

}  // namespace
}  // namespace tvllm
