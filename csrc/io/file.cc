#include "io/file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <chrono>
#include <mutex>
#include <thread>

#include "reshard/error.h"

#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1)
#endif

namespace reshard::io {
namespace {

[[noreturn]] void fail_errno(int err, const std::string& what) {
  ErrorCode code = ErrorCode::kInvalidArgument;
  if (err == ENOENT || err == ENOTDIR) code = ErrorCode::kNotFound;
  else if (err == EIO || err == ENOSPC || err == EDQUOT || err == EROFS || err == ESTALE) code = ErrorCode::kDataLoss;
  fail(code, what, ": ", std::strerror(err));
}

std::string range(uint64_t offset, uint64_t length) {
  return "bytes [" + std::to_string(offset) + ", " + std::to_string(offset + length) + ")";
}

}  // namespace

namespace {

// Opens a regular file for reading. O_NONBLOCK keeps the open of a FIFO from waiting forever for
// a writer (a checkpoint file replaced by a FIFO, or a link to one or to a device such as
// /dev/zero, is refused by name instead of hanging or reading without end); it is cleared again,
// as it means nothing for regular files. Symbolic links are followed (docs/reliability.md).
int open_regular(const std::string& path) {
  int fd;
  do fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  while (fd < 0 && errno == EINTR);
  if (fd < 0) fail_errno(errno, "cannot open " + path + " for reading");
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    fail_errno(e, "cannot stat " + path);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(ErrorCode::kInvalidArgument, "cannot open ", path, " for reading: it is ",
         S_ISDIR(st.st_mode) ? "a folder" : S_ISFIFO(st.st_mode) ? "a FIFO" : S_ISSOCK(st.st_mode) ? "a socket" : "a device",
         ", not a regular file");
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

}  // namespace

File File::open_read(const std::string& path) { return File(open_regular(path), path); }

MappedFile::MappedFile(const std::string& path) {
  const int fd = open_regular(path);
  try {
    map(fd, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);  // the mapping keeps the file
}

MappedFile::MappedFile(int fd, const std::string& path) { map(fd, path); }

void MappedFile::map(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) fail(ErrorCode::kInvalidArgument, "cannot map ", path, ": not a regular file");
  size_ = uint64_t(st.st_size);
  if (size_ == 0) return;
  void* p = ::mmap(nullptr, size_t(size_), PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) fail(ErrorCode::kInvalidArgument, "cannot map ", path, " (", size_, " bytes): ", std::strerror(errno));
  data_ = static_cast<uint8_t*>(p);
#ifdef MADV_HUGEPAGE
  // Advisory: pages the load faults in from disk are read into 2 MiB folios where the filesystem
  // has large folios, so they are mapped (and unmapped) 2 MiB at a time (see WindowedWriter).
  ::madvise(p, size_t(size_), MADV_HUGEPAGE);
#endif
}

void drop_mapped_pages(const uint8_t* p, uint64_t bytes) {
  if (bytes == 0) return;
  static const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes + page - 1) / page * page;
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), size_t(end - begin), MADV_DONTNEED);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(data_, size_t(size_));
}

struct MappedFileSet::Slot {
  std::once_flag once;
  std::unique_ptr<MappedFile> map;
  std::atomic<const MappedFile*> ready{nullptr};  // map, once made (read by drop_all)
};

MappedFileSet::MappedFileSet(std::vector<std::string> paths, std::function<int(size_t)> fd_of)
    : paths_(std::move(paths)), fd_of_(std::move(fd_of)), slots_(new Slot[paths_.size()]) {}

MappedFileSet::~MappedFileSet() = default;

const MappedFile* MappedFileSet::get(size_t i) const {
  if (i >= paths_.size()) return nullptr;
  Slot& s = slots_[i];
  std::call_once(s.once, [&] {
    try {
      s.map = fd_of_ ? std::make_unique<MappedFile>(fd_of_(i), paths_[i]) : std::make_unique<MappedFile>(paths_[i]);
    } catch (const Error&) {
      s.map.reset();  // missing or unmappable: read() reports it precisely
    }
    s.ready.store(s.map.get(), std::memory_order_release);
  });
  return s.map.get();
}

