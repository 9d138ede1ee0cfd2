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
#include <memory>
#include <string>
#include <vector>

namespace reshard::io {

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
  uint64_t size() const;
  /// Reads exactly `length` bytes at `offset`; Error(kDataLoss) naming the range on a short read.
  /// Thread-safe (pread).
  void pread(uint64_t offset, uint64_t length, void* dst) const;
  /// Writes exactly `length` bytes at `offset`.
  void pwrite(uint64_t offset, uint64_t length, const void* src);
  void fsync();
  void close();

 private:
  File(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};

/// A read-only shared mapping of a whole file (mmap PROT_READ, MAP_SHARED): the page-cache pages
/// themselves, so copying out of it is one copy with no system call per run. Bytes past the end
/// of the file as it is now must never be touched (SIGBUS): callers check sizes first.
class MappedFile {
 public:
  /// Maps the file; Error(kNotFound) when it does not exist, kInvalidArgument when mmap fails.
  explicit MappedFile(const std::string& path);
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

/// Mappings of a fixed list of files, each made on first use (thread-safe) and kept until the set
/// is destroyed. get() returns nullptr where a file cannot be mapped (the caller then reads).
class MappedFileSet {
 public:
  explicit MappedFileSet(std::vector<std::string> paths);
  ~MappedFileSet();
  const MappedFile* get(size_t i) const;

 private:
  std::vector<std::string> paths_;
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
/// "a/b" + "c" -> "a/b/c".
std::string join(const std::string& a, const std::string& b);
/// Last path component ("/x/step-10/" -> "step-10").
std::string base_name(const std::string& path);

}  // namespace reshard::io
