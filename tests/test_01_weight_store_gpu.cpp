// Lesson 01 on the GPU: upload_to_device() puts every tensor, byte for byte, at a 256-byte aligned offset of
// one allocation; the views point into it; conversion on upload gives the rounded values.
#include <gtest/gtest.h>

#include <cstring>
#include <set>

#include "common/errors.h"
#include "common/tensor.h"
#include "model_dir.h"
#include "testing/safetensors_builder.h"
#include "testing/testing.h"

namespace tvllm {
namespace {

namespace fs = std::filesystem;
using testing::Bytes;
using testing::SafetensorsBuilder;

// Copies a device view back, after poisoning the host buffer so unwritten bytes cannot pass by accident.
Bytes read_back(const TensorView& v, size_t nbytes) {
  Bytes out(nbytes, 0xFF);
  if (nbytes) TVLLM_CUDA_CHECK(cudaMemcpy(out.data(), v.data, nbytes, cudaMemcpyDeviceToHost));
  return out;
}

// Odd sizes on purpose: 3 bytes, 5 halves, a zero-size tensor, a scalar; every dtype the loader accepts.
Bytes mixed_file() {
  return SafetensorsBuilder()
      .add("u8", "U8", {3}, {1, 2, 3})
      .add("bf16", "BF16", {5}, testing::u16_bytes({0x3F80, 0xC000, 0x3F00, 0x7F80, 0x0001}))
      .add("empty", "F32", {0, 4}, {})
      .add("f16", "F16", {2, 3}, testing::u16_bytes({0x3C00, 0x4248, 0xB800, 0x7BFF, 0x0400, 0x8001}))
      .add("scalar", "F32", {}, testing::f32_bytes({42.5f}))
      .add("f32", "F32", {257}, testing::f32_bytes(std::vector<float>(257, -3.75f)))
      .add("ids", "I32", {3}, testing::i32_bytes({0, -1, 128255}))
      .build();
}

TEST(WeightStoreGpu, UploadIsByteExactAndAligned) {
  TVLLM_REQUIRE_GPU();
  testing::TempDir dir;
  testing::write_file(dir / "model.safetensors", mixed_file());
  WeightStore w = WeightStore::open(dir.path());
  w.upload_to_device();
  ASSERT_TRUE(w.on_device());
  EXPECT_GE(w.device_bytes(), w.total_tensor_bytes());

  std::set<uintptr_t> starts;
  for (const std::string& name : w.names()) {
    const SafetensorsEntry& e = w.entry(name);
    TensorView d = w.device(name);
    EXPECT_EQ(d.device, Device::CUDA) << name;
    EXPECT_EQ(d.dtype, e.dtype) << name;
    EXPECT_EQ(d.shape, e.shape) << name;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(d.data) % 256, 0u) << name;
    const size_t n = e.end - e.begin;
    Bytes back = read_back(d, n);
    EXPECT_EQ(std::memcmp(back.data(), w.file_of(name).tensor_bytes(e), n), 0) << name;
    if (n) {
      EXPECT_TRUE(starts.insert(reinterpret_cast<uintptr_t>(d.data)).second) << name << " shares an address";
    }
    EXPECT_EQ(w.get(name, Device::CUDA).data, d.data);
  }
  // all views inside the one allocation: the span from the first to the last byte fits device_bytes()
  uintptr_t lo = *starts.begin();
  uintptr_t hi = 0;
  for (const std::string& name : w.names()) {
    uintptr_t p = reinterpret_cast<uintptr_t>(w.device(name).data) + (w.entry(name).end - w.entry(name).begin);
    hi = std::max(hi, p);
  }
  EXPECT_LE(hi - lo, w.device_bytes());
}

TEST(WeightStoreGpu, UploadIsIdempotent) {
  TVLLM_REQUIRE_GPU();
  testing::TempDir dir;
  testing::write_file(dir / "model.safetensors", mixed_file());
  WeightStore w = WeightStore::open(dir.path());
  w.upload_to_device();
  void* first = w.device("f16").data;
  w.upload_to_device();  // no second allocation, same addresses
  EXPECT_EQ(w.device("f16").data, first);
}

TEST(WeightStoreGpu, UploadConvertsFloatingTensorsOnRequest) {
  TVLLM_REQUIRE_GPU();
  testing::TempDir dir;
  testing::write_file(dir / "model.safetensors", mixed_file());
  WeightStore w = WeightStore::open(dir.path());
  w.upload_to_device(DType::BF16);
  // F16 -> BF16 through fp32, rounding to nearest even; integers stay as stored.
  TensorView f16 = w.device("f16");
  EXPECT_EQ(f16.dtype, DType::BF16);
  std::vector<float> got = to_f32_vector(f16);
  std::vector<float> src = to_f32_vector(w.host("f16"));
  ASSERT_EQ(got.size(), src.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], bf16_to_f32(f32_to_bf16(src[i]))) << i;
  EXPECT_EQ(w.device("ids").dtype, DType::I32);
  EXPECT_EQ(to_f32_vector(w.device("f32"))[256], -3.75f);  // exact in bf16
  EXPECT_EQ(reinterpret_cast<uintptr_t>(w.device("scalar").data) % 256, 0u);
  // and back to the stored dtypes: a fresh upload, byte-exact again
  w.upload_to_device();
  EXPECT_EQ(w.device("f16").dtype, DType::F16);
  const SafetensorsEntry& e = w.entry("f16");
  Bytes back = read_back(w.device("f16"), e.end - e.begin);
  EXPECT_EQ(std::memcmp(back.data(), w.file_of("f16").tensor_bytes(e), back.size()), 0);
}

