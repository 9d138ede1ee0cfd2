// NCCL communicator: all-to-all-v as grouped ncclSend/ncclRecv in rounds of bounded chunks,
// broadcast (ncclBroadcast over the whole world, grouped send/recv within a subgroup), all-gather
// of strings through a byte all-gather, all-reduce of int64, barrier. Host-pointer calls are staged
// through device buffers. No torch here.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "reshard/comm_nccl.h"
#include "reshard/error.h"

namespace reshard {
namespace {

using Clock = std::chrono::steady_clock;

std::string rank_prefix(int rank, int size) {
  return "[rank " + std::to_string(rank) + "/" + std::to_string(size) + "] ";
}

[[noreturn]] void nccl_fail(const std::string& pre, const char* what, ncclResult_t r, ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  fail(ErrorCode::kInternal, pre, what, " failed: ", ncclGetErrorString(r),
       (last && *last) ? std::string(" (") + last + ")" : std::string());
}
[[noreturn]] void cuda_fail(const std::string& pre, const char* what, cudaError_t e) {
  fail(ErrorCode::kInternal, pre, what, " failed: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
}

#define NCCL_CHECK(call)                                                           \
  do {                                                                             \
    ncclResult_t nccl_r_ = (call);                                                 \
    if (nccl_r_ != ncclSuccess && nccl_r_ != ncclInProgress)                       \
      nccl_fail(prefix(), #call, nccl_r_, comm_);                                  \
  } while (0)
#define CUDA_CHECK(call)                                                           \
  do {                                                                             \
    cudaError_t cuda_e_ = (call);                                                  \
    if (cuda_e_ != cudaSuccess) cuda_fail(prefix(), #call, cuda_e_);               \
  } while (0)

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&prev_);
    if (prev_ != device) cudaSetDevice(device);
    else prev_ = -1;
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
};

class NcclComm final : public NcclCommunicator {
 public:
  NcclComm(const std::string& id, int rank, int size, const NcclOptions& opt) : rank_(rank), size_(size), opt_(opt) {
    if (id.size() != NCCL_UNIQUE_ID_BYTES)
      fail(ErrorCode::kInvalidArgument, prefix(), "NCCL unique id must be ", NCCL_UNIQUE_ID_BYTES, " bytes, got ",
           id.size());
    if (size < 1 || rank < 0 || rank >= size)
      fail(ErrorCode::kInvalidArgument, prefix(), "bad rank/size for the NCCL communicator");
    device_ = opt.device;
    if (device_ < 0) CUDA_CHECK(cudaGetDevice(&device_));
    DeviceGuard g(device_);
    CUDA_CHECK(cudaSetDevice(device_));
    ncclUniqueId uid;
    std::memcpy(uid.internal, id.data(), NCCL_UNIQUE_ID_BYTES);
    ncclResult_t r = ncclCommInitRank(&comm_, size, uid, rank);
    if (r != ncclSuccess) nccl_fail(prefix(), "ncclCommInitRank", r, nullptr);
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    staging_ = std::max<uint64_t>(opt.staging_bytes, uint64_t(size) * 4096);
    CUDA_CHECK(cudaMalloc(&d_send_, staging_));
    CUDA_CHECK(cudaMalloc(&d_recv_, staging_));
    CUDA_CHECK(cudaMalloc(&d_small_, 2 * sizeof(int64_t) * size_t(size)));
    int v = 0;
    ncclGetVersion(&v);
    version_ = std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
  }

  ~NcclComm() override {
    DeviceGuard g(device_);
    if (stream_) cudaStreamSynchronize(stream_);
    if (comm_) {
      if (aborted_) ncclCommAbort(comm_);
      else ncclCommDestroy(comm_);
    }
    if (stream_) cudaStreamDestroy(stream_);
    cudaFree(d_send_);
    cudaFree(d_recv_);
    cudaFree(d_small_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "nccl"; }
  std::string nccl_version() const override { return version_; }
  int device() const override { return device_; }

  void all_to_all_v(const void* send, const std::vector<uint64_t>& sc, const std::vector<uint64_t>& sd, void* recv,
                    const std::vector<uint64_t>& rc, const std::vector<uint64_t>& rd) override {
    DeviceGuard g(device_);
    check_counts(sc, sd, rc, rd);
    const uint64_t rounds = agree_rounds(sc, rc, per_peer());
    const uint64_t q = per_peer();
    const auto* s = static_cast<const uint8_t*>(send);
    auto* r = static_cast<uint8_t*>(recv);
    // Self part stays on the host.
    if (sc[rank_]) std::memmove(r + rd[rank_], s + sd[rank_], sc[rank_]);
    for (uint64_t k = 0; k < rounds; ++k) {
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        const uint64_t n = piece(sc[p], k, q);
        if (n) CUDA_CHECK(cudaMemcpyAsync(d_send_ + uint64_t(p) * q, s + sd[p] + k * q, n, cudaMemcpyHostToDevice, stream_));
      }
      NCCL_CHECK(ncclGroupStart());
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        const uint64_t ns = piece(sc[p], k, q), nr = piece(rc[p], k, q);
        if (ns) NCCL_CHECK(ncclSend(d_send_ + uint64_t(p) * q, ns, ncclUint8, p, comm_, stream_));
        if (nr) NCCL_CHECK(ncclRecv(d_recv_ + uint64_t(p) * q, nr, ncclUint8, p, comm_, stream_));
      }
      NCCL_CHECK(ncclGroupEnd());
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        const uint64_t n = piece(rc[p], k, q);
        if (n) CUDA_CHECK(cudaMemcpyAsync(r + rd[p] + k * q, d_recv_ + uint64_t(p) * q, n, cudaMemcpyDeviceToHost, stream_));
      }
      wait("all_to_all_v");
    }
  }

