// Lesson 06: the cuBLASLt descriptors that v6 (matmul.cu) and v8 (matmul_pinned.cu) share.
//
// cuBLASLt describes a product with three kinds of host objects: an operation (compute type, transposes),
// one layout per matrix (type, rows, columns, leading dimension) and, for the heuristic query, a preference
// (workspace, alignments, allowed reductions). The wrappers below own one each (RAII); LtPlan bundles the
// operation and the layouts of y = x W^T for one number of tokens, with the row-major trick of v5
// (matmul.cu): A = w read as OP_T, B = x read as OP_N, C = y; m = out, n = T, k = in.
//
// Internal to lesson 06 (included by its .cu files only).
#pragma once

#include <cublasLt.h>

#include <cstdint>

#include "common/dtype.h"
#include "common/errors.h"

namespace tvllm {
namespace lt {

inline cudaDataType_t cuda_type(DType dtype) { return dtype == DType::F32 ? CUDA_R_32F : CUDA_R_16BF; }

struct LtMatmulDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  LtMatmulDesc() { TVLLM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F)); }
  ~LtMatmulDesc() { if (desc) cublasLtMatmulDescDestroy(desc); }
  LtMatmulDesc(const LtMatmulDesc&) = delete;
  LtMatmulDesc& operator=(const LtMatmulDesc&) = delete;
};
struct LtLayout {
  cublasLtMatrixLayout_t layout = nullptr;
  LtLayout(cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld) {
    TVLLM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout, type, rows, cols, ld));
  }
  ~LtLayout() { if (layout) cublasLtMatrixLayoutDestroy(layout); }
  LtLayout(const LtLayout&) = delete;
  LtLayout& operator=(const LtLayout&) = delete;
};
struct LtPreference {
  cublasLtMatmulPreference_t pref = nullptr;
  LtPreference() { TVLLM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref)); }
  ~LtPreference() { if (pref) cublasLtMatmulPreferenceDestroy(pref); }
  LtPreference(const LtPreference&) = delete;
  LtPreference& operator=(const LtPreference&) = delete;
};

// Everything cuBLASLt needs for one (T, in, out, output dtype): the operation, the layouts, and the algorithm
// the caller chooses (v6: the heuristic's answer for this T; v8: the one pinned for the weight's shape).
struct LtPlan {
  LtMatmulDesc op;
  LtLayout a, b, c;
  cublasLtMatmulAlgo_t algo{};
  LtPlan(int tokens, int in, int out, cudaDataType_t out_type)
      : a(CUDA_R_16BF, in, out, in),       // w as stored: column-major [in, out] (OP_T makes it [out, in])
        b(CUDA_R_16BF, in, tokens, in),    // x as stored: column-major [in, T]
        c(out_type, out, tokens, out) {    // y: column-major [out, T]
    const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;  // the row-major trick, as in v5
    TVLLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t));
    TVLLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n));
  }
};

}  // namespace lt
}  // namespace tvllm
