#include "io/parallel.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "reshard/error.h"

namespace reshard {

int default_threads() {
  if (const char* env = std::getenv("RESHARD_THREADS")) {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (end == env || *end != '\0' || v < 1 || v > 1024)
      fail(ErrorCode::kInvalidArgument, "RESHARD_THREADS='", env, "' must be an integer 1..1024");
    return int(v);
  }
  return int(std::max(1u, std::min(8u, std::thread::hardware_concurrency())));
}

void parallel_for(size_t n, int threads, const std::function<void(size_t, int)>& fn) {
  if (n == 0) return;
  if (threads <= 0) threads = default_threads();
  const int t = int(std::min<size_t>(size_t(threads), n));
  std::atomic<size_t> next{0};
  std::mutex mu;
  std::exception_ptr first;
  auto worker = [&](int w) {
    for (size_t i; (i = next.fetch_add(1)) < n;) {
      try {
        fn(i, w);
      } catch (...) {
        std::lock_guard<std::mutex> g(mu);
        if (!first) first = std::current_exception();
        next = n;
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(size_t(t - 1));
  for (int w = 1; w < t; ++w) {
    try {
      pool.emplace_back(worker, w);
    } catch (const std::system_error&) {
      break;  // the threads already started, and this one, do the rest
    }
  }
  worker(0);
  for (auto& th : pool) th.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace reshard
