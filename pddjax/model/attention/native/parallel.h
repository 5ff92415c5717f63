// The task pool both native kernels share: tasks 0 .. total - 1 pulled from one counter by the
// calling thread and up to (the pool's threads - 1) helpers scheduled on XLA's intra-op pool (the
// calling thread is one of its threads: more helpers only contend; measured 1.3x slower). Returns
// once every task is done; a helper that starts late finds none left and touches nothing else.

#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace pddjax_native {

typedef float v8f __attribute__((vector_size(32)));

struct Tasks {
  int64_t total = 0;
  std::function<void(int64_t)> task;
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable cv;

  void work() {
    for (int64_t t; (t = next.fetch_add(1)) < total;) {
      task(t);
      if (done.fetch_add(1) + 1 == total) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};

inline void run_tasks(xla::ffi::ThreadPool& pool, int64_t total, std::function<void(int64_t)> task) {
  if (total <= 0) return;
  auto tasks = std::make_shared<Tasks>();
  tasks->total = total;
  tasks->task = std::move(task);
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads() - 1, 0), total - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([tasks] { tasks->work(); });
  tasks->work();
  std::unique_lock<std::mutex> lock(tasks->mu);
  tasks->cv.wait(lock, [&] { return tasks->done.load() == total; });
}

}  // namespace pddjax_native
