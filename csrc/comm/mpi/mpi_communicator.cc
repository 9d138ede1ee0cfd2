#include "comm/mpi/mpi_communicator.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "reshard/error.h"

// Calls MPI function `fn` with the given arguments and raises reshard::Error on failure.
#define RESHARD_MPI(op, fn, ...) check(fn(__VA_ARGS__), #fn, op)

namespace reshard {
namespace {

constexpr uint64_t kDefaultChunkBytes = uint64_t(1) << 30;  // 1 GiB
constexpr uint64_t kMaxChunkBytes = uint64_t(INT_MAX);
constexpr uint64_t kBroadcastPipelineBytes = uint64_t(16) << 20;  // per tree step
constexpr double kDefaultTimeoutS = 300.0;
// Point-to-point tags on the private duplicate communicator; collectives use their own context.
constexpr int kTagAllToAll = 0x5A1;
constexpr int kTagBroadcast = 0x5B1;

std::string mpi_error_text(int rc) {
  char buf[MPI_MAX_ERROR_STRING + 1] = {0};
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return "MPI error code " + std::to_string(rc);
  return std::string(buf, size_t(std::max(len, 0)));
}

uint64_t env_chunk_bytes() {
  const char* env = std::getenv("RESHARD_MPI_CHUNK_BYTES");
  if (!env || !*env) return kDefaultChunkBytes;
  char* end = nullptr;
  unsigned long long v = std::strtoull(env, &end, 10);
  if (*end != '\0' || v == 0 || v > kMaxChunkBytes) {
    fail(ErrorCode::kInvalidArgument, "RESHARD_MPI_CHUNK_BYTES='", env,
         "' must be an integer in [1, ", kMaxChunkBytes, "]");
  }
  return v;
}

double env_timeout_s() {
  const char* env = std::getenv("RESHARD_COMM_TIMEOUT_S");
  if (!env || !*env) return kDefaultTimeoutS;
  char* end = nullptr;
  double v = std::strtod(env, &end);
  if (*end != '\0' || !(v > 0) || !std::isfinite(v)) {
    fail(ErrorCode::kInvalidArgument, "RESHARD_COMM_TIMEOUT_S='", env,
         "' must be a positive number of seconds");
  }
  return v;
}

std::string format_seconds(double s) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

}  // namespace

// A set of in-flight requests, completed by a polling loop with a timeout. If it is destroyed
// with requests still pending (an exception: timeout or MPI error), pending receives are
// cancelled, point-to-point requests are freed, and the communicator is marked unusable.
class MpiRequestSet {
 public:
  struct Info {
    int peer;     // rank in the communicator, or -1 for a collective
    bool is_recv;
  };

  MpiRequestSet(MpiCommunicator& c, const char* op) : c_(c), op_(op) {}
  ~MpiRequestSet() { abandon(); }

  MPI_Request* add(int peer, bool is_recv) {
    reqs_.push_back(MPI_REQUEST_NULL);
    info_.push_back({peer, is_recv});
    return &reqs_.back();
  }
  MPI_Request* add_collective() { return add(-1, false); }
  size_t size() const { return reqs_.size(); }
  // reqs_ may reallocate on add(); callers must use the pointer before the next add().
  void reserve(size_t n) {
    reqs_.reserve(n);
    info_.reserve(n);
  }

