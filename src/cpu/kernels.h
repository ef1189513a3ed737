// CPU forward and backward over a validated Problem, in accumulation type A
// (double for float64 inputs, float otherwise).
#pragma once

#include "../problem.h"
#include "selection.h"

namespace dmattn::cpu {

template <class A>
void forward(const Problem& p, const Selection& sel);
template <class A>
void backward(const Problem& p, const Selection& sel);

}  // namespace dmattn::cpu
