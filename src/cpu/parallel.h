// The CPU backend's only threading primitive. Tasks own disjoint outputs, so
// results never depend on the thread count or the schedule.
#pragma once

#include <cstdint>
#include <functional>

namespace dmattn::cpu {

// Threads used: DMATTN_NUM_THREADS if set (>= 1), else the hardware concurrency.
int num_threads();

// Runs fn(task) for every task in [0, n) on up to num_threads() threads; the
// first exception thrown by a task is rethrown after all threads have stopped.
void parallel_for(std::int64_t n, const std::function<void(std::int64_t)>& fn);

}  // namespace dmattn::cpu