  void all_to_all_v_device(const void* send, const std::vector<uint64_t>& sc, const std::vector<uint64_t>& sd,
                           void* recv, const std::vector<uint64_t>& rc, const std::vector<uint64_t>& rd,
                           void* stream) override {
    DeviceGuard g(device_);
    check_counts(sc, sd, rc, rd);
    cudaStream_t st = stream ? static_cast<cudaStream_t>(stream) : stream_;
    const auto* s = static_cast<const uint8_t*>(send);
    auto* r = static_cast<uint8_t*>(recv);
    // NCCL counts are size_t; chunk anyway so that one call never posts an unbounded message.
    const uint64_t q = uint64_t(1) << 30;
    const uint64_t rounds = agree_rounds(sc, rc, q);
    if (sc[rank_]) CUDA_CHECK(cudaMemcpyAsync(r + rd[rank_], s + sd[rank_], sc[rank_], cudaMemcpyDeviceToDevice, st));
    for (uint64_t k = 0; k < rounds; ++k) {
      NCCL_CHECK(ncclGroupStart());
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        const uint64_t ns = piece(sc[p], k, q), nr = piece(rc[p], k, q);
        if (ns) NCCL_CHECK(ncclSend(s + sd[p] + k * q, ns, ncclUint8, p, comm_, st));
        if (nr) NCCL_CHECK(ncclRecv(r + rd[p] + k * q, nr, ncclUint8, p, comm_, st));
      }
      NCCL_CHECK(ncclGroupEnd());
    }
    wait("all_to_all_v_device", st);
  }

  void broadcast(void* data, uint64_t bytes, int root, const std::vector<int>& group) override {
    DeviceGuard g(device_);
    bool has_me = false, has_root = false;
    for (size_t i = 0; i < group.size(); ++i) {
      if (group[i] < 0 || group[i] >= size_ || (i && group[i] <= group[i - 1]))
        fail(ErrorCode::kInvalidArgument, prefix(), "broadcast group must be sorted ranks of the communicator");
      has_me |= group[i] == rank_;
      has_root |= group[i] == root;
    }
    if (!has_me || !has_root)
      fail(ErrorCode::kInvalidArgument, prefix(), "broadcast group must contain the caller and root ", root);
    if (group.size() == 1 || bytes == 0) return;
    auto* p = static_cast<uint8_t*>(data);
    const bool whole = int(group.size()) == size_;
    for (uint64_t off = 0; off < bytes; off += staging_) {
      const uint64_t n = std::min(staging_, bytes - off);
      if (rank_ == root) CUDA_CHECK(cudaMemcpyAsync(d_send_, p + off, n, cudaMemcpyHostToDevice, stream_));
      if (whole) {
        NCCL_CHECK(ncclBroadcast(d_send_, d_send_, n, ncclUint8, root, comm_, stream_));
      } else {
        NCCL_CHECK(ncclGroupStart());
        if (rank_ == root) {
          for (int q : group)
            if (q != root) NCCL_CHECK(ncclSend(d_send_, n, ncclUint8, q, comm_, stream_));
        } else {
          NCCL_CHECK(ncclRecv(d_send_, n, ncclUint8, root, comm_, stream_));
        }
        NCCL_CHECK(ncclGroupEnd());
      }
      if (rank_ != root) CUDA_CHECK(cudaMemcpyAsync(p + off, d_send_, n, cudaMemcpyDeviceToHost, stream_));
      wait("broadcast");
    }
  }

  int64_t all_reduce_sum(int64_t value) override { return reduce(value, ncclSum); }
  int64_t all_reduce_max(int64_t value) override { return reduce(value, ncclMax); }

