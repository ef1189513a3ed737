// Validation in one place: every public entry point turns its arguments into a
// Problem here, or throws dmattn::Error naming the argument, before any backend
// runs or any output is written.
#pragma once

#include <optional>

#include "dmattn/dmattn.h"
#include "problem.h"

namespace dmattn {

// layout == nullptr: batched (B, S, H, D) tensors; otherwise varlen.
Problem make_forward_problem(const Inputs& in, const VarlenLayout* layout, const TensorView& out,
                             const std::optional<TensorView>& lse, const Options& options);
Problem make_backward_problem(const Inputs& in, const VarlenLayout* layout, const TensorView& out,
                              const TensorView& dout, const TensorView& lse, const Gradients& grads,
                              const Options& options);

}  // namespace dmattn
