// The backward's last passes that no head dim or dtype changes, compiled once
// (bwd/finish.cu): the dbias reduction and the zeros of keys no row selects.
#pragma once

#include <cuda_runtime.h>

#include "../params.h"

namespace dmattn::cuda {

// Enqueues dbias from the float32 slices of p.scratch (slices > 0; each of the
// dense dbias's elements), or its zero fill (slices == 0).
cudaError_t reduce_bias_grad(const BackwardParams& p, int slices, cudaStream_t stream);

// Enqueues the zeros of dk and dv at the keys of batch x kv heads that no key
// group holds (p.key_pieces[key] == 0).
cudaError_t zero_unselected(const BackwardParams& p, int batch, cudaStream_t stream);

}  // namespace dmattn::cuda
