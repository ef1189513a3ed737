// The host side's CUDA error check: a failed runtime call throws, naming it.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace dmattn::cuda {

inline void check_cuda(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) throw std::runtime_error("dmattn: CUDA: " + what + ": " + cudaGetErrorString(err));
}

}  // namespace dmattn::cuda