  std::vector<std::string> all_gather_strings(const std::string& mine) override {
    DeviceGuard g(device_);
    std::vector<int64_t> lens = all_gather_i64(int64_t(mine.size()));
    int64_t maxlen = 0;
    for (int64_t l : lens) maxlen = std::max(maxlen, l);
    std::vector<std::string> out(static_cast<size_t>(size_));
    if (maxlen == 0) return out;
    // Byte all-gather in chunks of at most staging_ / size bytes per rank.
    const uint64_t per = std::max<uint64_t>(1, staging_ / uint64_t(size_));
    for (auto& s : out) s.reserve(size_t(maxlen));
    for (uint64_t off = 0; off < uint64_t(maxlen); off += per) {
      const uint64_t n = std::min(per, uint64_t(maxlen) - off);
      std::vector<uint8_t> block(n, 0);
      if (off < mine.size()) std::memcpy(block.data(), mine.data() + off, std::min<uint64_t>(n, mine.size() - off));
      CUDA_CHECK(cudaMemcpyAsync(d_send_, block.data(), n, cudaMemcpyHostToDevice, stream_));
      NCCL_CHECK(ncclAllGather(d_send_, d_recv_, n, ncclUint8, comm_, stream_));
      std::vector<uint8_t> all(n * uint64_t(size_));
      CUDA_CHECK(cudaMemcpyAsync(all.data(), d_recv_, all.size(), cudaMemcpyDeviceToHost, stream_));
      wait("all_gather_strings");
      for (int r = 0; r < size_; ++r) {
        const uint64_t want = uint64_t(lens[r]);
        if (off >= want) continue;
        out[r].append(reinterpret_cast<const char*>(all.data() + uint64_t(r) * n), std::min(n, want - off));
      }
    }
    return out;
  }

  void barrier() override { reduce(0, ncclSum); }

 private:
  std::string prefix() const { return rank_prefix(rank_, size_); }

  uint64_t per_peer() const { return std::max<uint64_t>(256, staging_ / uint64_t(size_) / 256 * 256); }

  static uint64_t piece(uint64_t count, uint64_t k, uint64_t q) {
    if (count <= k * q) return 0;
    return std::min(q, count - k * q);
  }

  // Every rank learns whether any rank passed count vectors of the wrong length (so that all
  // raise and none waits in a collective that the bad rank never joins).
  void check_counts(const std::vector<uint64_t>& sc, const std::vector<uint64_t>& sd, const std::vector<uint64_t>& rc,
                    const std::vector<uint64_t>& rd) {
    const bool bad = int(sc.size()) != size_ || int(sd.size()) != size_ || int(rc.size()) != size_ ||
                     int(rd.size()) != size_;
    const int64_t any = reduce(bad ? 1 : 0, ncclMax);
    if (bad)
      fail(ErrorCode::kInvalidArgument, prefix(), "all_to_all_v: counts and displacements need one entry per rank (",
           size_, ")");
    if (any) fail(ErrorCode::kInvalidArgument, prefix(), "all_to_all_v: another rank passed bad arguments");
  }

  // Gathers every rank's send and receive counts; a send/receive mismatch anywhere raises on
  // every rank (the ranks involved name both ranks and both counts). Returns the number of rounds
  // of at most q bytes per peer.
  uint64_t agree_rounds(const std::vector<uint64_t>& sc, const std::vector<uint64_t>& rc, uint64_t q) {
    std::vector<uint64_t> mine(sc);
    mine.insert(mine.end(), rc.begin(), rc.end());
    std::vector<int64_t> mat = all_gather_vec(mine);  // rank r: [send to 0..W-1, recv from 0..W-1]
    const size_t W = size_t(size_);
    auto sends = [&](size_t r, size_t d) { return uint64_t(mat[r * 2 * W + d]); };
    auto recvs = [&](size_t r, size_t s) { return uint64_t(mat[r * 2 * W + W + s]); };
    uint64_t mx = 0;
    std::string mine_msg;
    bool any = false;
    for (size_t r = 0; r < W; ++r)
      for (size_t d = 0; d < W; ++d) {
        mx = std::max(mx, sends(r, d));
        if (sends(r, d) == recvs(d, r)) continue;
        any = true;
        if (!mine_msg.empty()) continue;
        if (int(d) == rank_)
          mine_msg = "rank " + std::to_string(d) + " expects " + std::to_string(recvs(d, r)) + " bytes from rank " +
                     std::to_string(r) + ", but rank " + std::to_string(r) + " sends " + std::to_string(sends(r, d)) +
                     " bytes";
        else if (int(r) == rank_)
          mine_msg = "rank " + std::to_string(r) + " sends " + std::to_string(sends(r, d)) + " bytes to rank " +
                     std::to_string(d) + ", but rank " + std::to_string(d) + " expects " + std::to_string(recvs(d, r)) +
                     " bytes";
      }
    if (!mine_msg.empty()) fail(ErrorCode::kInternal, prefix(), "all_to_all_v: count mismatch: ", mine_msg);
    if (any) fail(ErrorCode::kInternal, prefix(), "all_to_all_v: count mismatch between other ranks");
    return (mx + q - 1) / q;
  }

