// A small POSIX file: positioned reads and writes that loop over EINTR and short transfers, and
// the fsyncs an atomic save needs. Errors are reshard::Error naming the path (and byte range):
//   kNotFound        the file or folder does not exist;
//   kDataLoss        a read ends before the requested range (truncated file) or the device fails
//                    (EIO, ENOSPC, ...);
//   kInvalidArgument anything else the path itself is to blame for (permissions, a folder where a
//                    file is expected, ...).
// Units: bytes.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace reshard::io {

/// `bytes` bytes at `data` (caller-owned).
struct ByteRange {
  const void* data;
  uint64_t bytes;
};

class File {
 public:
  /// Opens an existing file read-only.
  static File open_read(const std::string& path);
  /// Creates (or truncates) a file for writing, mode 0644.
  static File create(const std::string& path);

  File() = default;
  File(File&& o) noexcept;
  File& operator=(File&& o) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  const std::string& path() const { return path_; }
  bool is_open() const { return fd_ >= 0; }
  /// The descriptor (-1 when closed); it stays owned by this File.
  int fd() const { return fd_; }
  uint64_t size() const;
  /// Size and last modification (ns since the epoch) of the open file (fstat).
  struct Stamp {
    uint64_t size = 0;
    int64_t mtime_ns = 0;
    bool operator==(const Stamp& o) const { return size == o.size && mtime_ns == o.mtime_ns; }
  };
  Stamp stamp() const;
  /// Reads exactly `length` bytes at `offset`; Error(kDataLoss) naming the range on a short read.
  /// Thread-safe (pread).
  void pread(uint64_t offset, uint64_t length, void* dst) const;
  /// Writes exactly `length` bytes at `offset`.
  void pwrite(uint64_t offset, uint64_t length, const void* src);
  /// Writes the ranges one after the other from `offset` on (pwritev; at most IOV_MAX ranges
  /// per call), all of them.
  void pwritev(uint64_t offset, const ByteRange* ranges, size_t count);
  void fsync();
  void close();

 private:
  File(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};

/// Writes a file front to back from caller-owned byte ranges without copying them, in system
/// calls (pwritev) that start and end on multiples of `window` bytes of the file (8 MiB by
/// default; only the file's last write ends elsewhere).
///
/// Why: Linux sizes the page-cache folios a buffered write creates by the write's length and the
/// alignment of its file offset (filesystems with large folios: ext4 since 6.16, xfs, tmpfs with
/// huge=). A later read-only mapping (a warm load) maps a 2 MiB folio with one page fault and
/// smaller ones with one per folio or per 64 KiB. Per-tensor writes at arbitrary offsets cut a
/// run of small folios at every tensor boundary; window-aligned writes do not. See
/// docs/design.md.
///
/// Ranges passed to append() must stay valid and unchanged until finish(). A writer destroyed
/// without finish() (a save that failed part way) drops what it still queues: at most one
/// window. Errors as File::pwrite, naming the path and byte range.
class WindowedWriter {
 public:
  /// The sink one write goes to: (file offset, ranges, count). Tests replace it to see the
  /// writes; the default is pwritev on `file`, looping over short writes and EINTR.
  using Sink = std::function<void(uint64_t offset, const ByteRange* ranges, size_t count)>;
  static constexpr uint64_t kDefaultWindow = uint64_t(8) << 20;

  /// Writes `file` from byte `start` on.
  explicit WindowedWriter(File& file, uint64_t start = 0, uint64_t window = kDefaultWindow);
  WindowedWriter(Sink sink, uint64_t start, uint64_t window);
  /// Queues `bytes` bytes at `data` as the next bytes of the file; writes every whole window
  /// now complete.
  void append(const void* data, uint64_t bytes);
  /// Writes what is queued. Idempotent.
  void finish();
  /// File offset of the next appended byte.
  uint64_t position() const { return pos_ + queued_; }

