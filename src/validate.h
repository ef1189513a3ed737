// Validation in one place: every public entry point turns its arguments into a
// Problem here, or throws dmattn::Error naming the argument, before any backend
// runs or any output is written.
#pragma once

#include <cstdint>
#include <optional>

#include "dmattn/dmattn.h"
#include "problem.h"

namespace dmattn {

// What validation reads. kData (a call that runs): shapes, strides, dtypes, devices,
// options, the data pointers (non-null unless empty) and the cu_seqlens values (on
// the CPU). kMetadata (dmattn::check_*): the same but for the data pointers and the
// cu_seqlens values; nothing is read through a pointer.
enum class Reads : std::uint8_t { kData, kMetadata };

// layout == nullptr: batched (B, S, H, D) tensors; otherwise varlen.
Problem make_forward_problem(const Inputs& in, const VarlenLayout* layout, const TensorView& out,
                             const std::optional<TensorView>& lse, const Options& options,
                             Reads reads = Reads::kData);
Problem make_backward_problem(const Inputs& in, const VarlenLayout* layout, const TensorView& out,
                              const TensorView& dout, const TensorView& lse, const Gradients& grads,
                              const Options& options, Reads reads = Reads::kData);
// select_topk: p.topk_intervals is the output `intervals`; q, k and v's data is not read.
Problem make_select_problem(const Inputs& in, const VarlenLayout* layout, const TensorView& intervals,
                            const Options& options, Reads reads = Reads::kData);

}  // namespace dmattn
