// Split-KV (ForwardParams::num_splits): the merge of the splits' partials
// (fwd/combine.cu), compiled once for every head dim and dtype.
#pragma once

#include <cuda_runtime.h>

#include "../params.h"

namespace dmattn::cuda {

// Enqueues the merge of p's split partials (o_partial, stat_partial) into out
// and lse, for p.batch x p.heads x p.seqlen_q rows.
cudaError_t combine_splits(const ForwardParams& p, cudaStream_t stream);

}  // namespace dmattn::cuda
