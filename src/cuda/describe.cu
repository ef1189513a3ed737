// A plan in words (dispatch.h describe): the kernel and walk of each step, how
// dq and dbias are summed, the top-k selection, and the condition that kept a
// step off the Hopper kernel. DMATTN_LOG_PLAN prints it (dispatch.cu report).
#include <string>

#include "dispatch.h"

namespace dmattn::cuda {
namespace {

// The top-k selection of a plan, in words.
template <class Plan>
std::string selection_words(const Plan& plan) {
  if (plan.selection == DeviceSelection::kNone) return "";
  if (plan.selection_given) return "; top-k: the given intervals";
  return plan.selection == DeviceSelection::kIntervals ? "; top-k: intervals selected" : "; top-k: per-row thresholds";
}

template <class Plan>
std::string refusal_words(const Plan& plan) {
  return plan.why_not_sm90 == nullptr ? "" : std::string("; not the Hopper kernel: ") + plan.why_not_sm90;
}

}  // namespace

std::string describe(const ForwardPlan& plan) {
  if (plan.empty) return "forward: nothing to compute";
  const ForwardParams& p = plan.params;
  std::string s = "forward, D' = " + std::to_string(plan.head_dim) + ": ";
  if (plan.kernel == ForwardKernel::kSm90) {
    s += "Hopper kernel, ";
    s += plan.bias_tiles   ? "bias-tile walk"
         : plan.mask_tiles ? "mask-tile walk"
         : plan.key_lists  ? "key-list walk"
                           : "dense walk";
    if (plan.persistent_ctas > 0) s += ", " + std::to_string(plan.persistent_ctas) + " persistent CTAs";
  } else {
    s += "sm80 kernel, " + std::to_string(plan.block_m) + " rows a CTA";
    if (plan.kernel == ForwardKernel::kSm80KeySplit) s += ", the warps over the keys";
    if (plan.key_lists) s += ", key lists";
    if (p.num_splits > 1) s += ", " + std::to_string(p.num_splits) + " key splits";
    if (p.topk_fold > 1) s += ", " + std::to_string(p.topk_fold) + " query heads folded into rows";
  }
  return s + selection_words(plan) + refusal_words(plan);
}

std::string describe(const BackwardPlan& plan) {
  if (plan.empty) return "backward: nothing to compute";
  const BackwardParams& p = plan.params;
  std::string s = "backward, D' = " + std::to_string(plan.head_dim) + ": dk/dv ";
  if (plan.dkv == DkvKernel::kSm80) {
    s += plan.small_dkv ? "sm80 kernel, small tile" : "sm80 kernel, large tile";
    if (plan.selection == DeviceSelection::kIntervals) s += ", key groups";
    if (plan.mask_tiles) s += ", mask tiles";
  } else if (plan.dkv == DkvKernel::kSm80Dense) {
    s += plan.small_dkv ? "dense sm80 kernel, small tile" : "dense sm80 kernel, large tile";
  } else {
    s += "Hopper kernel, ";
    s += plan.dkv == DkvKernel::kSm90Groups    ? "key-group walk"
         : plan.dkv == DkvKernel::kSm90RowBias ? (plan.bias_tiles ? "bias-tile walk" : "row-bias walk")
         : plan.ordered_dq                     ? "ordered-dq walk"
         : plan.mask_tiles                     ? "mask-tile walk"
         : p.softcap > 0.0f                    ? "softcap walk"
                                               : "dense walk";
  }
  s += plan.ordered_dq      ? "; dq added in key order by the dk/dv kernel"
       : p.atomic_dq        ? "; dq added by atomics in the dk/dv kernel"
       : plan.small_dq      ? "; dq by the sm80 dq kernel, small tile"
                            : "; dq by the sm80 dq kernel, large tile";
  if (plan.key_lists && !p.atomic_dq) s += ", key lists";
  if (p.bias_grad != BiasGrad::kNone)
    s += plan.dbias_slices > 0 ? "; dbias summed over " + std::to_string(plan.dbias_slices) + " float32 slices"
                               : std::string("; dbias written directly");
  return s + selection_words(plan) + refusal_words(plan);
}

}  // namespace dmattn::cuda
