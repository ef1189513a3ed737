// A call's scratch memory in one stream-ordered allocation. Each cudaMallocAsync,
// cudaMemsetAsync and cudaFreeAsync costs several microseconds of host time
// (docs/kernels.md "Where it stands"), which bounds the short calls; so the
// parts of a call's scratch are laid out in one allocation, each 256-byte
// aligned, the parts to be zeroed first and together, zeroed by one memset.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

namespace dmattn::cuda {

class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  // A part of `count` T, whose address allocate() writes into `where` (zeroed
  // on the stream first where `zeroed`).
  template <class T>
  void add(T*& where, std::size_t count, bool zeroed) {
    parts_.push_back({reinterpret_cast<void**>(&where), aligned(count * sizeof(T)), zeroed});
  }

  // One allocation for every part (none where they are all empty) and one
  // memset over the zeroed ones, on `stream`.
  cudaError_t allocate(cudaStream_t stream) {
    std::size_t zeroed_bytes = 0, bytes = 0;
    for (const Part& part : parts_) (part.zeroed ? zeroed_bytes : bytes) += part.bytes;
    if (zeroed_bytes + bytes == 0) return cudaSuccess;
    cudaError_t err = cudaMallocAsync(reinterpret_cast<void**>(&base_), zeroed_bytes + bytes, stream);
    if (err != cudaSuccess) return err;
    std::size_t zeroed_at = 0, at = zeroed_bytes;
    for (const Part& part : parts_) {
      std::size_t& offset = part.zeroed ? zeroed_at : at;
      *part.where = base_ + offset;
      offset += part.bytes;
    }
    return zeroed_bytes > 0 ? cudaMemsetAsync(base_, 0, zeroed_bytes, stream) : cudaSuccess;
  }

  // Bytes rounded up to a part's alignment (256).
  static std::size_t aligned(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

  // The stream-ordered free (its error is not checked: the call's own error is
  // the one to report).
  void release(cudaStream_t stream) {
    if (base_ != nullptr) cudaFreeAsync(base_, stream);
    base_ = nullptr;
  }

 private:
  struct Part {
    void** where;
    std::size_t bytes;
    bool zeroed;
  };
  std::vector<Part> parts_;
  char* base_ = nullptr;
};

}  // namespace dmattn::cuda
