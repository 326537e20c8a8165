// Work split over XLA's intra-op thread pool, shared by the CPU kernels in this folder.
//
// parallel_for(pool, tasks, body) runs body(t) for t in [0, tasks): the calling thread
// and up to kMaxThreads - 1 pool threads claim tasks in turn, so the
// result never waits on a busy pool (a pool thread that starts late finds nothing left).
// The caller then waits only for tasks other threads already claimed: it spins briefly,
// then yields the core, since the machine may have fewer cores free than the pool has
// threads. body is copied into each pool task; what it captures by value (shared
// pointers included) lives as long as the last copy.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jetserve {

constexpr int64_t kMaxThreads = 64;

template <typename Body>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t tasks, Body body) {
  struct Progress {
    std::atomic<int64_t> next{0};  // the next task to claim
    std::atomic<int64_t> done{0};  // tasks finished
  };
  auto progress = std::make_shared<Progress>();
  auto work = [progress, tasks, body]() {
    for (int64_t t; (t = progress->next.fetch_add(1)) < tasks;) {
      body(t);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t threads = std::clamp<int64_t>(pool.num_threads(), 1, kMaxThreads);
  for (int64_t i = 1; i < std::min(threads, tasks); ++i) pool.Schedule([work] { work(); });
  work();
  for (int spins = 0; progress->done.load(std::memory_order_acquire) < tasks; ++spins) {
    if (spins < 4096) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace jetserve
