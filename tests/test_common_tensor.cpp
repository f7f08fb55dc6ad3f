// common/tensor.h on the host: views (strides, rows, reshape, describe) and the owning Tensor
// (conversions through copy_of / from_f32, and the errors).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/tensor.h"

namespace tvllm {
namespace {

TEST(TensorView, ContiguousStridesAreRowMajorInElements) {
  float storage[24];
  TensorView v = TensorView::contiguous(storage, DType::F32, Device::CPU, {2, 3, 4});
  EXPECT_EQ(v.strides, (Shape{12, 4, 1}));
  EXPECT_EQ(v.rank(), 3);
  EXPECT_EQ(v.numel(), 24);
  EXPECT_EQ(v.nbytes(), 96u);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.ptr<float>(), storage);

  TensorView one = TensorView::contiguous(storage, DType::BF16, Device::CPU, {5});
  EXPECT_EQ(one.strides, (Shape{1}));
  EXPECT_EQ(one.nbytes(), 10u);

  TensorView scalar = TensorView::contiguous(storage, DType::F32, Device::CPU, {});
  EXPECT_EQ(scalar.rank(), 0);
  EXPECT_EQ(scalar.numel(), 1);  // the empty product
  EXPECT_TRUE(scalar.strides.empty());

  TensorView empty = TensorView::contiguous(nullptr, DType::F32, Device::CPU, {3, 0, 2});
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_EQ(empty.nbytes(), 0u);
  EXPECT_EQ(empty.strides, (Shape{0, 2, 1}));
}

TEST(TensorView, DimCountsNegativeIndicesFromTheEnd) {
  TensorView v = TensorView::contiguous(nullptr, DType::F32, Device::CPU, {7, 320});
  EXPECT_EQ(v.dim(0), 7);
  EXPECT_EQ(v.dim(1), 320);
  EXPECT_EQ(v.dim(-1), 320);
  EXPECT_EQ(v.dim(-2), 7);
  EXPECT_THROW(v.dim(2), std::out_of_range);
  EXPECT_THROW(v.dim(-3), std::out_of_range);
}

TEST(TensorView, IsContiguousLooksAtStrides) {
  TensorView v = TensorView::contiguous(nullptr, DType::F32, Device::CPU, {4, 6});
  TensorView transposed = v;
  transposed.shape = {6, 4};
  transposed.strides = {1, 6};
  EXPECT_FALSE(transposed.is_contiguous());
  TensorView strided_rows = v;
  strided_rows.strides = {12, 1};  // every other row of a wider matrix
  EXPECT_FALSE(strided_rows.is_contiguous());
  // a dimension of size 1 may have any stride: there is no second element to reach
  TensorView single = TensorView::contiguous(nullptr, DType::F32, Device::CPU, {1, 6});
  single.strides = {999, 1};
  EXPECT_TRUE(single.is_contiguous());
}

TEST(TensorView, RowsOffsetsThePointerByWholeRows) {
  std::vector<uint16_t> storage(5 * 3);
  TensorView v = TensorView::contiguous(storage.data(), DType::BF16, Device::CPU, {5, 3});
  TensorView r = v.rows(2, 2);
  EXPECT_EQ(r.ptr<uint16_t>(), storage.data() + 6);  // 2 rows of 3 elements
  EXPECT_EQ(r.shape, (Shape{2, 3}));
  EXPECT_EQ(r.strides, (Shape{3, 1}));
  EXPECT_TRUE(r.is_contiguous());
  EXPECT_EQ(v.rows(5, 0).numel(), 0);  // an empty slice at the end is fine
  EXPECT_EQ(v.rows(0, 5).data, v.data);
  EXPECT_THROW(v.rows(4, 2), std::out_of_range);
  EXPECT_THROW(v.rows(-1, 1), std::out_of_range);
  EXPECT_THROW(v.rows(0, -1), std::out_of_range);
  TensorView scalar = TensorView::contiguous(storage.data(), DType::BF16, Device::CPU, {});
  EXPECT_THROW(scalar.rows(0, 1), std::out_of_range);
}

TEST(TensorView, ColumnsKeepTheRowStride) {
  // A fused [4, 10] buffer: q = columns 0..5, k = 6..7, v = 8..9 (lesson 07's split_qkv).
  std::vector<uint16_t> storage(4 * 10);
  TensorView fused = TensorView::contiguous(storage.data(), DType::BF16, Device::CPU, {4, 10});
  TensorView k = fused.columns(6, 2);
  EXPECT_EQ(k.ptr<uint16_t>(), storage.data() + 6);
  EXPECT_EQ(k.shape, (Shape{4, 2}));
  EXPECT_EQ(k.strides, (Shape{10, 1}));  // row t of k is row t of the fused buffer
  EXPECT_FALSE(k.is_contiguous());
  EXPECT_EQ(k.dtype, DType::BF16);
  EXPECT_EQ(k.rows(3, 1).ptr<uint16_t>(), storage.data() + 36);  // composes with rows()
  EXPECT_TRUE(fused.columns(0, 10).is_contiguous());             // every column: the same view
  EXPECT_EQ(fused.columns(10, 0).numel(), 0);                    // an empty slice at the end is fine
  // A slice of a slice: columns 1..2 of columns 4..9 are columns 5..6 of the buffer.
  EXPECT_EQ(fused.columns(4, 6).columns(1, 2).ptr<uint16_t>(), storage.data() + 5);

  EXPECT_THROW(fused.columns(8, 3), InputError);   // past the last column
  EXPECT_THROW(fused.columns(-1, 2), InputError);
  EXPECT_THROW(fused.columns(0, -1), InputError);
  EXPECT_THROW(fused.reshape({40}).columns(0, 1), InputError);  // not 2-D
  TensorView transposed = fused;
  transposed.shape = {10, 4};
  transposed.strides = {1, 10};
  EXPECT_THROW(transposed.columns(0, 2), InputError);  // columns are not contiguous
  try {
    fused.columns(8, 3);
    ADD_FAILURE() << "expected InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("columns [8, 11) are outside BF16[4, 10] cpu"), std::string::npos)
        << e.what();
  }
}

TEST(TensorView, ReshapeKeepsTheMemory) {
  float storage[12];
  TensorView v = TensorView::contiguous(storage, DType::F32, Device::CPU, {3, 4});
  TensorView r = v.reshape({2, 2, 3});
  EXPECT_EQ(r.data, v.data);
  EXPECT_EQ(r.shape, (Shape{2, 2, 3}));
  EXPECT_EQ(r.strides, (Shape{6, 3, 1}));
  EXPECT_EQ(r.dtype, DType::F32);
  EXPECT_EQ(v.reshape({12}).strides, (Shape{1}));
  EXPECT_THROW(v.reshape({5, 2}), std::logic_error);  // 10 != 12 elements
  TensorView transposed = v;
  transposed.shape = {4, 3};
  transposed.strides = {1, 4};
  EXPECT_THROW(transposed.reshape({12}), std::logic_error);
}

TEST(TensorView, DescribeNamesDtypeShapeAndDevice) {
  EXPECT_EQ(TensorView::contiguous(nullptr, DType::BF16, Device::CUDA, {7, 2048}).describe(), "BF16[7, 2048] cuda");
  EXPECT_EQ(TensorView::contiguous(nullptr, DType::I32, Device::CPU, {5}).describe(), "I32[5] cpu");
  EXPECT_EQ(TensorView::contiguous(nullptr, DType::F32, Device::CPU, {}).describe(), "F32[] cpu");
  EXPECT_EQ(shape_str({}), "[]");
  EXPECT_EQ(shape_str({1, 2, 3}), "[1, 2, 3]");
  EXPECT_EQ(shape_numel({}), 1);
  EXPECT_EQ(shape_numel({4, 0}), 0);
  EXPECT_EQ(shape_numel({128256, 2048}), int64_t{262668288});
}

TEST(Tensor, EmptyOnTheHostIsAlignedAndShaped) {
  Tensor t = Tensor::empty({3, 5}, DType::F32, Device::CPU);
  EXPECT_EQ(t.shape(), (Shape{3, 5}));
  EXPECT_EQ(t.dtype(), DType::F32);
  EXPECT_EQ(t.device(), Device::CPU);
  EXPECT_EQ(t.numel(), 15);
  ASSERT_NE(t.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 64, 0u);
  EXPECT_EQ(t.view().strides, (Shape{5, 1}));
  float* p = t.view().ptr<float>();
  for (int i = 0; i < 15; ++i) p[i] = static_cast<float>(i);  // writable to the last byte
  EXPECT_EQ(p[14], 14.0f);
  Tensor none = Tensor::empty({0, 4}, DType::BF16, Device::CPU);
  EXPECT_EQ(none.numel(), 0);
}

TEST(Tensor, MovingKeepsTheMemoryAndTheView) {
  Tensor a = Tensor::from_f32({1, 2, 3}, {3}, DType::F32, Device::CPU);
  void* data = a.data();
  Tensor b = std::move(a);
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(b.view().ptr<float>()[2], 3.0f);
  Tensor c;
  c = std::move(b);
  EXPECT_EQ(c.data(), data);
  EXPECT_EQ(to_f32_vector(c), (std::vector<float>{1, 2, 3}));
}

TEST(Tensor, FromF32RoundsIntoTheTargetDtype) {
  // 1 + 2^-8 is a tie in bf16 (to 1.0); 0.1 is not representable; 65520 overflows fp16
  std::vector<float> values = {1.0f, 0x1.01p0f, 0.1f, 65520.0f, -3.0f};
  Tensor f32 = Tensor::from_f32(values, {5}, DType::F32, Device::CPU);
  EXPECT_EQ(to_f32_vector(f32), values);

  Tensor bf16 = Tensor::from_f32(values, {5}, DType::BF16, Device::CPU);
  ASSERT_EQ(bf16.dtype(), DType::BF16);
  const uint16_t* b = bf16.view().ptr<uint16_t>();
  EXPECT_EQ(b[0], 0x3f80);
  EXPECT_EQ(b[1], 0x3f80);
  EXPECT_EQ(b[2], 0x3dcd);
  EXPECT_EQ(b[3], 0x4780);  // 65536 in bf16: no overflow
  EXPECT_EQ(b[4], 0xc040);

  Tensor f16 = Tensor::from_f32(values, {5}, DType::F16, Device::CPU);
  std::vector<float> back = to_f32_vector(f16);
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], 0x1.01p0f);          // exact in fp16 (11 significant bits)
  EXPECT_EQ(back[2], 0.0999755859375f);  // the fp16 nearest 0.1
  EXPECT_TRUE(std::isinf(back[3]));
  EXPECT_EQ(back[4], -3.0f);
}