  std::vector<int64_t> all_gather_vec(const std::vector<uint64_t>& v) {
    const size_t n = v.size();
    int64_t* d = nullptr;
    CUDA_CHECK(cudaMalloc(&d, 2 * n * size_t(size_) * sizeof(int64_t)));
    std::vector<int64_t> out(n * size_t(size_));
    try {
      CUDA_CHECK(cudaMemcpyAsync(d, v.data(), n * sizeof(int64_t), cudaMemcpyHostToDevice, stream_));
      NCCL_CHECK(ncclAllGather(d, d + n * size_t(size_), n, ncclInt64, comm_, stream_));
      CUDA_CHECK(cudaMemcpyAsync(out.data(), d + n * size_t(size_), out.size() * sizeof(int64_t), cudaMemcpyDeviceToHost,
                                 stream_));
      wait("all_gather");
    } catch (...) {
      cudaFree(d);
      throw;
    }
    cudaFree(d);
    return out;
  }

  std::vector<int64_t> all_gather_i64(int64_t v) { return all_gather_vec({uint64_t(v)}); }

  int64_t reduce(int64_t value, ncclRedOp_t op) {
    DeviceGuard g(device_);
    int64_t out = 0;
    CUDA_CHECK(cudaMemcpyAsync(d_small_, &value, sizeof(value), cudaMemcpyHostToDevice, stream_));
    NCCL_CHECK(ncclAllReduce(d_small_, d_small_ + 1, 1, ncclInt64, op, comm_, stream_));
    CUDA_CHECK(cudaMemcpyAsync(&out, d_small_ + 1, sizeof(out), cudaMemcpyDeviceToHost, stream_));
    wait(op == ncclSum ? "all_reduce_sum" : "all_reduce_max");
    return out;
  }

  // Waits for the stream, watching NCCL's asynchronous errors and the timeout.
  void wait(const char* what, cudaStream_t st = nullptr) {
    if (!st) st = stream_;
    const auto t0 = Clock::now();
    int spins = 0;
    while (true) {
      cudaError_t e = cudaStreamQuery(st);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) cuda_fail(prefix(), what, e);
      ncclResult_t async = ncclSuccess;
      NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
      if (async != ncclSuccess && async != ncclInProgress) {
        aborted_ = true;
        nccl_fail(prefix(), what, async, comm_);
      }
      if (opt_.timeout_seconds > 0 &&
          std::chrono::duration<double>(Clock::now() - t0).count() > opt_.timeout_seconds) {
        aborted_ = true;
        ncclCommAbort(comm_);
        comm_ = nullptr;
        fail(ErrorCode::kInternal, prefix(), what, " did not finish within ", opt_.timeout_seconds,
             " s; the NCCL communicator was aborted (a peer died or skipped the collective)");
      }
      if (++spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  int rank_, size_;
  NcclOptions opt_;
  int device_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  uint64_t staging_ = 0;
  uint8_t* d_send_ = nullptr;
  uint8_t* d_recv_ = nullptr;
  int64_t* d_small_ = nullptr;
  bool aborted_ = false;
  std::string version_;
};

}  // namespace

std::string nccl_unique_id() {
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) nccl_fail("", "ncclGetUniqueId", r, nullptr);
  return std::string(id.internal, NCCL_UNIQUE_ID_BYTES);
}

std::unique_ptr<NcclCommunicator> make_nccl_communicator(const std::string& unique_id, int rank, int size,
                                                         const NcclOptions& options) {
  return std::make_unique<NcclComm>(unique_id, rank, size, options);
}

std::unique_ptr<NcclCommunicator> make_nccl_communicator(Communicator& bootstrap, const NcclOptions& options) {
  std::string id(NCCL_UNIQUE_ID_BYTES, '\0');
  std::string err;
  if (bootstrap.rank() == 0) {
    try {
      id = nccl_unique_id();
    } catch (const Error& e) {
      err = e.what();
    }
  }
  // Rank 0's failure reaches every rank instead of leaving them waiting in ncclCommInitRank.
  std::vector<int> all(size_t(bootstrap.size()));
  for (int i = 0; i < bootstrap.size(); ++i) all[size_t(i)] = i;
  auto errs = bootstrap.all_gather_strings(err);
  if (!errs[0].empty()) fail(ErrorCode::kInternal, rank_prefix(bootstrap.rank(), bootstrap.size()),
                             "NCCL bootstrap failed on rank 0: ", errs[0]);
  bootstrap.broadcast(id.data(), id.size(), 0, all);
  return make_nccl_communicator(id, bootstrap.rank(), bootstrap.size(), options);
}

}  // namespace reshard
