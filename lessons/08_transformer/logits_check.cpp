// Lesson 08: teacher-forced top-1 agreement of two logits matrices.
#include "logits_check.h"

#include <cmath>
#include <cstdio>

#include "common/errors.h"

namespace tvllm {

namespace {
struct Top2 {
  int64_t arg = 0;
  float first = -INFINITY, second = -INFINITY;
};
Top2 top2(const float* row, int64_t n) {
  Top2 t;
  for (int64_t i = 0; i < n; ++i) {
    if (row[i] > t.first) {
      t.second = t.first;
      t.first = row[i];
      t.arg = i;
    } else if (row[i] > t.second) {
      t.second = row[i];
    }
  }
  return t;
}
}  // namespace

double rms(const TensorView& x) {
  TVLLM_REQUIRE(x.device == Device::CPU && x.dtype == DType::F32 && x.is_contiguous(),
                "rms: a contiguous F32 host view is needed, got " + x.describe());
  double sum = 0.0;
  const float* p = x.ptr<const float>();
  for (int64_t i = 0; i < x.numel(); ++i) sum += static_cast<double>(p[i]) * p[i];
  return x.numel() ? std::sqrt(sum / static_cast<double>(x.numel())) : 0.0;
}

Top1Agreement top1_agreement(const TensorView& actual, const TensorView& reference, double margin) {
  for (const TensorView* v : {&actual, &reference})
    TVLLM_REQUIRE(v->device == Device::CPU && v->dtype == DType::F32 && v->rank() == 2 && v->is_contiguous(),
                  "top1_agreement: contiguous F32 [rows, vocab] host views are needed, got " + v->describe());
  TVLLM_REQUIRE(actual.shape == reference.shape,
                "top1_agreement: shapes differ: " + actual.describe() + " vs " + reference.describe());
  Top1Agreement r;
  r.positions = actual.shape[0];
  r.reference_rms = rms(reference);
  const int64_t V = actual.shape[1];
  for (int64_t t = 0; t < r.positions; ++t) {
    const float* a = actual.ptr<const float>() + t * V;
    const float* e = reference.ptr<const float>() + t * V;
    for (int64_t i = 0; i < V; ++i)
      r.max_abs_error = std::fmax(r.max_abs_error, std::fabs(static_cast<double>(a[i]) - e[i]));
    const Top2 want = top2(e, V);
    const bool agree = top2(a, V).arg == want.arg;
    r.agree_all += agree;
    if (static_cast<double>(want.first) - want.second > margin) {
      ++r.clear;
      r.agree_clear += agree;
      if (!agree && r.first_disagreement < 0) r.first_disagreement = t;
    }
  }
  return r;
}

std::string Top1Agreement::summary() const {
  char text[160];
  std::snprintf(text, sizeof text,
                "clear %lld/%lld agree %lld; all agree %lld/%lld; max |err| %.3g (rms %.3g)",
                (long long)clear, (long long)positions, (long long)agree_clear, (long long)agree_all,
                (long long)positions, max_abs_error, reference_rms);
  return text;
}

}  // namespace tvllm
