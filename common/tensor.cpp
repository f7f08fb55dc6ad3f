#include "common/tensor.h"

#include <sstream>
#include <stdexcept>

#include "common/errors.h"

namespace tvllm {

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_str(const Shape& shape) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << "]";
  return s.str();
}

TensorView TensorView::contiguous(void* data, DType dtype, Device device, Shape shape) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.strides.assign(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; --i) v.strides[i] = v.strides[i + 1] * shape[i + 1];
  v.shape = std::move(shape);
  return v;
}

int64_t TensorView::dim(int i) const {
  int r = rank();
  if (i < 0) i += r;
  if (i < 0 || i >= r) throw std::out_of_range("TensorView::dim " + std::to_string(i) + " of " + describe());
  return shape[i];
}

int64_t TensorView::numel() const { return shape_numel(shape); }

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int i = rank() - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

TensorView TensorView::rows(int64_t begin, int64_t count) const {
  if (rank() == 0 || begin < 0 || count < 0 || begin + count > shape[0])
    throw std::out_of_range("TensorView::rows out of range for " + describe());
  TensorView v = *this;
  v.data = static_cast<char*>(data) + begin * strides[0] * static_cast<int64_t>(dtype_size(dtype));
  v.shape[0] = count;
  return v;
}

TensorView TensorView::columns(int64_t begin, int64_t count) const {
  TVLLM_REQUIRE(rank() == 2, "TensorView::columns: a 2-D view is needed, got " + describe());
  TVLLM_REQUIRE(shape[1] <= 1 || strides[1] == 1, "TensorView::columns: columns must be contiguous in " + describe());
  TVLLM_REQUIRE(begin >= 0 && count >= 0 && begin + count <= shape[1],
                "TensorView::columns: columns [" + std::to_string(begin) + ", " + std::to_string(begin + count) +
                    ") are outside " + describe());
  TensorView v = *this;
  v.data = static_cast<char*>(data) + begin * static_cast<int64_t>(dtype_size(dtype));
  v.shape = {shape[0], count};
  v.strides = {strides[0], 1};
  return v;
}

TensorView TensorView::reshape(Shape new_shape) const {
  if (!is_contiguous()) throw std::logic_error("reshape of a non-contiguous view " + describe());
  if (shape_numel(new_shape) != numel())
    throw std::logic_error("reshape " + describe() + " to " + shape_str(new_shape) + ": element counts differ");
  return contiguous(data, dtype, device, std::move(new_shape));
}

std::string TensorView::describe() const {
  return std::string(dtype_name(dtype)) + shape_str(shape) + " " + std::string(device_name(device));
}

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  Tensor t;
  size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  void* ptr = nullptr;
  if (device == Device::CUDA) {
    ptr = t.storage_.emplace<DeviceBuffer>(bytes).data();
  } else {
    ptr = t.storage_.emplace<HostBuffer>(bytes).data();
  }
  t.view_ = TensorView::contiguous(ptr, dtype, device, std::move(shape));
  return t;
}

void copy_view(const TensorView& dst, const TensorView& src) {
  if (dst.dtype != src.dtype || dst.numel() != src.numel())
    throw std::logic_error("copy_view: " + src.describe() + " -> " + dst.describe() + " mismatch");
  if (!dst.is_contiguous() || !src.is_contiguous())
    throw std::logic_error("copy_view: views must be contiguous");
  if (src.nbytes() == 0) return;
  if (dst.device == Device::CPU && src.device == Device::CPU) {
    std::memcpy(dst.data, src.data, src.nbytes());
    return;
  }
  TVLLM_CUDA_CHECK(cudaMemcpy(dst.data, src.data, src.nbytes(), cudaMemcpyDefault));
}

std::vector<float> to_f32_vector(const TensorView& view) {
  Tensor host;
  const TensorView* src = &view;
  if (view.device == Device::CUDA || !view.is_contiguous()) {
    if (!view.is_contiguous()) throw std::logic_error("to_f32_vector: non-contiguous " + view.describe());
    host = Tensor::empty(view.shape, view.dtype, Device::CPU);
    copy_view(host.view(), view);
    src = &host.view();
  }
  std::vector<float> out(static_cast<size_t>(view.numel()));
  for (size_t i = 0; i < out.size(); ++i) out[i] = load_as_f32(src->data, src->dtype, i);
  return out;
}

Tensor Tensor::copy_of(const TensorView& src, Device device, DType dtype) {
  Tensor out = empty(src.shape, dtype, device);
  if (dtype == src.dtype) {
    copy_view(out.view(), src);
    return out;
  }
  // Convert on the host through fp32, then place.
  std::vector<float> values = to_f32_vector(src);
  Tensor host = empty(src.shape, dtype, Device::CPU);
  for (size_t i = 0; i < values.size(); ++i) store_from_f32(host.data(), dtype, i, values[i]);
  if (device == Device::CPU) return host;
  copy_view(out.view(), host.view());
  return out;
}

Tensor Tensor::from_f32(const std::vector<float>& values, Shape shape, DType dtype, Device device) {
  if (static_cast<int64_t>(values.size()) != shape_numel(shape))
    throw std::logic_error("Tensor::from_f32: " + std::to_string(values.size()) + " values for shape " +
                           shape_str(shape));
  TensorView src = TensorView::contiguous(const_cast<float*>(values.data()), DType::F32, Device::CPU, shape);
  return copy_of(src, device, dtype);
}

Tensor Tensor::from_i32(const std::vector<int32_t>& values, Shape shape, Device device) {
  if (static_cast<int64_t>(values.size()) != shape_numel(shape))
    throw std::logic_error("Tensor::from_i32: size does not match shape " + shape_str(shape));
  TensorView src = TensorView::contiguous(const_cast<int32_t*>(values.data()), DType::I32, Device::CPU, shape);
  return copy_of(src, device);
}

}  // namespace tvllm