TEST(WeightStoreGpu, ShardedUploadIsByteExact) {
  TVLLM_REQUIRE_GPU();
  testing::TempDir dir;
  testing::write_file(dir / "s1.safetensors", SafetensorsBuilder().add("a", "BF16", {3}, testing::u16_bytes({1, 2, 3})).build());
  testing::write_file(dir / "s2.safetensors", SafetensorsBuilder().add("b", "F32", {1}, testing::f32_bytes({7.f})).build());
  testing::write_file(dir / "model.safetensors.index.json",
                      std::string(R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})"));
  WeightStore w = WeightStore::open(dir.path());
  w.upload_to_device();
  EXPECT_EQ(read_back(w.device("a"), 6), (Bytes{1, 0, 2, 0, 3, 0}));
  EXPECT_EQ(to_f32_vector(w.device("b")), (std::vector<float>{7.f}));
}

TEST(WeightStoreGpu, EveryDtypeOfASyntheticLlamaRoundTrips) {
  TVLLM_REQUIRE_GPU();
  for (const char* dt : {"BF16", "F16", "F32"}) {
    testing::TempDir dir;
    testing::SyntheticLlama spec;
    spec.dtype = dt;
    spec.hidden = 40;  // rows of 80 bytes in bf16: offsets that need padding to 256
    spec.intermediate = 72;
    spec.write(dir.path());
    ModelDir m = ModelDir::open(dir.path());
    m.weights.upload_to_device();
    for (const std::string& name : m.weights.names()) {
      const SafetensorsEntry& e = m.weights.entry(name);
      Bytes back = read_back(m.weights.device(name), e.end - e.begin);
      EXPECT_EQ(std::memcmp(back.data(), m.weights.file_of(name).tensor_bytes(e), back.size()), 0) << dt << " " << name;
    }
  }
}

TEST(WeightStoreGpu, BundledModelRoundTrips) {
  TVLLM_REQUIRE_GPU();
  const fs::path dir = testing::tiny_model_dir();
  if (!fs::exists(dir / "config.json")) GTEST_SKIP() << dir << " is not there";
  ModelDir m = ModelDir::open(dir);
  m.weights.upload_to_device();
  for (const std::string& name : m.weights.names()) {
    const SafetensorsEntry& e = m.weights.entry(name);
    Bytes back = read_back(m.weights.device(name), e.end - e.begin);
    EXPECT_EQ(std::memcmp(back.data(), m.weights.file_of(name).tensor_bytes(e), back.size()), 0) << name;
  }
}

}  // namespace
}  // namespace tvllm