void MappedFileSet::drop_all() const {
  for (size_t i = 0; i < paths_.size(); ++i)
    if (const MappedFile* m = slots_[i].ready.load(std::memory_order_acquire)) drop_mapped_pages(m->data(), m->size());
}

File File::create(const std::string& path) {
  int fd;
  do fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  while (fd < 0 && errno == EINTR);
  if (fd < 0) fail_errno(errno, "cannot create " + path);
  return File(fd, path);
}

File::File(File&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)) { o.fd_ = -1; }

File& File::operator=(File&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    path_ = std::move(o.path_);
    o.fd_ = -1;
  }
  return *this;
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

void File::close() {
  if (fd_ < 0) return;
  int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0 && errno != EINTR) fail_errno(errno, "cannot close " + path_);
}

uint64_t File::size() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) fail_errno(errno, "cannot stat " + path_);
  return uint64_t(st.st_size);
}

File::Stamp File::stamp() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) fail_errno(errno, "cannot stat " + path_);
  return {uint64_t(st.st_size), int64_t(st.st_mtim.tv_sec) * 1000000000 + int64_t(st.st_mtim.tv_nsec)};
}

void File::pread(uint64_t offset, uint64_t length, void* dst) const {
  char* p = static_cast<char*>(dst);
  uint64_t done = 0;
  while (done < length) {
    size_t chunk = size_t(std::min<uint64_t>(length - done, uint64_t(1) << 30));
    ssize_t n = ::pread(fd_, p + done, chunk, off_t(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_errno(errno, "cannot read " + range(offset, length) + " of " + path_);
    }
    if (n == 0)
      fail(ErrorCode::kDataLoss, "short read of ", path_, ": ", range(offset, length), " requested, file ends at byte ",
           offset + done, " (truncated?)");
    done += uint64_t(n);
  }
}

void File::pwrite(uint64_t offset, uint64_t length, const void* src) {
  const char* p = static_cast<const char*>(src);
  uint64_t done = 0;
  while (done < length) {
    size_t chunk = size_t(std::min<uint64_t>(length - done, uint64_t(1) << 30));
    ssize_t n = ::pwrite(fd_, p + done, chunk, off_t(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_errno(errno, "cannot write " + range(offset, length) + " of " + path_);
    }
    if (n == 0) fail(ErrorCode::kDataLoss, "cannot write ", range(offset, length), " of ", path_, ": no progress");
    done += uint64_t(n);
  }
}

WindowedWriter::WindowedWriter(Sink sink, uint64_t start, uint64_t window)
    : sink_(std::move(sink)), window_(window), pos_(start) {
  RESHARD_CHECK(window_ > 0, "WindowedWriter window must be positive");
}

WindowedWriter::WindowedWriter(File& file, uint64_t start, uint64_t window)
    : WindowedWriter(
          [&file](uint64_t offset, const ByteRange* ranges, size_t count) { file.pwritev(offset, ranges, count); },
          start, window) {}

void WindowedWriter::append(const void* data, uint64_t bytes) {
  if (bytes == 0) return;
  q_.push_back({data, bytes});
  queued_ += bytes;
  // Everything up to the last window boundary the queue reaches goes out in one write.
  const uint64_t end = (pos_ + queued_) / window_ * window_;
  if (end > pos_) write_front(end - pos_);
}

void WindowedWriter::finish() {
  if (queued_ > 0) write_front(queued_);
}

void WindowedWriter::write_front(uint64_t bytes) {
  std::vector<ByteRange> out;
  uint64_t left = bytes;
  size_t i = 0;
  uint64_t skip = skip_;
  while (left > 0) {
    const ByteRange& r = q_[i];
    const uint64_t take = std::min(left, r.bytes - skip);
    out.push_back({static_cast<const uint8_t*>(r.data) + skip, take});
    left -= take;
    if (skip + take == r.bytes) {
      ++i;
      skip = 0;
    } else {
      skip += take;
    }
  }
  sink_(pos_, out.data(), out.size());
  q_.erase(q_.begin(), q_.begin() + std::ptrdiff_t(i));
  skip_ = skip;
  pos_ += bytes;
  queued_ -= bytes;
}

void File::pwritev(uint64_t offset, const ByteRange* r, size_t count) {
  std::vector<iovec> iov(count);
  uint64_t total = 0;
  for (size_t k = 0; k < count; ++k) {
    iov[k] = {const_cast<void*>(r[k].data), size_t(r[k].bytes)};
    total += r[k].bytes;
  }
  size_t first = 0;
  uint64_t done = 0;
  while (first < count) {
    if (iov[first].iov_len == 0) {
      ++first;
      continue;
    }
    const int n_iov = int(std::min<size_t>(count - first, IOV_MAX));
    ssize_t n = ::pwritev(fd_, iov.data() + first, n_iov, off_t(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_errno(errno, "cannot write " + range(offset + done, total - done) + " of " + path_);
    }
    if (n == 0)
      fail(ErrorCode::kDataLoss, "cannot write ", range(offset + done, total - done), " of ", path_, ": no progress");
    done += uint64_t(n);
    // Skip what was written: whole ranges, then part of the next.
    size_t left = size_t(n);
    while (first < count && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (left > 0) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
}

void File::fsync() {
  while (::fsync(fd_) != 0) {
    if (errno == EINTR) continue;
    fail_errno(errno, "cannot fsync " + path_);
  }
}

void fsync_dir(const std::string& path) {
  int fd;
  do fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  while (fd < 0 && errno == EINTR);
  if (fd < 0) fail_errno(errno, "cannot open folder " + path + " to fsync it");
  int rc;
  do rc = ::fsync(fd);
  while (rc != 0 && errno == EINTR);
  int err = errno;
  ::close(fd);
  // Some filesystems refuse fsync on folders (EINVAL); their renames are durable by other means.
  if (rc != 0 && err != EINVAL && err != EROFS) fail_errno(err, "cannot fsync folder " + path);
}

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool is_dir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_file(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

uint64_t file_size(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) fail_errno(errno, "cannot stat " + path);
  return uint64_t(st.st_size);
}

std::vector<std::string> list_dir(const std::string& path) {
  DIR* d = ::opendir(path.c_str());
  if (!d) fail_errno(errno, "cannot list folder " + path);
  std::vector<std::string> out;
  while (struct dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") out.push_back(n);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

void make_dirs(const std::string& path) {
  if (path.empty() || is_dir(path)) return;
  auto slash = path.find_last_of('/');
  if (slash != std::string::npos && slash > 0) make_dirs(path.substr(0, slash));
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) fail_errno(errno, "cannot create folder " + path);
  if (!is_dir(path)) fail(ErrorCode::kInvalidArgument, "cannot create folder ", path, ": a file is in the way");
}

void rename_path(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) fail_errno(errno, "cannot rename " + from + " to " + to);
}

bool exchange_paths(const std::string& a, const std::string& b) {
#ifdef SYS_renameat2
  long rc = ::syscall(SYS_renameat2, AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE);
  if (rc == 0) return true;
  if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) return false;
  fail_errno(errno, "cannot exchange " + a + " and " + b);
#else
  return false;
#endif
}

void remove_all(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    fail_errno(errno, "cannot stat " + path);
  }
  if (S_ISDIR(st.st_mode)) {
    for (const auto& n : list_dir(path)) remove_all(join(path, n));
    if (::rmdir(path.c_str()) != 0 && errno != ENOENT) fail_errno(errno, "cannot remove folder " + path);
  } else if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    fail_errno(errno, "cannot remove " + path);
  }
}

std::string read_text(const std::string& path, uint64_t max_bytes) {
  File f = File::open_read(path);
  uint64_t n = f.size();
  if (n > max_bytes) fail(ErrorCode::kInvalidArgument, path, " is ", n, " bytes, more than the limit of ", max_bytes);
  std::string s(size_t(n), '\0');
  f.pread(0, n, s.data());
  return s;
}

void write_text(const std::string& path, const std::string& text) {
  File f = File::create(path);
  f.pwrite(0, text.size(), text.data());
  f.fsync();
  f.close();
}

namespace {

// 1: locked; 0: held by another; -1: this filesystem supports no such lock.
int try_lock(int fd, bool ofd) {
  if (ofd) {
#ifdef F_OFD_SETLK
    struct flock fl {};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    if (fcntl(fd, F_OFD_SETLK, &fl) == 0) return 1;
    if (errno == EAGAIN || errno == EACCES || errno == EINTR) return 0;
#endif
    return -1;
  }
  if (flock(fd, LOCK_EX | LOCK_NB) == 0) return 1;
  if (errno == EWOULDBLOCK || errno == EINTR) return 0;
  return -1;
}

}  // namespace

FolderLock::FolderLock(const std::string& folder, const std::string& what, double timeout_s)
    : path_(join(folder, ".reshard-lock")) {
  const auto start = std::chrono::steady_clock::now();
  bool ofd = true;
  for (;;) {
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) fail_errno(errno, "cannot open the lock file " + path_);
    int got = try_lock(fd_, ofd);
    if (got < 0 && ofd) {
      ofd = false;
      got = try_lock(fd_, false);
    }
    if (got < 0) {  // no lock support here: unserialised (documented)
      ::close(fd_);
      fd_ = -1;
      return;
    }
    while (got == 0) {
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited >= timeout_s) {
        char holder[512] = {0};
        const ssize_t n = ::pread(fd_, holder, sizeof(holder) - 1, 0);
        std::string who = n > 0 ? std::string(holder, size_t(n)) : std::string("unknown");
        while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
        ::close(fd_);
        fd_ = -1;
        fail(ErrorCode::kFailedPrecondition, what, ": another writer holds ", path_, " (", who,
             ") and did not finish within ", timeout_s, " s; writers of one checkpoint folder run one at a time. "
             "Nothing was written: wait for it or write elsewhere");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      got = try_lock(fd_, ofd);
    }
    // The holder before us removes the file as it lets go; a lock on a removed file locks
    // nothing another writer can see, so lock the file the path names now.
    struct stat mine {}, named {};
    if (::fstat(fd_, &mine) == 0 && ::stat(path_.c_str(), &named) == 0 && mine.st_ino == named.st_ino &&
        mine.st_dev == named.st_dev)
      break;
    ::close(fd_);
    fd_ = -1;
  }
  held_ = true;
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  const std::string me = "pid " + std::to_string(getpid()) + " on " + host + ": " + what + "\n";
  if (::ftruncate(fd_, 0) == 0) {
    const ssize_t w = ::pwrite(fd_, me.data(), me.size(), 0);
    (void)w;  // the holder's description is for messages only
  }
}

FolderLock::~FolderLock() {
  if (fd_ < 0) return;
  // Removed while still held, so that no writer can lock this file after us and find it gone
  // (those waiting on it see the path name another file, or none, and open it again).
  if (held_) ::unlink(path_.c_str());
  ::close(fd_);  // closing the last descriptor releases both lock kinds
}

std::string join(const std::string& a, const std::string& b) {
  if (a.empty()) return b;
  if (a.back() == '/') return a + b;
  return a + "/" + b;
}

std::string base_name(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  auto slash = p.find_last_of('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

}  // namespace reshard::io