TEST(Tensor, FromF32RejectsAWrongCount) {
  EXPECT_THROW(Tensor::from_f32({1, 2, 3}, {2, 2}, DType::F32, Device::CPU), std::logic_error);
  EXPECT_THROW(Tensor::from_i32({1, 2, 3}, {4}, Device::CPU), std::logic_error);
}

TEST(Tensor, FromI32KeepsTheIntegers) {
  Tensor ids = Tensor::from_i32({128000, -1, 7}, {3}, Device::CPU);
  EXPECT_EQ(ids.dtype(), DType::I32);
  EXPECT_EQ(ids.view().ptr<int32_t>()[0], 128000);
  EXPECT_EQ(to_f32_vector(ids), (std::vector<float>{128000.0f, -1.0f, 7.0f}));
}

TEST(Tensor, CopyOfIsADeepCopy) {
  std::vector<float> values = {1, 2, 3, 4, 5, 6};
  TensorView src = TensorView::contiguous(values.data(), DType::F32, Device::CPU, {2, 3});
  Tensor copy = Tensor::copy_of(src, Device::CPU);
  values[0] = 100;  // the copy must not see this
  EXPECT_NE(copy.data(), static_cast<void*>(values.data()));
  EXPECT_EQ(copy.shape(), (Shape{2, 3}));
  EXPECT_EQ(to_f32_vector(copy), (std::vector<float>{1, 2, 3, 4, 5, 6}));
}