 private:
  void write_front(uint64_t bytes);
  Sink sink_;
  uint64_t window_;
  uint64_t pos_;          // file offset of the first queued byte
  uint64_t queued_ = 0;   // bytes queued
  std::vector<ByteRange> q_;  // queued ranges; q_[0] starts `skip_` bytes in
  uint64_t skip_ = 0;
};

/// A read-only shared mapping of a whole file (mmap PROT_READ, MAP_SHARED): the page-cache pages
/// themselves, so copying out of it is one copy with no system call per run. Bytes past the end
/// of the file as it is now must never be touched (SIGBUS): callers check sizes first.
class MappedFile {
 public:
  /// Maps the file; Error(kNotFound) when it does not exist, kInvalidArgument when mmap fails.
  explicit MappedFile(const std::string& path);
  /// Maps the file open as `fd` (not closed here): the bytes of the file that `fd` was opened on,
  /// also after its path was renamed or replaced. `path` is for messages.
  MappedFile(int fd, const std::string& path);
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  void map(int fd, const std::string& path);
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

/// Drops this process's page mappings of the pages holding [p, p + bytes) of a MappedFile
/// (madvise MADV_DONTNEED). The page cache keeps the pages and the mapping stays valid: a later
/// touch, by any thread, faults them in again (so dropping a page another copy still reads costs
/// time, never correctness). Loads call it on source bytes they are done with, so the mapped part
/// of a rank's RSS is what its copies are reading now, not every file page it has read (a 2 GB
/// load's RSS would otherwise grow by the bytes it reads). Advisory: nothing happens where
/// madvise fails.
void drop_mapped_pages(const uint8_t* p, uint64_t bytes);

/// Mappings of a fixed list of files, each made on first use (thread-safe) and kept until the set
/// is destroyed. get() returns nullptr where a file cannot be mapped (the caller then reads).
class MappedFileSet {
 public:
  /// Each file is mapped on its first get(): through fd_of(i) when given (a descriptor the caller
  /// keeps open, so the mapping holds the same file as the caller's reads, whatever its path names
  /// by then; fd_of may throw, and get() then returns nullptr), else by opening paths[i].
  explicit MappedFileSet(std::vector<std::string> paths, std::function<int(size_t)> fd_of = nullptr);
  ~MappedFileSet();
  const MappedFile* get(size_t i) const;
  /// drop_mapped_pages over every file mapped so far (thread-safe; the mappings stay valid).
  void drop_all() const;

 private:
  std::vector<std::string> paths_;
  std::function<int(size_t)> fd_of_;
  struct Slot;
  std::unique_ptr<Slot[]> slots_;
};

/// fsync of a folder (makes renames and new entries in it durable).
void fsync_dir(const std::string& path);
bool exists(const std::string& path);
bool is_dir(const std::string& path);
bool is_file(const std::string& path);
/// Size of a regular file; Error(kNotFound) when it does not exist.
uint64_t file_size(const std::string& path);
/// Entry names of a folder (no "." or ".."), sorted.
std::vector<std::string> list_dir(const std::string& path);
/// Creates a folder and its parents (mode 0755); fine if it exists.
void make_dirs(const std::string& path);
/// rename(2); Error naming both paths.
void rename_path(const std::string& from, const std::string& to);
/// Atomically exchanges two existing paths (renameat2 RENAME_EXCHANGE). Returns false when the
/// filesystem does not support it (the caller falls back); throws on other errors.
bool exchange_paths(const std::string& a, const std::string& b);
/// Removes a file or a folder tree; fine if it does not exist.
void remove_all(const std::string& path);
/// Whole file as a string (metadata, `latest`); Error(kInvalidArgument) above max_bytes.
std::string read_text(const std::string& path, uint64_t max_bytes = uint64_t(1) << 30);
/// Writes a whole file and fsyncs it.
void write_text(const std::string& path, const std::string& text);
/// An exclusive lock on a folder that writers of one checkpoint root take around a whole save
/// (an open-file-description lock, fcntl F_OFD_SETLK, on FOLDER/.reshard-lock; flock where OFD
/// locks are not supported). Held until destroyed. Cooperating writers in any process or thread
/// are serialised: a second one waits, up to `timeout_s` seconds, then fails with
/// Error(kFailedPrecondition) naming the folder and the holder (pid, host, what it is doing, as the
/// holder wrote them into the lock file). On a filesystem that supports neither lock kind the lock
/// is not taken and `held()` is false (nothing serialises writers there; docs/format.md).
/// The holder removes the lock file as it lets go (a writer killed while holding it leaves it,
/// unlocked, for the next one); a writer that locked a file since removed opens the path again,
/// so two writers never hold it at once. Errors creating it (a read-only folder) are Error
/// naming the path.
class FolderLock {
 public:
  FolderLock(const std::string& folder, const std::string& what, double timeout_s);
  ~FolderLock();
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;
  bool held() const { return held_; }

 private:
  std::string path_;
  int fd_ = -1;
  bool held_ = false;
};

/// "a/b" + "c" -> "a/b/c".
std::string join(const std::string& a, const std::string& b);
/// Last path component ("/x/step-10/" -> "step-10").
std::string base_name(const std::string& path);

}  // namespace reshard::io
