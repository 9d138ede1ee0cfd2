// ByteSource implementations: memory (tests, fuzzing) and pread-backed files.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "reshard/error.h"
#include "reshard/torch_archive.h"

namespace reshard::pt {

void MemorySource::read(uint64_t offset, uint64_t len, void* dst) const {
  if (offset > size_ || len > size_ - offset)
    fail(ErrorCode::kDataLoss, "read of ", len, " bytes at offset ", offset,
         " is outside the ", size_, "-byte buffer");
  if (len) std::memcpy(dst, data_ + offset, size_t(len));
}

FileSource::FileSource(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) {
    int e = errno;
    fail(e == ENOENT ? ErrorCode::kNotFound : ErrorCode::kInvalidArgument, path,
         ": cannot open: ", std::strerror(e));
  }
  struct stat st;
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    fail(ErrorCode::kInvalidArgument, path, ": not a regular file");
  }
  size_ = uint64_t(st.st_size);
}

FileSource::~FileSource() {
  if (fd_ >= 0) ::close(fd_);
}

void FileSource::read(uint64_t offset, uint64_t len, void* dst) const {
  if (offset > size_ || len > size_ - offset)
    fail(ErrorCode::kDataLoss, path_, ": read of ", len, " bytes at offset ", offset,
         " is past the end of the ", size_, "-byte file");
  auto* p = static_cast<uint8_t*>(dst);
  while (len > 0) {
    size_t chunk = size_t(len < (uint64_t(1) << 30) ? len : (uint64_t(1) << 30));
    ssize_t n = ::pread(fd_, p, chunk, off_t(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(ErrorCode::kDataLoss, path_, ": read failed at offset ", offset, ": ",
           std::strerror(errno));
    }
    if (n == 0)
      fail(ErrorCode::kDataLoss, path_, ": unexpected end of file at offset ", offset,
           " (file shrank while reading?)");
    p += n;
    offset += uint64_t(n);
    len -= uint64_t(n);
  }
}

}  // namespace reshard::pt
