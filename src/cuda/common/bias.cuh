// The bias policy of every attention kernel: how a walk reads a bias and
// where its gradient goes. What varies is the kind (params.h BiasKind, from
// the launch's strides: none, key-only, per-row, full) and, in the backward,
// where dbias is summed (BiasGrad: per key in registers, per element in tiles,
// directly or into float32 slices). The walks choose how they stage a kind
// (shared memory, registers, TMA tiles: docs/kernels.md); the element they
// read and the dbias element they write come from here.
#pragma once

#include <cstdint>

#include "../params.h"
#include "element.cuh"
#include "geometry.h"

namespace dmattn::cuda {

// The bias of one (batch entry, bias head) from one (row, key) on (a walk's
// block or tile, in its sequence): element (i, j) relative to it, in float.
// A key-only bias (row stride 0) reads any row as row 0. Without a bias
// nothing reads; `present` false skips the base's arithmetic (the walks that
// test for a bias once, at their start).
template <class Element>
struct BiasReader {
  const AttentionParams& p;
  std::int64_t base = 0;
  __device__ BiasReader(const AttentionParams& p_, int b, int hb, std::int64_t row0, std::int64_t key0,
                        bool present = true)
      : p(p_), base(present ? element_at(p_.bias, b, hb, row0, key0) : 0) {}
  // Element (i, j)'s index in the bias array (the walks that copy raw elements).
  __device__ std::int64_t offset(std::int64_t i, std::int64_t j) const { return base + i * p.bias.sr + j * p.bias.sc; }
  __device__ float at(std::int64_t i, std::int64_t j) const {
    return load_float<Element>(p.bias.data, p.bias_float32, offset(i, j));
  }
  // Key j of a key-only bias.
  __device__ float key(std::int64_t j) const { return at(0, j); }
};

// Where a dk/dv CTA's dbias values go: element (bias head hb, local row i,
// local key j) of dbias directly in its dtype, or added into the CTA's float32
// slice of BackwardParams::scratch (reduce_bias_grad sums the slices).
template <class Element>
struct BiasGradOut {
  float* slice = nullptr;
  int db_b = 0;
  std::int64_t qs = 0, ks = 0;
  __device__ BiasGradOut(const BackwardParams& p, int b, int kvh, const Sequence& seq)
      : db_b(p.db_batch == 1 ? 0 : b), qs(seq.qs), ks(seq.ks) {
    const std::int64_t elements = p.db_batch * p.db_heads * p.db_rows * p.db_cols;
    if (p.scratch != nullptr)
      slice = p.scratch + (std::int64_t{p.contrib_b > 1 ? b : 0} * p.contrib_h + (p.contrib_h > 1 ? kvh : 0)) * elements;
  }
  // The element's index in the dense (db_batch, db_heads, db_rows, db_cols) slice.
  __device__ std::int64_t dense(const BackwardParams& p, int hb, std::int64_t i, std::int64_t j) const {
    return ((std::int64_t{db_b} * p.db_heads + hb) * p.db_rows + (p.db_rows == 1 ? 0 : i)) * p.db_cols + j;
  }
  __device__ void add(const BackwardParams& p, int hb, std::int64_t i, std::int64_t j, float x) const {
    if (slice != nullptr)
      slice[dense(p, hb, i, j)] += x;
    else
      store_float<Element>(p.dbias.data, p.bias_float32,
                           db_b * p.dbias.sb + hb * p.dbias.sh + (p.db_rows == 1 ? 0 : qs + i) * p.dbias.sr +
                               (ks + j) * p.dbias.sc,
                           x);
  }
};

// Zeros into the dbias rows [0, lo) and [hi, db_rows) of keys [k0, k0 +
// keys) of bias heads [hb_lo, hb_hi] of batch entry b (BackwardParams::dbias_zeros:
// a direct dbias, batched, dense rows): what a dk/dv CTA owns of dbias and
// its walk does not reach. 16 threads a row, 16 bytes a store where the
// addresses allow, streamed (st.global.cs: no kernel reads them back).
__device__ inline void zero_dbias_rows(const BackwardParams& p, int b, int hb_lo, int hb_hi, std::int64_t k0, int keys,
                                       std::int64_t lo, std::int64_t hi, int tid, int threads) {
  constexpr int kRowThreads = 16;
  const int size = p.bias_float32 ? 4 : 2, per = 16 / size;
  const Operand& db = p.dbias;
  auto* base = static_cast<char*>(db.data);
  const bool vectors = reinterpret_cast<std::uintptr_t>(base) % 16 == 0 && db.sr * size % 16 == 0 &&
                       db.sh * size % 16 == 0 && db.sb * size % 16 == 0 && k0 * size % 16 == 0 && keys % per == 0;
  const int units = vectors ? keys / per : keys, width = vectors ? per : 1;
  const std::int64_t head0 = (p.db_batch == 1 ? 0 : b) * db.sb + k0;
  for (int hb = hb_lo; hb <= hb_hi; ++hb)
    for (int part = 0; part < 2; ++part) {
      const std::int64_t end = part == 0 ? lo : p.db_rows;
      for (std::int64_t i = (part == 0 ? 0 : hi) + tid / kRowThreads; i < end; i += threads / kRowThreads)
        for (int u = tid % kRowThreads; u < units; u += kRowThreads) {
          const std::int64_t at = head0 + hb * db.sh + i * db.sr + u * width;
          if (vectors)
            __stcs(reinterpret_cast<uint4*>(base + at * size), make_uint4(0, 0, 0, 0));
          else if (size == 4)
            __stcs(reinterpret_cast<float*>(base) + at, 0.0f);
          else
            __stcs(reinterpret_cast<unsigned short*>(base) + at, static_cast<unsigned short>(0));
        }
    }
}

}  // namespace dmattn::cuda