  /// Completes requests [begin, end) (all by default), polling with MPI_Testsome.
  void wait(size_t begin = 0, size_t end = SIZE_MAX) {
    end = std::min(end, reqs_.size());
    if (begin >= end) return;
    const int n = int(end - begin);
    std::vector<int> indices(static_cast<size_t>(n));
    std::vector<MPI_Status> statuses(static_cast<size_t>(n));
    auto last_progress = std::chrono::steady_clock::now();
    const auto limit = std::chrono::duration<double>(c_.timeout_s_);
    for (;;) {
      int outcount = 0;
      int rc = MPI_Testsome(n, reqs_.data() + begin, &outcount, indices.data(), statuses.data());
      if (rc == MPI_ERR_IN_STATUS) {
        for (int i = 0; i < outcount; ++i) {
          int e = statuses[size_t(i)].MPI_ERROR;
          if (e != MPI_SUCCESS) {
            const Info& inf = info_[begin + size_t(indices[size_t(i)])];
            std::string what = inf.peer < 0 ? std::string("collective")
                                            : std::string(inf.is_recv ? "receive from rank "
                                                                      : "send to rank ") +
                                                  std::to_string(inf.peer);
            fail(ErrorCode::kInternal, c_.prefix(), " MPI error in ", op_, " (", what,
                 "): ", mpi_error_text(e));
          }
        }
      }
      c_.check(rc, "MPI_Testsome", op_);
      if (outcount == MPI_UNDEFINED) return;  // all requests are MPI_REQUEST_NULL
      auto now = std::chrono::steady_clock::now();
      if (outcount > 0) {
        last_progress = now;
        continue;
      }
      if (now - last_progress > limit) timeout(begin, end);
      // Waiting on a peer that is still working: yield at first (latency), then sleep briefly, so
      // a rank that finished early does not take a core from ranks sharing the machine with it.
      if (now - last_progress < std::chrono::microseconds(200)) {
        sched_yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

 private:
  [[noreturn]] void timeout(size_t begin, size_t end) {
    std::set<int> peers;
    bool collective = false;
    for (size_t i = begin; i < end; ++i) {
      if (reqs_[i] == MPI_REQUEST_NULL) continue;
      if (info_[i].peer < 0) collective = true;
      else peers.insert(info_[i].peer);
    }
    std::string who;
    for (int p : peers) who += (who.empty() ? "" : ",") + std::to_string(p);
    if (collective) {
      who += std::string(who.empty() ? "" : " and ") + "any of the " + std::to_string(c_.size_) +
             " ranks (collective)";
    }
    fail(ErrorCode::kFailedPrecondition, c_.prefix(), " timed out after ",
         format_seconds(c_.timeout_s_), " s waiting for rank(s) ", who, " in ", op_,
         "; a peer may have died");
  }

  void abandon() {
    bool any = false;
    for (size_t i = 0; i < reqs_.size(); ++i) {
      if (reqs_[i] == MPI_REQUEST_NULL) continue;
      any = true;
      // Nonblocking collectives may be neither cancelled nor freed: they are left behind.
      if (info_[i].peer < 0) continue;
      if (info_[i].is_recv) MPI_Cancel(&reqs_[i]);
      if (reqs_[i] != MPI_REQUEST_NULL) MPI_Request_free(&reqs_[i]);
    }
    if (any) c_.broken_ = true;
  }

  MpiCommunicator& c_;
  const char* op_;
  std::vector<MPI_Request> reqs_;
  std::vector<Info> info_;
};

MpiCommunicator::MpiCommunicator(MPI_Comm comm)
    : chunk_bytes_(env_chunk_bytes()), timeout_s_(env_timeout_s()) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    fail(ErrorCode::kFailedPrecondition,
         "make_mpi_communicator: MPI is not initialised (create a reshard::MpiSession first) or "
         "already finalised");
  }
  int rc = MPI_Comm_dup(comm, &comm_);
  if (rc != MPI_SUCCESS) {
    fail(ErrorCode::kInternal, "make_mpi_communicator: MPI_Comm_dup failed: ", mpi_error_text(rc));
  }
  RESHARD_MPI("make_mpi_communicator", MPI_Comm_set_errhandler, comm_, MPI_ERRORS_RETURN);
  RESHARD_MPI("make_mpi_communicator", MPI_Comm_rank, comm_, &rank_);
  RESHARD_MPI("make_mpi_communicator", MPI_Comm_size, comm_, &size_);
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  // After a timeout, nonblocking collectives may still be pending on comm_ (they can be neither
  // cancelled nor freed) and OpenMPI would progress them on a freed communicator: leak it.
  if (!finalized && !broken_ && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

std::string MpiCommunicator::prefix() const {
  return "[rank " + std::to_string(rank_) + "/" + std::to_string(size_) + "]";
}

void MpiCommunicator::check(int rc, const char* call, const char* op) const {
  if (rc == MPI_SUCCESS) return;
  fail(ErrorCode::kInternal, prefix(), " ", call, " failed in ", op, ": ", mpi_error_text(rc));
}

void MpiCommunicator::check_usable(const char* op) const {
  if (broken_) {
    fail(ErrorCode::kFailedPrecondition, prefix(), " ", op,
         ": this MPI communicator is unusable after an earlier timeout or MPI error; abort the "
         "job");
  }
}

void MpiCommunicator::set_chunk_bytes(uint64_t bytes) {
  if (bytes == 0 || bytes > kMaxChunkBytes) {
    fail(ErrorCode::kInvalidArgument, prefix(), " set_chunk_bytes(", bytes, "): must be in [1, ",
         kMaxChunkBytes, "]");
  }
  chunk_bytes_ = bytes;
}

void MpiCommunicator::set_timeout_seconds(double seconds) {
  if (!(seconds > 0) || !std::isfinite(seconds)) {
    fail(ErrorCode::kInvalidArgument, prefix(), " set_timeout_seconds(", seconds,
         "): must be a positive number");
  }
  timeout_s_ = seconds;
}

void MpiCommunicator::all_to_all_v(const void* send, const std::vector<uint64_t>& send_counts,
                                   const std::vector<uint64_t>& send_displs, void* recv,
                                   const std::vector<uint64_t>& recv_counts,
                                   const std::vector<uint64_t>& recv_displs) {
  const char* op = "all_to_all_v";
  check_usable(op);
  const size_t n = size_t(size_);
  const bool bad_args = send_counts.size() != n || send_displs.size() != n ||
                        recv_counts.size() != n || recv_displs.size() != n;

  // 1. Exchange (bytes I send you, bytes I expect from you, my chunk size) with every peer. A
  //    chunk size of 0 marks a rank whose own arguments are invalid.
  std::vector<uint64_t> mine(3 * n, 0), theirs(3 * n, 0);
  if (!bad_args) {
    for (size_t p = 0; p < n; ++p) {
      mine[3 * p] = send_counts[p];
      mine[3 * p + 1] = recv_counts[p];
      mine[3 * p + 2] = chunk_bytes_;
    }
  }
  {
    MpiRequestSet rs(*this, op);
    RESHARD_MPI(op, MPI_Ialltoall, mine.data(), 3, MPI_UINT64_T, theirs.data(), 3, MPI_UINT64_T,
                comm_, rs.add_collective());
    rs.wait();
  }

  // 2. Check every pair this rank is part of, then agree on whether any rank found a problem, so
  //    that all ranks raise together and no payload is posted.
  std::vector<std::string> problems;
  if (bad_args) {
    problems.push_back(detail::cat(
        "count and displacement vectors must have one entry per rank (", n,
        "), got send_counts=", send_counts.size(), " send_displs=", send_displs.size(),
        " recv_counts=", recv_counts.size(), " recv_displs=", recv_displs.size()));
  } else {
    for (size_t p = 0; p < n; ++p) {
      const uint64_t p_sends = theirs[3 * p], p_expects = theirs[3 * p + 1],
                     p_chunk = theirs[3 * p + 2];
      if (p_chunk == 0) continue;  // p reports its own invalid arguments
      if (p_sends != recv_counts[p]) {
        problems.push_back(detail::cat("rank ", rank_, " expects ", recv_counts[p],
                                       " bytes from rank ", p, ", but rank ", p, " sends ",
                                       p_sends, " bytes to rank ", rank_));
      }
      if (p_expects != send_counts[p] && int(p) != rank_) {
        problems.push_back(detail::cat("rank ", rank_, " sends ", send_counts[p],
                                       " bytes to rank ", p, ", but rank ", p, " expects ",
                                       p_expects, " bytes from rank ", rank_));
      }
      if (p_chunk != chunk_bytes_) {
        problems.push_back(detail::cat("rank ", rank_, " uses chunk size ", chunk_bytes_,
                                       " bytes but rank ", p, " uses ", p_chunk,
                                       " (RESHARD_MPI_CHUNK_BYTES must be the same on all ranks)"));
      }
    }
  }
  int first_bad = problems.empty() ? INT_MAX : rank_;
  {
    int in = first_bad;
    MpiRequestSet rs(*this, op);
    RESHARD_MPI(op, MPI_Iallreduce, &in, &first_bad, 1, MPI_INT, MPI_MIN, comm_,
                rs.add_collective());
    rs.wait();
  }
  if (!problems.empty()) {
    std::string msg;
    const size_t shown = std::min<size_t>(problems.size(), 8);
    for (size_t i = 0; i < shown; ++i) msg += (i ? "; " : "") + problems[i];
    if (problems.size() > shown) msg += detail::cat("; and ", problems.size() - shown, " more");
    fail(bad_args ? ErrorCode::kInvalidArgument : ErrorCode::kFailedPrecondition, prefix(), " ",
         op, ": ", bad_args ? "" : "count mismatch: ", msg);
  }
  if (first_bad != INT_MAX) {
    fail(ErrorCode::kFailedPrecondition, prefix(), " ", op, ": aborted before moving data because rank ",
         first_bad, " found inconsistent counts or arguments (see its error)");
  }

  // 3. Payload: chunked Irecv/Isend pairs; chunks of one pair match in order (MPI non-overtaking).
  const uint64_t chunk = chunk_bytes_;
  size_t nreq = 0;
  for (size_t p = 0; p < n; ++p) {
    if (int(p) == rank_) continue;
    nreq += size_t((send_counts[p] + chunk - 1) / chunk + (recv_counts[p] + chunk - 1) / chunk);
  }
  MpiRequestSet rs(*this, op);
  rs.reserve(nreq);
  for (size_t i = 1; i < n; ++i) {
    const int p = int((size_t(rank_) + n - i) % n);
    char* base = static_cast<char*>(recv) + recv_displs[size_t(p)];
    for (uint64_t off = 0; off < recv_counts[size_t(p)]; off += chunk) {
      const int len = int(std::min(chunk, recv_counts[size_t(p)] - off));
      RESHARD_MPI(op, MPI_Irecv, base + off, len, MPI_BYTE, p, kTagAllToAll, comm_,
                  rs.add(p, true));
    }
  }
  for (size_t i = 1; i < n; ++i) {
    const int p = int((size_t(rank_) + i) % n);
    const char* base = static_cast<const char*>(send) + send_displs[size_t(p)];
    for (uint64_t off = 0; off < send_counts[size_t(p)]; off += chunk) {
      const int len = int(std::min(chunk, send_counts[size_t(p)] - off));
      RESHARD_MPI(op, MPI_Isend, base + off, len, MPI_BYTE, p, kTagAllToAll, comm_,
                  rs.add(p, false));
    }
  }
  const size_t me = size_t(rank_);
  if (send_counts[me] > 0) {
    const char* src = static_cast<const char*>(send) + send_displs[me];
    char* dst = static_cast<char*>(recv) + recv_displs[me];
    if (src != dst) std::memmove(dst, src, send_counts[me]);
  }
  rs.wait();
}

void MpiCommunicator::broadcast(void* data, uint64_t bytes, int root, const std::vector<int>& group) {
  const char* op = "broadcast";
  check_usable(op);
  const bool sorted = std::adjacent_find(group.begin(), group.end(),
                                         [](int a, int b) { return a >= b; }) == group.end();
  const auto me_it = std::find(group.begin(), group.end(), rank_);
  const auto root_it = std::find(group.begin(), group.end(), root);
  if (group.empty() || !sorted || group.front() < 0 || group.back() >= size_ ||
      me_it == group.end() || root_it == group.end()) {
    std::string g;
    for (int r : group) g += (g.empty() ? "" : ",") + std::to_string(r);
    fail(ErrorCode::kInvalidArgument, prefix(), " broadcast: group {", g, "} with root ", root,
         " must be strictly increasing ranks in [0, ", size_, ") containing the caller and the root");
  }
  const size_t g = group.size();
  if (g == 1 || bytes == 0) return;

  // Binomial tree over the group, relative to the root: v's parent is v minus its lowest set
  // bit; its children are v + 2^k for 2^k below that bit. Pipelined in pieces so that a subtree
  // forwards piece i while piece i+1 arrives.
  const size_t v = (size_t(me_it - group.begin()) + g - size_t(root_it - group.begin())) % g;
  const size_t root_idx = size_t(root_it - group.begin());
  auto member = [&](size_t rel) { return group[(rel + root_idx) % g]; };
  const size_t low = v == 0 ? SIZE_MAX : (v & (~v + 1));
  std::vector<int> children;  // largest subtree first
  {
    size_t top = 1;
    while (top < g) top <<= 1;
    for (size_t k = top; k >= 1; k >>= 1) {
      if (k < low && v + k < g) children.push_back(member(v + k));
    }
  }
  const uint64_t piece = std::min(chunk_bytes_, kBroadcastPipelineBytes);
  const uint64_t npieces = (bytes + piece - 1) / piece;
  char* base = static_cast<char*>(data);

  MpiRequestSet rs(*this, op);
  rs.reserve(size_t(npieces * (children.size() + (v != 0 ? 1 : 0))));
  size_t nrecv = 0;
  if (v != 0) {
    const int parent = member(v - low);
    for (uint64_t i = 0; i < npieces; ++i) {
      const uint64_t off = i * piece;
      const int len = int(std::min(piece, bytes - off));
      RESHARD_MPI(op, MPI_Irecv, base + off, len, MPI_BYTE, parent, kTagBroadcast, comm_,
                  rs.add(parent, true));
    }
    nrecv = size_t(npieces);
  }
  for (uint64_t i = 0; i < npieces; ++i) {
    if (v != 0) rs.wait(size_t(i), size_t(i) + 1);  // piece i has arrived
    const uint64_t off = i * piece;
    const int len = int(std::min(piece, bytes - off));
    for (int child : children) {
      RESHARD_MPI(op, MPI_Isend, base + off, len, MPI_BYTE, child, kTagBroadcast, comm_,
                  rs.add(child, false));
    }
  }
  rs.wait(nrecv);
}

int64_t MpiCommunicator::all_reduce_sum(int64_t value) {
  check_usable("all_reduce_sum");
  int64_t out = 0;
  MpiRequestSet rs(*this, "all_reduce_sum");
  RESHARD_MPI("all_reduce_sum", MPI_Iallreduce, &value, &out, 1, MPI_INT64_T, MPI_SUM, comm_,
              rs.add_collective());
  rs.wait();
  return out;
}

int64_t MpiCommunicator::all_reduce_max(int64_t value) {
  check_usable("all_reduce_max");
  int64_t out = 0;
  MpiRequestSet rs(*this, "all_reduce_max");
  RESHARD_MPI("all_reduce_max", MPI_Iallreduce, &value, &out, 1, MPI_INT64_T, MPI_MAX, comm_,
              rs.add_collective());
  rs.wait();
  return out;
}

std::vector<std::string> MpiCommunicator::all_gather_strings(const std::string& mine) {
  const char* op = "all_gather_strings";
  check_usable(op);
  const size_t n = size_t(size_);
  std::vector<uint64_t> lengths(n, 0);
  uint64_t my_len = mine.size();
  {
    MpiRequestSet rs(*this, op);
    RESHARD_MPI(op, MPI_Iallgather, &my_len, 1, MPI_UINT64_T, lengths.data(), 1, MPI_UINT64_T,
                comm_, rs.add_collective());
    rs.wait();
  }
  std::vector<int> counts(n), displs(n);
  uint64_t total = 0;
  for (size_t p = 0; p < n; ++p) {
    if (total + lengths[p] > kMaxChunkBytes) {
      // Every rank sees the same lengths, so every rank raises here.
      fail(ErrorCode::kInvalidArgument, prefix(), " ", op, ": gathered strings total more than ",
           kMaxChunkBytes, " bytes (rank ", p, " contributes ", lengths[p], ")");
    }
    counts[p] = int(lengths[p]);
    displs[p] = int(total);
    total += lengths[p];
  }
  std::string all(size_t(total), '\0');
  {
    MpiRequestSet rs(*this, op);
    RESHARD_MPI(op, MPI_Iallgatherv, mine.data(), int(my_len), MPI_CHAR, all.data(),
                counts.data(), displs.data(), MPI_CHAR, comm_, rs.add_collective());
    rs.wait();
  }
  std::vector<std::string> out(n);
  for (size_t p = 0; p < n; ++p) out[p] = all.substr(size_t(displs[p]), size_t(counts[p]));
  return out;
}

void MpiCommunicator::barrier() {
  check_usable("barrier");
  MpiRequestSet rs(*this, "barrier");
  RESHARD_MPI("barrier", MPI_Ibarrier, comm_, rs.add_collective());
  rs.wait();
}

std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm) {
  return std::make_unique<MpiCommunicator>(comm);
}

// ---- session and world factory ----

MpiSession::MpiSession(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    MPI_Query_thread(&provided_);
    return;
  }
  int rc = MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided_);
  if (rc != MPI_SUCCESS) fail(ErrorCode::kInternal, "MPI_Init_thread failed: ", mpi_error_text(rc));
  owns_ = true;
}

MpiSession::~MpiSession() {
  if (!owns_) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

bool mpi_launched() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    const char* v = std::getenv(var);
    if (v && *v) return true;
  }
  return false;
}

std::unique_ptr<Communicator> make_world_communicator() {
  if (!mpi_launched()) return make_local_communicator();
  static MpiSession session;  // finalises MPI at exit if it initialised it
  return make_mpi_communicator(MPI_COMM_WORLD);
}

void abort_world(int exit_code, const std::string& message) {
  if (!message.empty()) {
    std::fprintf(stderr, "%s\n", message.c_str());
    std::fflush(stderr);
  }
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

}  // namespace reshard
