// Work items of one FFI call, run by the calling thread and by helpers scheduled on XLA's intra-op thread pool:
// each takes the next item from a shared counter; the call returns once every item is done. Shared by the
// native kernels (paged_attention.cc, matmul.cc).

#ifndef JAXSERVE_NATIVE_RUN_ITEMS_H_
#define JAXSERVE_NATIVE_RUN_ITEMS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

struct SharedItems {
  std::function<void(int64_t)> run;
  int64_t items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

inline void DrainItems(SharedItems& sh) {
  for (int64_t i; (i = sh.next.fetch_add(1)) < sh.items;) {
    sh.run(i);
    sh.done.fetch_add(1, std::memory_order_release);
  }
}

inline void RunItems(xla::ffi::ThreadPool& threads, int64_t items, std::function<void(int64_t)> run) {
  auto shared = std::make_shared<SharedItems>();
  shared->run = std::move(run);
  shared->items = items;
  const int64_t helpers = std::min<int64_t>(threads.num_threads(), items - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    threads.Schedule([shared] { DrainItems(*shared); });
  }
  DrainItems(*shared);
  while (shared->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

}  // namespace jaxserve

#endif  // JAXSERVE_NATIVE_RUN_ITEMS_H_