TEST(Tensor, CopyOfConvertsBetweenFloatingDtypes) {
  std::vector<uint16_t> bf16 = {0x3f80, 0x4049, 0xff80, 0x0001};  // 1, 3.140625, -inf, 2^-133
  TensorView src = TensorView::contiguous(bf16.data(), DType::BF16, Device::CPU, {2, 2});
  Tensor f32 = Tensor::copy_of(src, Device::CPU, DType::F32);
  ASSERT_EQ(f32.dtype(), DType::F32);
  EXPECT_EQ(f32.shape(), (Shape{2, 2}));
  const float* f = f32.view().ptr<float>();
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_EQ(f[1], 3.140625f);
  EXPECT_EQ(f[2], -INFINITY);
  EXPECT_EQ(f[3], 0x1p-133f);  // widening is exact, subnormals included
  // and back: bf16 -> fp32 -> bf16 reproduces the bytes
  Tensor again = Tensor::copy_of(f32, Device::CPU, DType::BF16);
  EXPECT_EQ(std::vector<uint16_t>(again.view().ptr<uint16_t>(), again.view().ptr<uint16_t>() + 4), bf16);
  // fp32 -> fp16
  Tensor f16 = Tensor::copy_of(f32, Device::CPU, DType::F16);
  EXPECT_EQ(f16.view().ptr<uint16_t>()[0], 0x3c00);
  EXPECT_EQ(f16.view().ptr<uint16_t>()[2], 0xfc00);
  EXPECT_EQ(f16.view().ptr<uint16_t>()[3], 0x0000);  // 2^-133 underflows fp16
}

