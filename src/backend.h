// Backends behind the API: each runs a validated Problem on its device.
#pragma once

#include "problem.h"

namespace dmattn {

struct Backend {
  void (*forward)(const Problem& p);   // writes out and (if present) lse
  void (*backward)(const Problem& p);  // writes dq, dk, dv and (if present) dbias
  void (*select)(const Problem& p);    // writes the top-k intervals p.topk_intervals (select_topk)
  void (*fill_zeros)(const TensorView& t, void* stream);  // every element of a validated output view
};

const Backend& cpu_backend();
// nullptr when this build has no CUDA backend.
const Backend* cuda_backend();

}  // namespace dmattn
