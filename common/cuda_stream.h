// Streams and CUDA graphs, owned RAII-style.
//
// Every GPU entry point of the course takes the stream it runs on as its last parameter
// (`cudaStream_t stream = nullptr`, nullptr being the legacy default stream). A forward step queues its
// work on one stream and never waits; that is what lets it be recorded once as a CUDA graph and replayed
// with one launch (lesson 14). CudaGraph::capture is also how the tests prove that an op allocates
// nothing and never synchronises: in cudaStreamCaptureModeGlobal such a call fails the capture.
//
// Header-only, C++17 (included by .cu files and tests).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "common/errors.h"

namespace tvllm {

// A stream of our own. Non-blocking by default: it does NOT wait for work on the legacy default stream
// (nor that for it), so whoever mixes the two synchronises explicitly.
class CudaStream {
 public:
  explicit CudaStream(unsigned flags = cudaStreamNonBlocking) {
    TVLLM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, flags));
  }
  ~CudaStream() {
    if (stream_) cudaStreamDestroy(stream_);  // no throw from a destructor; the stream's work still completes
  }
  CudaStream(CudaStream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)) {}
  CudaStream& operator=(CudaStream&& o) noexcept {
    std::swap(stream_, o.stream_);
    return *this;
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  cudaStream_t get() const { return stream_; }
  operator cudaStream_t() const { return stream_; }  // NOLINT: pass it wherever a cudaStream_t goes
  void synchronize() const { TVLLM_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

 private:
  cudaStream_t stream_ = nullptr;
};

// An instantiated CUDA graph: the kernels, memsets and copies one piece of host code queued on a stream,
// recorded once and replayed with one launch. The recorded calls keep their arguments (pointers, sizes):
// a replay reads and writes the same buffers.
class CudaGraph {
 public:
  // Runs work() with `stream` in capture mode (cudaStreamCaptureModeGlobal: a cudaMalloc, a synchronising
  // copy or any other call unsafe during capture, from any thread, fails with an error instead of being
  // silently left out of the graph), then instantiates what it queued. `stream` must not be the legacy
  // default stream (it cannot be captured). If work() throws, the capture is ended and the error rethrown.
  template <class Work>
  static CudaGraph capture(cudaStream_t stream, Work&& work) {
    TVLLM_REQUIRE(stream != nullptr, "CudaGraph::capture: the legacy default stream cannot be captured");
    TVLLM_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    try {
      work();
    } catch (...) {
      cudaGraph_t broken = nullptr;
      cudaStreamEndCapture(stream, &broken);  // leave capture mode whatever happened; drop the graph
      if (broken) cudaGraphDestroy(broken);
      cudaGetLastError();  // the error is the exception in flight: clear it so later calls do not report it
      throw;
    }
    CudaGraph g;
    TVLLM_CUDA_CHECK(cudaStreamEndCapture(stream, &g.graph_));
    TVLLM_CUDA_CHECK(cudaGraphInstantiate(&g.exec_, g.graph_, 0));
    return g;
  }

  // Queues one replay on `stream`; returns without waiting.
  void launch(cudaStream_t stream) const { TVLLM_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }
  // How many operations (kernels, memsets, copies) the capture recorded.
  size_t num_nodes() const {
    size_t n = 0;
    TVLLM_CUDA_CHECK(cudaGraphGetNodes(graph_, nullptr, &n));
    return n;
  }

  CudaGraph(CudaGraph&& o) noexcept
      : graph_(std::exchange(o.graph_, nullptr)), exec_(std::exchange(o.exec_, nullptr)) {}
  CudaGraph& operator=(CudaGraph&& o) noexcept {
    std::swap(graph_, o.graph_);
    std::swap(exec_, o.exec_);
    return *this;
  }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  ~CudaGraph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }

 private:
  CudaGraph() = default;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace tvllm
