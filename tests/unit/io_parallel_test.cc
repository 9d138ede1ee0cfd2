// reshard::parallel_for and default_threads (io/parallel.h): every index once, the thread count
// bounded, the first exception rethrown with its type, and RESHARD_THREADS as the one setting.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "io/parallel.h"
#include "reshard/error.h"

namespace reshard {
namespace {

TEST(Parallel, EveryIndexOnceOnAtMostTheThreadsAsked) {
  for (int threads : {1, 2, 3, 7}) {
    for (size_t n : {size_t(0), size_t(1), size_t(2), size_t(1000)}) {
      std::vector<std::atomic<int>> seen(n);
      std::mutex mu;
      std::set<int> workers;
      std::set<std::thread::id> ids;
      parallel_for(n, threads, [&](size_t i, int w) {
        seen[i].fetch_add(1);
        std::lock_guard<std::mutex> g(mu);
        workers.insert(w);
        ids.insert(std::this_thread::get_id());
      });
      for (size_t i = 0; i < n; ++i) EXPECT_EQ(seen[i].load(), 1) << "index " << i;
      EXPECT_LE(workers.size(), std::min<size_t>(size_t(threads), n));
      EXPECT_EQ(ids.size(), workers.size());  // one worker index per thread
      for (int w : workers) EXPECT_TRUE(w >= 0 && w < threads) << w;
    }
  }
}

TEST(Parallel, TheFirstErrorIsRethrownWithItsTypeAfterEveryThreadFinished) {
  std::atomic<int> running{0};
  try {
    parallel_for(64, 4, [&](size_t i, int) {
      running.fetch_add(1);
      if (i == 5) fail(ErrorCode::kDataLoss, "piece 5 is bad");
      running.fetch_sub(1);
    });
    FAIL() << "no exception";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
    EXPECT_NE(std::string(e.what()).find("piece 5 is bad"), std::string::npos);
  }
  EXPECT_EQ(running.load(), 1);  // only the failing call did not finish; no thread is still inside
  // On one thread the handing out visibly stops at the failure: indices 0-4 ran, none after 5.
  std::vector<size_t> ran;
  EXPECT_THROW(parallel_for(64, 1,
                            [&](size_t i, int) {
                              if (i == 5) fail(ErrorCode::kDataLoss, "bad");
                              ran.push_back(i);
                            }),
               Error);
  EXPECT_EQ(ran, (std::vector<size_t>{0, 1, 2, 3, 4}));
  EXPECT_THROW(parallel_for(3, 2, [](size_t, int) { throw std::runtime_error("x"); }), std::runtime_error);
}

TEST(Parallel, ReshardThreadsIsTheOneSetting) {
  const char* old = std::getenv("RESHARD_THREADS");
  const std::string saved = old ? old : "";
  ::unsetenv("RESHARD_THREADS");
  const int dflt = default_threads();
  EXPECT_GE(dflt, 1);
  EXPECT_LE(dflt, 8);
  ::setenv("RESHARD_THREADS", "3", 1);
  EXPECT_EQ(default_threads(), 3);
  std::set<int> workers;
  std::mutex mu;
  parallel_for(100, 0, [&](size_t, int w) {  // 0: the default
    std::lock_guard<std::mutex> g(mu);
    workers.insert(w);
  });
  EXPECT_LE(workers.size(), 3u);
  for (const char* bad : {"0", "-1", "1025", "four", "2x", ""}) {
    ::setenv("RESHARD_THREADS", bad, 1);
    try {
      default_threads();
      ADD_FAILURE() << "accepted RESHARD_THREADS='" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("RESHARD_THREADS"), std::string::npos) << e.what();
    }
  }
  if (old) ::setenv("RESHARD_THREADS", saved.c_str(), 1);
  else ::unsetenv("RESHARD_THREADS");
}

}  // namespace
}  // namespace reshard
