// The matrix of batched problems that both the forward and the backward tests
// run: awkward sizes, every option, every broadcast form of mask and bias,
// grouped heads and strided layouts.
#pragma once

#include <string>
#include <tuple>
#include <vector>

#include "harness.h"

namespace dmattn_test {

// Group names, e.g. "sizes", "options", "mask_broadcasts".
const std::vector<std::string>& case_groups();
std::vector<Case> cases(const std::string& group, DType dtype);

// Every 4-D shape a mask or bias of c may have: batch {B, 1}, heads {H, Hk, 1},
// queries {Sq, 1}, keys {Sk, 1}.
std::vector<Shape4> broadcast_shapes(const Case& c);

// Parameters (dtype, group) for INSTANTIATE_TEST_SUITE_P, named "float32_sizes".
using GroupParam = std::tuple<DType, std::string>;
std::string group_param_name(const ::testing::TestParamInfo<GroupParam>& info);

}  // namespace dmattn_test
