// io::WindowedWriter and File::pwritev: the bytes that reach the file, and where the writes fall.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <thread>
#include <cstdint>
#include <string>
#include <vector>

#include "io/file.h"
#include "reshard/error.h"
#include "unit/test_util.h"

namespace reshard::io {
namespace {

struct Write {
  uint64_t offset;
  std::string bytes;
};

// A byte pattern that differs at every offset of a few MB (so a range written twice, skipped or
// shifted shows).
std::string pattern(size_t n, uint32_t seed) {
  std::string s(n, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    s[i] = char(x >> 24);
  }
  return s;
}

TEST(WindowedWriter, WritesStartAndEndOnWindowBoundariesAndCarryEveryByteOnce) {
  const uint64_t window = 4096, start = 100;
  std::vector<Write> writes;
  WindowedWriter w(
      [&](uint64_t offset, const ByteRange* r, size_t n) {
        Write wr{offset, {}};
        for (size_t k = 0; k < n; ++k) wr.bytes.append(static_cast<const char*>(r[k].data), r[k].bytes);
        writes.push_back(wr);
      },
      start, window);
  const std::vector<size_t> sizes = {10, 5000, 0, 3, 9000, 1, 20000, 4096, 7};
  std::vector<std::string> parts;
  std::string expect;
  for (size_t k = 0; k < sizes.size(); ++k) {
    parts.push_back(pattern(sizes[k], uint32_t(k)));
    expect += parts.back();
  }
  uint64_t pos = start;
  for (const std::string& p : parts) {
    EXPECT_EQ(w.position(), pos);
    w.append(p.data(), p.size());
    pos += p.size();
  }
  // Everything up to the last boundary reached is out before finish().
  ASSERT_FALSE(writes.empty());
  EXPECT_EQ(writes.back().offset + writes.back().bytes.size(), (start + expect.size()) / window * window);
  w.finish();
  w.finish();  // idempotent: nothing more is written
  ASSERT_GE(writes.size(), 2u);
  std::string got;
  uint64_t next = start;
  for (size_t k = 0; k < writes.size(); ++k) {
    EXPECT_EQ(writes[k].offset, next) << "write " << k;
    if (k > 0) {
      EXPECT_EQ(writes[k].offset % window, 0u) << "write " << k;
    }
    const uint64_t end = writes[k].offset + writes[k].bytes.size();
    if (k + 1 < writes.size()) {
      EXPECT_EQ(end % window, 0u) << "write " << k;
    }
    next = end;
    got += writes[k].bytes;
  }
  EXPECT_EQ(next, start + expect.size());
  EXPECT_TRUE(got == expect) << "bytes differ";
}

TEST(WindowedWriter, OneLargeRangeGoesOutInOneWriteUpToTheLastBoundary) {
  std::vector<std::pair<uint64_t, uint64_t>> writes;
  WindowedWriter w([&](uint64_t offset, const ByteRange* r, size_t n) {
    uint64_t b = 0;
    for (size_t k = 0; k < n; ++k) b += r[k].bytes;
    writes.push_back({offset, b});
  }, 0, 1000);
  const std::string big = pattern(10500, 3);
  w.append(big.data(), big.size());
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0], std::make_pair(uint64_t(0), uint64_t(10000)));
  w.finish();
  ASSERT_EQ(writes.size(), 2u);
  EXPECT_EQ(writes[1], std::make_pair(uint64_t(10000), uint64_t(500)));
}

TEST(WindowedWriter, FileHoldsExactlyTheAppendedBytesWithMoreRangesThanOneSystemCallTakes) {
  const std::string dir = testing::make_temp_dir("io_file_test");
  const std::string path = join(dir, "out.bin");
  std::vector<std::string> parts;
  std::string expect;
  // More than IOV_MAX ranges inside one window: File::pwritev must split them over calls.
  for (int k = 0; k < 3 * IOV_MAX; ++k) {
    parts.push_back(pattern(size_t(1 + k % 7), uint32_t(k)));
    expect += parts.back();
  }
  parts.push_back(pattern(300000, 99));
  expect += parts.back();
  {
    File f = File::create(path);
    WindowedWriter w(f, 0, uint64_t(1) << 16);
    for (const std::string& p : parts) w.append(p.data(), p.size());
    w.finish();
    f.close();
  }
  EXPECT_EQ(file_size(path), expect.size());
  EXPECT_TRUE(read_text(path) == expect) << "file content differs from the appended bytes";
  remove_all(dir);
}


TEST(WindowedWriter, AFullDeviceFailsWithDataLossNamingThePathAndTheBytesNotWritten) {
  // /dev/full refuses every write with ENOSPC.
  if (!is_file("/dev/full") && !exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  File f = File::create("/dev/full");
  WindowedWriter w(f, 0, 4096);
  const std::string data = pattern(10000, 5);
  try {
    w.append(data.data(), data.size());
    w.finish();
    FAIL() << "writing to /dev/full succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDataLoss) << e.what();
    const std::string msg = e.what();
    EXPECT_NE(msg.find("/dev/full"), std::string::npos) << msg;
    EXPECT_NE(msg.find("bytes [0, 8192)"), std::string::npos) << msg;  // the first window-aligned write
  }
}

TEST(FolderLock, SerialisesWritersAcrossThreadsAndTimesOutNamingTheHolder) {
  const std::string dir = reshard::testing::make_temp_dir("reshard-lock-");
  {
    FolderLock first(dir, "saving step a to " + dir, 1.0);
    ASSERT_TRUE(first.held());
    // Another open file description in the same process is another writer: it waits, then fails.
    try {
      FolderLock second(dir, "saving step b", 0.2);
      FAIL() << "a second writer got the lock";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kFailedPrecondition);
      const std::string w = e.what();
      EXPECT_NE(w.find("saving step b: another writer holds " + dir + "/.reshard-lock (pid "), std::string::npos) << w;
      EXPECT_NE(w.find("saving step a to " + dir), std::string::npos) << w;
    }
  }
  // Released when the holder goes: the next writer gets it at once, and a waiting one gets it
  // when the holder finishes.
  std::atomic<int> inside{0}, most{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t)
    ts.emplace_back([&] {
      FolderLock l(dir, "writer", 30.0);
      const int now = ++inside;
      int m = most.load();
      while (now > m && !most.compare_exchange_weak(m, now)) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      --inside;
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(most.load(), 1);
  EXPECT_FALSE(exists(join(dir, ".reshard-lock")));  // the last holder removed it as it let go
  remove_all(dir);
}

}  // namespace
}  // namespace reshard::io