TEST(Tensor, CopyOfIntoASmallIntegerDtypeThrows) {
  Tensor f32 = Tensor::from_f32({1, 2}, {2}, DType::F32, Device::CPU);
  EXPECT_THROW(Tensor::copy_of(f32, Device::CPU, DType::U8), std::logic_error);
}

TEST(Tensor, ToF32VectorRefusesNonContiguousViews) {
  std::vector<float> values(8, 1.0f);
  TensorView v = TensorView::contiguous(values.data(), DType::F32, Device::CPU, {2, 4});
  v.shape = {4, 2};
  v.strides = {1, 4};
  EXPECT_THROW(to_f32_vector(v), std::logic_error);
}

TEST(CopyView, CopiesBytesBetweenHostViews) {
  std::vector<float> a = {1, 2, 3, 4}, b(4, 0.0f);
  TensorView src = TensorView::contiguous(a.data(), DType::F32, Device::CPU, {4});
  TensorView dst = TensorView::contiguous(b.data(), DType::F32, Device::CPU, {2, 2});  // shapes may differ
  copy_view(dst, src);
  EXPECT_EQ(b, a);
}

TEST(CopyView, RejectsMismatches) {
  std::vector<float> a(4), b(6);
  std::vector<uint16_t> h(4);
  TensorView va = TensorView::contiguous(a.data(), DType::F32, Device::CPU, {4});
  TensorView vb = TensorView::contiguous(b.data(), DType::F32, Device::CPU, {6});
  TensorView vh = TensorView::contiguous(h.data(), DType::BF16, Device::CPU, {4});
  EXPECT_THROW(copy_view(vb, va), std::logic_error);  // element counts differ
  EXPECT_THROW(copy_view(vh, va), std::logic_error);  // dtypes differ
  TensorView strided = TensorView::contiguous(b.data(), DType::F32, Device::CPU, {2, 2});
  strided.strides = {3, 1};
  EXPECT_THROW(copy_view(strided, va), std::logic_error);
}

TEST(Tensor, CudaTensorWithoutAGpuThrowsCudaError) {
  if (cuda_available()) GTEST_SKIP() << "this machine has a GPU; the GPU suite covers device tensors";
  EXPECT_THROW(Tensor::empty({4}, DType::F32, Device::CUDA), CudaError);
  EXPECT_THROW(Tensor::from_f32({1, 2}, {2}, DType::BF16, Device::CUDA), CudaError);
}

}  // namespace
}  // namespace tvllm
