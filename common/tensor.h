// A tensor view: a pointer plus what it points to (dtype, shape, strides, device). It owns nothing.
// Tensor owns its memory (a DeviceBuffer or HostBuffer) and hands out views.
//
// Shapes are row-major: shape {T, H} means T rows of H elements, element (t, h) at t*H + h.
// Strides are in elements, not bytes, as in PyTorch.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "common/buffer.h"
#include "common/device.h"
#include "common/dtype.h"

namespace tvllm {

using Shape = std::vector<int64_t>;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::F32;
  Device device = Device::CPU;
  Shape shape;
  Shape strides;  // in elements

  // A view over contiguous row-major memory.
  static TensorView contiguous(void* data, DType dtype, Device device, Shape shape);

  int rank() const { return static_cast<int>(shape.size()); }
  int64_t dim(int i) const;  // negative i counts from the end: dim(-1) is the last dimension
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  bool is_contiguous() const;
  template <class T> T* ptr() const { return static_cast<T*>(data); }

  // Rows [begin, begin + count) of the first dimension; still contiguous if this view is.
  TensorView rows(int64_t begin, int64_t count) const;
  // Columns [begin, begin + count) of a 2-D view whose columns are contiguous: the same rows, the same
  // row stride (strides[0]), so no longer contiguous unless it takes every column. How q, k and v are
  // views into one fused QKV buffer (lesson 07). Throws InputError for another rank, a column stride
  // other than 1, or a range outside the view.
  TensorView columns(int64_t begin, int64_t count) const;
  // Same memory, another shape with the same element count (contiguous views only).
  TensorView reshape(Shape new_shape) const;
  // "BF16[7, 2048] cuda"
  std::string describe() const;
};

std::string shape_str(const Shape& shape);
int64_t shape_numel(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;
  // Uninitialised memory of the given shape on the given device.
  static Tensor empty(Shape shape, DType dtype, Device device);
  // A contiguous copy of any view, on any device, converted to any floating dtype (through fp32 on the
  // host when the dtype changes: for tests and set-up, not for hot paths).
  static Tensor copy_of(const TensorView& src, Device device, DType dtype);
  static Tensor copy_of(const TensorView& src, Device device) { return copy_of(src, device, src.dtype); }
  // From fp32 host values, converted to dtype and placed on device.
  static Tensor from_f32(const std::vector<float>& values, Shape shape, DType dtype, Device device);
  static Tensor from_i32(const std::vector<int32_t>& values, Shape shape, Device device);

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }
  void* data() const { return view_.data; }
  const Shape& shape() const { return view_.shape; }
  DType dtype() const { return view_.dtype; }
  Device device() const { return view_.device; }
  int64_t numel() const { return view_.numel(); }

 private:
  std::variant<std::monostate, HostBuffer, DeviceBuffer> storage_;
  TensorView view_;
};

// The values of any floating or integer view as fp32 on the host (copying from the GPU if needed).
std::vector<float> to_f32_vector(const TensorView& view);
// Copies bytes between two views of the same dtype and element count (any devices, contiguous).
void copy_view(const TensorView& dst, const TensorView& src);

}  // namespace tvllm
