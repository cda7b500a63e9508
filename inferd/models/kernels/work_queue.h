// Work handed to threads as they become free, rather than split into equal shares up front. The two vCPUs of a
// VM need not run at the same speed: on the machines these kernels were measured on, one vCPU's AMX or vector
// throughput dropped to half the other's for minutes at a time (another tenant on the host core). With equal
// shares the step waits for the slow one; claimed a chunk at a time, the fast one takes more of the work.
// Included by the kernels (cpu_kernels.py puts this folder on the include path).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace inferd {

// Runs body(each) once on each of torch's threads (no more threads than items could keep busy); each(f) calls
// f(item) for every item the thread claims, until none is left. A thread claims ranges of consecutive items:
// ranges start at half an equal share and shrink as the work runs out, to at least `least` items. Early claims
// are long contiguous runs (a thread's prefetching runs on through them, as in an equal split), the last ones
// short enough to even out the threads' finishing times (guided scheduling).
//   parallel_claim(n, 4, [&](auto each) { set-up; each([&](int64_t i) { ... }); tear-down; });
// Per-thread set-up (buffers, tile configuration) goes in body around its call of each.
template <typename Body>
void parallel_claim(int64_t items, int64_t least, Body&& body) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (items + least - 1) / least));
  auto each = [&](auto&& f) {
    int64_t begin = next.load(std::memory_order_relaxed);
    while (begin < items) {
      const int64_t end = std::min(items, begin + std::max(least, (items - begin) / (2 * threads)));
      if (!next.compare_exchange_weak(begin, end, std::memory_order_relaxed)) continue;  // begin is reloaded
      for (int64_t i = begin; i < end; ++i) f(i);
      begin = next.load(std::memory_order_relaxed);
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(each); });
}

}  // namespace inferd
