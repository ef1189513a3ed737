#include "cases.h"

#include <type_traits>
#include <utility>

namespace dmattn_test {
namespace {

Layout sliced() { return Layout{true, false, {}}; }
Layout permuted() { return Layout{false, true, {}}; }
Layout sliced_permuted() { return Layout{true, true, {}}; }

Shape4 full_shape(const Case& c) { return {c.B, c.H, c.Sq, c.Sk}; }

// Awkward (Sq, Sk, D), each plain and with causal, a key padding mask and a bias.
std::vector<Case> size_cases(DType dtype) {
  const std::int64_t sizes[][3] = {{1, 1, 1},     {1, 7, 3},     {7, 1, 16},   {3, 65, 64},  {65, 3, 128},
                                   {63, 63, 16},  {127, 65, 3},  {65, 127, 64}, {7, 127, 128},
                                   {200, 301, 16}};
  std::vector<Case> out;
  for (const auto& s : sizes) {
    Case c = make_case(dtype, s[0], s[1], s[2]);
    out.push_back(c);
    c.options.causal = true;
    c.mask = MaskSpec{{c.B, 1, 1, c.Sk}, {}, 0.8};
    c.bias = BiasSpec{{1, c.Hk, c.Sq, c.Sk}, {}, std::nullopt, Values::kUniform};
    out.push_back(c);
  }
  return out;
}

// Every option on Sq < Sk, Sq == Sk and Sq > Sk, without and with a full bias.
std::vector<Case> option_cases(DType dtype) {
  auto window = [](std::int64_t left, std::int64_t right, bool causal = false) {
    dmattn::Options o;
    o.sliding_window = {left, right};
    o.causal = causal;
    return o;
  };
  std::vector<dmattn::Options> options;
  options.emplace_back().causal = true;
  for (const auto& [left, right] : std::vector<std::pair<std::int64_t, std::int64_t>>{
           {3, -1}, {-1, 2}, {2, 1}, {0, 0}, {0, -1}, {-1, 0}})
    options.push_back(window(left, right));
  options.push_back(window(2, -1, true));
  options.push_back(window(0, 3, true));
  dmattn::Options capped;
  capped.scale = 1.0, capped.softcap = 1.5;
  options.push_back(capped);
  capped.softcap = 30.0;
  options.push_back(capped);
  options.emplace_back().scale = 0.3;
  dmattn::Options mixed = window(4, -1, true);
  mixed.scale = 2.0, mixed.softcap = 2.0;
  options.push_back(mixed);

  std::vector<Case> out;
  for (const dmattn::Options& o : options)
    for (const auto& [Sq, Sk] : {std::pair<std::int64_t, std::int64_t>{5, 9}, {9, 9}, {9, 5}})
      for (bool with_bias : {false, true}) {
        Case c = make_case(dtype, Sq, Sk, 16);
        c.options = o;
        if (with_bias) c.bias = BiasSpec{full_shape(c), {}, std::nullopt, Values::kUniform};
        out.push_back(c);
      }
  return out;
}

// Each broadcast shape twice: as a compact view (dense, sliced or permuted in
// turn) and as a full-shape view expanded with stride 0 over its broadcast dims.
template <class Spec>
std::vector<Case> broadcast_cases(DType dtype, const std::vector<DType>& operand_dtypes,
                                  std::optional<Spec> Case::*member) {
  const Case shape_of = make_case(dtype, 5, 7, 16);
  const Layout compact[] = {Layout{}, sliced(), permuted()};
  std::vector<Case> out;
  int n = 0;
  for (const Shape4& shape : broadcast_shapes(shape_of))
    for (DType operand_dtype : operand_dtypes) {
      Case c = shape_of;
      c.options.causal = n % 3 == 0;
      Spec spec;
      spec.shape = shape;
      spec.layout = compact[n++ % 3];
      if constexpr (std::is_same_v<Spec, BiasSpec>) spec.dtype = operand_dtype;
      c.*member = spec;
      out.push_back(c);
      const Shape4 full = full_shape(c);
      Layout expanded;
      for (int d = 0; d < 4; ++d) expanded.expanded[d] = shape[d] == 1 && full[d] > 1;
      if (expanded.expanded == std::array<bool, 4>{}) continue;
      spec.shape = {full[0], shape[1] == 1 ? full[1] : shape[1], full[2], full[3]};
      spec.layout = expanded;
      c.*member = spec;
      out.push_back(c);
    }
  return out;
}

// Grouped (GQA), multi-query and multi-head attention, with per-kv-head and
// per-query-head operands.
std::vector<Case> head_cases(DType dtype) {
  std::vector<Case> out;
  for (const auto& [H, Hk] : {std::pair<std::int64_t, std::int64_t>{8, 2}, {8, 1}, {3, 3}, {1, 1}, {6, 3}}) {
    Case c = make_case(dtype, 7, 9, 16);
    c.H = H, c.Hk = Hk;
    c.options.causal = true;
    c.mask = MaskSpec{{c.B, Hk, c.Sq, c.Sk}, {}, 0.85};
    c.bias = BiasSpec{{1, Hk, 1, c.Sk}, {}, std::nullopt, Values::kUniform};
    out.push_back(c);
    c.options.causal = false;
    c.mask = MaskSpec{{1, H, 1, c.Sk}, {}, 0.85};
    c.bias = BiasSpec{{c.B, 1, c.Sq, c.Sk}, {}, std::nullopt, Values::kUniform};
    out.push_back(c);
  }
  return out;
}

// Non-contiguous token and head strides for inputs and outputs.
std::vector<Case> layout_cases(DType dtype) {
  std::vector<Case> out;
  for (const Layout& in_layout : {sliced(), permuted(), sliced_permuted()})
    for (const Layout& out_layout : {Layout{}, sliced(), sliced_permuted()}) {
      Case c = make_case(dtype, 6, 11, 16);
      c.H = 6, c.Hk = 3;
      c.qkv_layout = in_layout, c.out_layout = out_layout;
      c.mask = MaskSpec{{c.B, 1, c.Sq, c.Sk}, permuted(), 0.85};
      c.bias = BiasSpec{{c.B, c.H, 1, c.Sk}, sliced_permuted(), std::nullopt, Values::kUniform};
      c.options.causal = true;
      out.push_back(c);
    }
  return out;
}

std::vector<DType> bias_dtypes(DType q) {
  return q == DType::kFloat32 ? std::vector<DType>{q} : std::vector<DType>{q, DType::kFloat32};
}

}  // namespace

const std::vector<std::string>& case_groups() {
  static const std::vector<std::string> groups{"sizes", "options", "mask_broadcasts", "bias_broadcasts",
                                               "heads", "layouts"};
  return groups;
}

std::vector<Case> cases(const std::string& group, DType dtype) {
  if (group == "sizes") return size_cases(dtype);
  if (group == "options") return option_cases(dtype);
  if (group == "mask_broadcasts") return broadcast_cases<MaskSpec>(dtype, {DType::kBool}, &Case::mask);
  if (group == "bias_broadcasts") return broadcast_cases<BiasSpec>(dtype, bias_dtypes(dtype), &Case::bias);
  if (group == "heads") return head_cases(dtype);
  if (group == "layouts") return layout_cases(dtype);
  ADD_FAILURE() << "unknown case group " << group;
  return {};
}

std::vector<Shape4> broadcast_shapes(const Case& c) {
  std::vector<Shape4> shapes;
  for (std::int64_t b : {c.B, std::int64_t{1}})
    for (std::int64_t h : {c.H, c.Hk, std::int64_t{1}})
      for (std::int64_t i : {c.Sq, std::int64_t{1}})
        for (std::int64_t j : {c.Sk, std::int64_t{1}}) {
          const Shape4 s{b, h, i, j};
          bool seen = false;
          for (const Shape4& t : shapes) seen = seen || t == s;
          if (!seen) shapes.push_back(s);
        }
  return shapes;
}

std::string group_param_name(const ::testing::TestParamInfo<GroupParam>& info) {
  return std::string(dmattn::dtype_name(std::get<0>(info.param))) + "_" + std::get<1>(info.param);
}

}  // namespace dmattn_test
