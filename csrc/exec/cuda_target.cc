// Loading into CUDA target buffers (include/reshard/cuda.h; design in docs/gpu.md).
//
// The top-level CMakeLists globs csrc/exec/*.cc into the CPU library `reshard`; this file is
// compiled for real only in `reshard_cuda` (cmake/nccl.cmake defines RESHARD_CUDA_TARGET_IMPL),
// and is empty elsewhere.
#if defined(RESHARD_CUDA_TARGET_IMPL)

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "exec/cuda_target.h"
#include "api/report.h"
#include "exec/executor.h"
#include "reshard/cuda.h"
#include "reshard/error.h"
#include "reshard/reshard.h"
#include "reshard/simulate.h"
#include "reshard/strided.h"

namespace reshard {

using cuda_detail::BoxArgs;

bool cuda_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string prefix(const Communicator& c) {
  return "[rank " + std::to_string(c.rank()) + "/" + std::to_string(c.size()) + "] ";
}

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (device < 0) return;
    RESHARD_CUDA(cudaGetDevice(&prev_));
    RESHARD_CUDA(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
};

BoxArgs box_args(const Box& box, const std::array<int64_t, kMaxDims>& strides) {
  BoxArgs a;
  if (box.ndim == 0) {
    a.ndim = 1;
    a.len[0] = 1;
    a.strides[0] = 1;
    return a;
  }
  a.ndim = box.ndim;
  for (int d = 0; d < box.ndim; ++d) {
    a.len[d] = box.len[d];
    a.strides[d] = strides[d];
  }
  return a;
}

Box rel_box(const Box& b) {
  Box r = b;
  for (int d = 0; d < r.ndim; ++d) r.off[d] = 0;
  return r;
}


// Gathers one status string per rank; throws on every rank if any is non-empty (as the executor).
void agree_or_throw(Communicator& comm, const std::string& mine, ErrorCode code, const std::string& what,
                    bool live_written) {
  std::vector<std::string> all = comm.all_gather_strings(mine);
  std::string msg;
  int nbad = 0;
  for (const auto& s : all) {
    if (s.empty()) continue;
    if (nbad++ < 8) msg += (msg.empty() ? "" : "; ") + s;
  }
  if (nbad == 0) return;
  if (live_written)
    fail(ErrorCode::kFailedPrecondition, what, " failed after device buffers were partly written; the live state is "
         "unusable and the trainer must abort: ", msg);
  fail(code, what, " failed before any live tensor was written: ", msg);
}

// ---- staging kept across loads: pinned host slots, device scratch, streams, events ----------

struct Staging {
  int device = -1;
  int threads = 0, slots = 0;
  uint64_t chunk = 0;
  uint8_t* host = nullptr;    // threads * slots * chunk, pinned
  uint8_t* scratch = nullptr; // same size on the device
  std::vector<cudaStream_t> streams;  // one per thread
  std::vector<cudaEvent_t> events;    // one per slot
  double setup_seconds = 0;

  uint8_t* host_slot(int t, int s) const { return host + (uint64_t(t) * slots + s) * chunk; }
  uint8_t* dev_slot(int t, int s) const { return scratch + (uint64_t(t) * slots + s) * chunk; }
  cudaEvent_t& event(int t, int s) { return events[size_t(t) * slots + s]; }

  void release() {
    DeviceGuard g(device);
    for (auto& e : events) cudaEventDestroy(e);
    for (auto& s : streams) cudaStreamDestroy(s);
    if (host) cudaFreeHost(host);
    if (scratch) cudaFree(scratch);
    events.clear();
    streams.clear();
    host = scratch = nullptr;
    threads = slots = 0;
    chunk = 0;
  }

  // Makes the staging fit (device, threads, slots, chunk); reuses what is there.
  void ensure(int dev, int t, int s, uint64_t c) {
    if (host && dev == device && t <= threads && s == slots && c == chunk) {
      setup_seconds = 0;
      return;
    }
    auto t0 = Clock::now();
    release();
    device = dev;
    DeviceGuard g(device);
    const uint64_t bytes = uint64_t(t) * s * c;
    RESHARD_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&host), bytes, cudaHostAllocPortable));
    RESHARD_CUDA(cudaMalloc(reinterpret_cast<void**>(&scratch), bytes));
    streams.resize(size_t(t));
    for (auto& st : streams) RESHARD_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    events.resize(size_t(t) * s);
    for (auto& e : events) RESHARD_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    threads = t;
    slots = s;
    chunk = c;
    setup_seconds = since(t0);
  }
};

std::mutex g_staging_mu;
Staging g_staging;

// ---- read-only mmap of a source file, registered with CUDA segment by segment ----------------

class RegisteredFile {
 public:
  static constexpr uint64_t kSegment = uint64_t(256) << 20;

  RegisteredFile(const std::string& path, uint64_t size) : path_(path), size_(size) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail(ErrorCode::kNotFound, "cannot open ", path, ": ", std::strerror(errno));
    void* p = size ? ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0) : nullptr;
    int err = errno;
    ::close(fd);
    if (size && p == MAP_FAILED) fail(ErrorCode::kInternal, "mmap of ", path, " failed: ", std::strerror(err));
    base_ = static_cast<uint8_t*>(p);
    const size_t nseg = size_t((size + kSegment - 1) / kSegment);
    once_ = std::vector<std::once_flag>(nseg);
    registered_.assign(nseg, 0);
  }
  ~RegisteredFile() {
    for (size_t s = 0; s < registered_.size(); ++s)
      if (registered_[s]) cudaHostUnregister(base_ + s * kSegment);
    if (base_) ::munmap(base_, size_);
  }
  // Host pointer of [offset, offset + len) (within one segment), registered before it returns.
  const uint8_t* at(uint64_t offset, uint64_t len, std::atomic<uint64_t>& registered_bytes) {
    const size_t s = size_t(offset / kSegment);
    RESHARD_CHECK(len == 0 || (offset + len <= size_ && (offset + len - 1) / kSegment == s), "mapped range crosses a segment");
    std::call_once(once_[s], [&] {
      const uint64_t start = uint64_t(s) * kSegment;
      const long page = ::sysconf(_SC_PAGESIZE);
      uint64_t n = std::min(kSegment, size_ - start);
      n = (n + uint64_t(page) - 1) / uint64_t(page) * uint64_t(page);
      cudaError_t e = cudaHostRegister(base_ + start, n, cudaHostRegisterReadOnly | cudaHostRegisterPortable);
      if (e != cudaSuccess) cuda_detail::cuda_fail(e, ("cudaHostRegister(read-only mmap of " + path_ + ")").c_str(),
                                                   __FILE__, __LINE__);
      registered_[s] = 1;
      registered_bytes += n;
    });
    return base_ + offset;
  }

 private:
  std::string path_;
  uint64_t size_ = 0;
  uint8_t* base_ = nullptr;
  std::vector<std::once_flag> once_;
  std::vector<char> registered_;
};

// ---- the direct path ---------------------------------------------------------------------------

struct SrcRun {
  int64_t elem = 0, count = 0, packed = 0;  // source element offset, elements, packed offset
};

struct FragInfo {
  size_t index = 0;               // into plan.fragments
  bool src_contiguous = false;
  std::vector<SrcRun> runs;          // when not contiguous
  bool dst_direct = false;        // one delivery, contiguous, same dtype: H2D straight into it
};

struct Chunk {
  uint32_t frag = 0;  // index into infos
  int64_t e0 = 0, e1 = 0;  // packed elements
  uint64_t slot_off = 0;
  bool mapped = false;
  bool whole = false;  // the piece is the whole fragment
};

struct Batch {
  std::vector<Chunk> pieces;
  uint64_t bytes = 0;
};

struct DirectResult {
  uint64_t h2d = 0, converted = 0, chunks = 0, verified = 0, verified_bytes = 0, registered = 0;
  std::string error;
  bool written = false;
};

DirectResult run_direct(const Plan& plan, const Layout& target, const CheckpointReader& src,
                        const std::vector<void*>& dev, int me, int threads, bool mmap_mode, bool verify,
                        Staging& stg) {
  DirectResult res;
  const int T = std::min(threads, stg.threads), S = stg.slots;
  const uint64_t chunk = stg.chunk;

  // Fragments this rank reads, in file order.
  std::vector<FragInfo> infos;
  for (size_t i = 0; i < plan.fragments.size(); ++i) {
    const Fragment& f = plan.fragments[i];
    if (f.reader != me || f.box.numel() == 0) continue;
    FragInfo fi;
    fi.index = i;
    const Box rel = rel_box(f.box);
    fi.src_contiguous = box_is_dense(rel, f.src_strides);
    if (!fi.src_contiguous)
      for_each_run(rel, f.src_strides, [&](int64_t e, int64_t c, int64_t p) { fi.runs.push_back({e, c, p}); });
    if (f.num_deliveries == 1) {
      const Delivery& dv = plan.deliveries[f.first_delivery];
      fi.dst_direct = target.buffers[dv.buffer].dtype == f.src_dtype && box_is_dense(rel, dv.strides);
    }
    infos.push_back(std::move(fi));
  }
  std::sort(infos.begin(), infos.end(), [&](const FragInfo& a, const FragInfo& b) {
    const Fragment &x = plan.fragments[a.index], &y = plan.fragments[b.index];
    return std::tie(x.file, x.byte_base) < std::tie(y.file, y.byte_base);
  });

  // Registered mappings (mmap mode), one per file used.
  std::vector<std::unique_ptr<RegisteredFile>> maps(src.source().files.size());
  if (mmap_mode)
    for (const FragInfo& fi : infos) {
      const Fragment& f = plan.fragments[fi.index];
      if (fi.src_contiguous && !maps[f.file])
        maps[f.file] = std::make_unique<RegisteredFile>(src.source().files[f.file], src.file_size(f.file));
    }

  // Batches: large fragments cut into slot-sized pieces (at segment boundaries for mapped ones);
  // small ones packed together into one slot.
  std::vector<Batch> batches;
  Batch small;
  auto flush_small = [&] {
    if (!small.pieces.empty()) batches.push_back(std::move(small));
    small = Batch{};
  };
  for (uint32_t k = 0; k < infos.size(); ++k) {
    const FragInfo& fi = infos[k];
    const Fragment& f = plan.fragments[fi.index];
    const uint64_t es = dtype_size(f.src_dtype);
    const int64_t n = f.box.numel();
    const uint64_t bytes = uint64_t(n) * es;
    const bool mapped = mmap_mode && fi.src_contiguous;
    if (bytes <= chunk / 4 && !mapped) {
      if (small.bytes + bytes > chunk) flush_small();
      small.pieces.push_back({k, 0, n, small.bytes, false, true});
      small.bytes += (bytes + 255) / 256 * 256;  // keep pieces 256-byte aligned in the slot
      continue;
    }
    const int64_t per = std::max<int64_t>(1, int64_t(chunk / es));
    for (int64_t e0 = 0; e0 < n;) {
      int64_t e1 = std::min(n, e0 + per);
      if (mapped) {  // do not cross a registration segment
        const uint64_t b0 = f.byte_base + uint64_t(e0) * es;
        const uint64_t seg_end = (b0 / RegisteredFile::kSegment + 1) * RegisteredFile::kSegment;
        const int64_t lim = int64_t((seg_end - f.byte_base) / es);
        if (lim > e0) e1 = std::min(e1, lim);
        else e1 = e0 + 1;  // an element straddling the boundary: cannot happen for aligned dtypes
      }
      Batch b;
      b.pieces.push_back({k, e0, e1, 0, mapped, e0 == 0 && e1 == n});
      b.bytes = uint64_t(e1 - e0) * es;
      batches.push_back(std::move(b));
      e0 = e1;
    }
  }
  flush_small();
  res.chunks = batches.size();

  std::atomic<size_t> next{0};
  std::atomic<bool> stop{false}, written{false};
  std::atomic<uint64_t> h2d{0}, converted{0}, verified{0}, verified_bytes{0}, registered{0};
  std::mutex err_mu;
  std::string first_error;

  auto read_piece = [&](const Chunk& p, uint8_t* dst) {
    const FragInfo& fi = infos[p.frag];
    const Fragment& f = plan.fragments[fi.index];
    const uint64_t es = dtype_size(f.src_dtype);
    if (fi.src_contiguous) {
      src.read(f.file, f.byte_base + uint64_t(p.e0) * es, uint64_t(p.e1 - p.e0) * es, dst);
      return;
    }
    // Runs overlapping [e0, e1).
    auto it = std::upper_bound(fi.runs.begin(), fi.runs.end(), p.e0,
                               [](int64_t e, const SrcRun& r) { return e < r.packed; });
    if (it != fi.runs.begin()) --it;
    for (; it != fi.runs.end() && it->packed < p.e1; ++it) {
      const int64_t a = std::max(p.e0, it->packed), b = std::min(p.e1, it->packed + it->count);
      if (a >= b) continue;
      src.read(f.file, f.byte_base + uint64_t(it->elem + (a - it->packed)) * es, uint64_t(b - a) * es,
               dst + uint64_t(a - p.e0) * es);
    }
  };

  // Device writes of one piece whose packed bytes are at `from` (device scratch).
  auto scatter_piece = [&](const Chunk& p, const uint8_t* from, cudaStream_t st) {
    const FragInfo& fi = infos[p.frag];
    const Fragment& f = plan.fragments[fi.index];
    const Box rel = rel_box(f.box);
    const uint64_t n = uint64_t(p.e1 - p.e0);
    for (uint32_t j = 0; j < f.num_deliveries; ++j) {
      const Delivery& dv = plan.deliveries[f.first_delivery + j];
      const Buffer& b = target.buffers[dv.buffer];
      const size_t des = dtype_size(b.dtype);
      uint8_t* base = static_cast<uint8_t*>(dev[dv.buffer]) + dv.base * int64_t(des);
      if (!cuda_detail::gpu_can_convert(f.src_dtype, b.dtype))
        fail(ErrorCode::kUnsupported, "cannot convert ", dtype_name(f.src_dtype), " to ", dtype_name(b.dtype), " for ",
             b.name);
      if (box_is_dense(rel, dv.strides)) {
        if (b.dtype == f.src_dtype) {
          RESHARD_CUDA(cudaMemcpyAsync(base + uint64_t(p.e0) * des, from, n * des, cudaMemcpyDeviceToDevice, st));
        } else {
          RESHARD_CUDA(cuda_detail::launch_convert(from, f.src_dtype, base + uint64_t(p.e0) * des, b.dtype, n, st));
          converted += n * des;
        }
      } else {
        RESHARD_CUDA(cuda_detail::launch_unpack(from, f.src_dtype, n, p.e0, box_args(rel, dv.strides), base, b.dtype, st));
        converted += n * des;
      }
    }
  };

  auto worker = [&](int t) {
    DeviceGuard g(stg.device);
    cudaStream_t st = stg.streams[size_t(t)];
    uint64_t round = 0;
    try {
      while (!stop) {
        const size_t bi = next.fetch_add(1);
        if (bi >= batches.size()) break;
        const Batch& b = batches[bi];
        const int s = int(round++ % uint64_t(S));
        RESHARD_CUDA(cudaEventSynchronize(stg.event(t, s)));  // slot free again
        uint8_t* host = stg.host_slot(t, s);
        uint8_t* scratch = stg.dev_slot(t, s);
        // 1. Bytes into the slot (or locate them in the registered mapping).
        std::vector<const uint8_t*> hsrc(b.pieces.size());
        for (size_t k = 0; k < b.pieces.size(); ++k) {
          const Chunk& p = b.pieces[k];
          const FragInfo& fi = infos[p.frag];
          const Fragment& f = plan.fragments[fi.index];
          const uint64_t es = dtype_size(f.src_dtype);
          if (p.mapped) {
            hsrc[k] = maps[f.file]->at(f.byte_base + uint64_t(p.e0) * es, uint64_t(p.e1 - p.e0) * es, registered);
          } else {
            read_piece(p, host + p.slot_off);
            hsrc[k] = host + p.slot_off;
            if (verify && p.whole && fi.src_contiguous && src.has_checksum(f.file, f.byte_base, f.bytes())) {
              std::string bad = src.verify_range(f.file, f.byte_base, f.bytes(), hsrc[k]);
              if (!bad.empty()) fail(ErrorCode::kDataLoss, bad);
              ++verified;
              verified_bytes += f.bytes();
            }
          }
        }
        // 2. Copies and kernels on this thread's stream.
        written = true;
        if (b.pieces.size() == 1 && infos[b.pieces[0].frag].dst_direct) {
          const Chunk& p = b.pieces[0];
          const Fragment& f = plan.fragments[infos[p.frag].index];
          const Delivery& dv = plan.deliveries[f.first_delivery];
          const uint64_t es = dtype_size(f.src_dtype);
          uint8_t* dst = static_cast<uint8_t*>(dev[dv.buffer]) + (dv.base + p.e0) * int64_t(es);
          RESHARD_CUDA(cudaMemcpyAsync(dst, hsrc[0], b.bytes, cudaMemcpyHostToDevice, st));
          h2d += b.bytes;
        } else {
          bool any_read = false;
          for (size_t k = 0; k < b.pieces.size(); ++k) {
            const Chunk& p = b.pieces[k];
            if (!p.mapped) {
              any_read = true;
              continue;
            }
            const uint64_t es = dtype_size(plan.fragments[infos[p.frag].index].src_dtype);
            const uint64_t n = uint64_t(p.e1 - p.e0) * es;
            RESHARD_CUDA(cudaMemcpyAsync(scratch + p.slot_off, hsrc[k], n, cudaMemcpyHostToDevice, st));
            h2d += n;
          }
          if (any_read) {
            const Chunk& last = b.pieces.back();
            const uint64_t used = last.slot_off + uint64_t(last.e1 - last.e0) *
                                                      dtype_size(plan.fragments[infos[last.frag].index].src_dtype);
            RESHARD_CUDA(cudaMemcpyAsync(scratch, host, used, cudaMemcpyHostToDevice, st));
            h2d += used;
          }
          for (const Chunk& p : b.pieces) scatter_piece(p, scratch + p.slot_off, st);
        }
        RESHARD_CUDA(cudaEventRecord(stg.event(t, s), st));
      }
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> l(err_mu);
      if (first_error.empty()) first_error = e.what();
      stop = true;
    }
  };

  // Zero fills first (no reads), on stream 0.
  try {
    DeviceGuard g(stg.device);
    for (const Fill& f : plan.fills) {
      if (f.rank != me) continue;
      const Buffer& b = target.buffers[f.buffer];
      const size_t es = dtype_size(b.dtype);
      uint8_t* base = static_cast<uint8_t*>(dev[f.buffer]) + f.base * int64_t(es);
      const Box rel = rel_box(f.extent);
      if (rel.numel() == 0) continue;
      written = true;
      if (box_is_dense(rel, f.strides))
        RESHARD_CUDA(cudaMemsetAsync(base, 0, uint64_t(rel.numel()) * es, stg.streams[0]));
      else
        RESHARD_CUDA(cuda_detail::launch_fill_zero(base, es, box_args(rel, f.strides), stg.streams[0]));
    }
  } catch (const std::exception& e) {
    first_error = e.what();
    stop = true;
  }

  const int nthreads = std::max(1, std::min<int>(T, int(batches.size())));
  std::vector<std::thread> pool;
  for (int t = 1; t < nthreads; ++t) pool.emplace_back(worker, t);
  worker(0);
  for (auto& th : pool) th.join();
  {
    DeviceGuard g(stg.device);
    for (int t = 0; t < T; ++t) {
      cudaError_t e = cudaStreamSynchronize(stg.streams[size_t(t)]);
      if (e != cudaSuccess && first_error.empty())
        first_error = std::string("cudaStreamSynchronize failed: ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
    }
  }
  maps.clear();  // unregisters and unmaps
  res.h2d = h2d;
  res.converted = converted;
  res.verified = verified;
  res.verified_bytes = verified_bytes;
  res.registered = registered;
  res.error = first_error;
  res.written = written;
  return res;
}

}  // namespace

LoadReport load_to_cuda(const CheckpointReader& ckpt, const Layout& target, const std::vector<void*>& dev,
                        Communicator& comm, const LoadOptions& options, const CudaLoadOptions& co,
                        CudaLoadStats* stats_out) {
  const auto t0 = Clock::now();
  LoadReport r;
  CudaLoadStats cs;
  const int me = comm.rank();
  if (target.topo.world_size() != comm.size())
    fail(ErrorCode::kInvalidArgument, prefix(comm), "target layout ", target.topo.to_string(), " has world size ",
         target.topo.world_size(), " but the job has ", comm.size(), " ranks");
  RESHARD_CHECK(dev.size() == target.buffers.size(), "one pointer slot per target buffer");
  if (options.verify != "off" && options.verify != "free" && options.verify != "full")
    fail(ErrorCode::kInvalidArgument, "load option verify='", options.verify, "' must be off, free or full");
  std::string source_mode = co.source == "auto" ? "pread" : co.source;
  if (source_mode != "pread" && source_mode != "mmap")
    fail(ErrorCode::kInvalidArgument, "CudaLoadOptions::source='", co.source, "' must be auto, pread or mmap");
  // The mmap source copies from the file mapping to the GPU without the CPU reading the bytes, so
  // it checks no checksum; "full" promises every unit is checked.
  if (source_mode == "mmap" && options.verify == "full")
    fail(ErrorCode::kInvalidArgument, "load option verify='full' needs CudaLoadOptions::source pread or auto: the mmap "
         "source copies pieces straight from the file mapping to the GPU and cannot check their checksums");

  int device = co.device;
  if (device < 0) RESHARD_CUDA(cudaGetDevice(&device));
  DeviceGuard guard(device);
  cs.device = device;

  Plan plan = plan_load(ckpt, target, options.plan, &r.plan_seconds);
  // verify="full" checks each unit once per machine whose ranks read it (machines may read their
  // own copies of the files): the same machines as load() finds (one all-gather).
  if (comm.size() > 1)
    plan.rank_machine = options.plan.rank_node.empty() ? node_of_ranks(comm, ckpt) : options.plan.rank_node;

  // Direct when no fragment crosses ranks, on every rank.
  int crosses = 0;
  for (const Fragment& f : plan.fragments) {
    for (uint32_t j = 0; j < f.num_deliveries; ++j) {
      const int dr = plan.deliveries[f.first_delivery + j].rank;
      if ((f.reader == me) != (dr == me)) crosses = 1;
    }
    if (crosses) break;
  }
  // Averaging replicas happens in the host executor's read step: plans with replica sources take
  // the host path (the same decision on every rank: the plan is the same everywhere).
  const bool direct = !co.force_host_path && plan.replica_sources.empty() && comm.all_reduce_max(crosses) == 0;

  ExecStats st;
  if (direct) {
    cs.path = "direct";
    if (source_mode == "mmap") {
      int ro = 0;
      if (cudaDeviceGetAttribute(&ro, cudaDevAttrHostRegisterReadOnlySupported, device) != cudaSuccess || !ro) {
        r.policies.push_back("CUDA: read-only host registration not supported on this device; using pread");
        source_mode = "pread";
      }
    }
    cs.source = source_mode;
    st.replica_report = run_preflight(plan, target, ckpt, dev, comm, options.plan.replica_policy,
                                      options.plan.replica_atol, &st,
                                      options.verify == "full"  ? VerifyMode::kFull
                                      : options.verify == "off" ? VerifyMode::kOff
                                                                : VerifyMode::kFree,
                                      co.io_threads > 0 ? co.io_threads : 16, options.plan.memory_budget);
    const int threads = co.io_threads > 0 ? co.io_threads : 16;
    const int slots = std::max(1, co.slots_per_thread);
    const uint64_t chunk = std::max<uint64_t>(co.chunk_bytes, 1 << 20);
    std::lock_guard<std::mutex> lock(g_staging_mu);  // one direct load at a time per process
    auto ts = Clock::now();
    try {
      g_staging.ensure(device, threads, slots, chunk);
    } catch (const Error& e) {
      agree_or_throw(comm, prefix(comm) + e.what(), ErrorCode::kInternal, "CUDA staging allocation", false);
    }
    agree_or_throw(comm, "", ErrorCode::kInternal, "CUDA staging allocation", false);
    cs.setup_seconds = since(ts);
    cs.io_threads = threads;
    cs.pinned_bytes = uint64_t(threads) * slots * chunk;
    auto tc = Clock::now();
    DirectResult d = run_direct(plan, target, ckpt, dev, me, threads, source_mode == "mmap", options.verify == "free", g_staging);
    cs.copy_seconds = since(tc);
    cs.h2d_bytes = d.h2d;
    cs.gpu_converted_bytes = d.converted;
    cs.chunks = d.chunks;
    cs.registered_bytes = d.registered;
    st.checksums_verified += d.verified;  // "full" counted its pre-flight checks already
    st.bytes_verified += d.verified_bytes;
    for (const Fragment& f : plan.fragments)
      if (f.reader == me) st.bytes_read += f.bytes();
    agree_or_throw(comm, d.error.empty() ? "" : prefix(comm) + d.error, ErrorCode::kDataLoss, "CUDA load", d.written);
    comm.barrier();
  } else {
    cs.path = "host";
    cs.source = "pread";
    // Pinned host mirrors of this rank's buffers; each finished buffer is copied on its own turn
    // of a few streams while the executor goes on with later waves.
    std::vector<void*> mirrors(target.buffers.size(), nullptr);
    std::vector<cudaStream_t> streams(4);
    auto cleanup = [&] {
      for (auto& s : streams)
        if (s) cudaStreamSynchronize(s), cudaStreamDestroy(s), s = nullptr;
      for (auto& m : mirrors)
        if (m) cudaFreeHost(m), m = nullptr;
    };
    try {
      auto ts = Clock::now();
      for (auto& s : streams) RESHARD_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      for (size_t b = 0; b < target.buffers.size(); ++b) {
        const Buffer& B = target.buffers[b];
        if (B.rank != me || B.numel == 0) continue;
        const uint64_t bytes = uint64_t(B.numel) * dtype_size(B.dtype);
        RESHARD_CUDA(cudaHostAlloc(&mirrors[b], bytes, cudaHostAllocPortable));
        cs.pinned_bytes += bytes;
      }
      cs.setup_seconds = since(ts);
      std::string copy_error;
      ExecOptions eo;
      eo.io_threads = co.io_threads > 0 ? co.io_threads : options.io_threads;
      eo.replica_policy = options.plan.replica_policy;
      eo.replica_atol = options.plan.replica_atol;
      eo.verify = options.verify == "off" ? VerifyMode::kOff : options.verify == "full" ? VerifyMode::kFull : VerifyMode::kFree;
      uint64_t turn = 0;
      eo.on_buffer_done = [&](int32_t b) {
        if (!copy_error.empty() || dev[b] == nullptr) return;
        const uint64_t bytes = uint64_t(target.buffers[b].numel) * dtype_size(target.buffers[b].dtype);
        cudaError_t e = cudaMemcpyAsync(dev[b], mirrors[b], bytes, cudaMemcpyHostToDevice, streams[turn++ % streams.size()]);
        if (e != cudaSuccess) copy_error = std::string("cudaMemcpyAsync: ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
        cs.h2d_bytes += bytes;
      };
      std::vector<void*> host(mirrors.begin(), mirrors.end());
      auto tc = Clock::now();
      st = execute_plan(plan, target, ckpt, host, comm, eo);
      for (auto& s : streams) {
        cudaError_t e = cudaStreamSynchronize(s);
        if (e != cudaSuccess && copy_error.empty())
          copy_error = std::string("cudaStreamSynchronize: ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
      }
      cs.copy_seconds = since(tc);
      agree_or_throw(comm, copy_error.empty() ? "" : prefix(comm) + copy_error, ErrorCode::kInternal,
                     "host-to-device copy", true);
    } catch (...) {
      cleanup();
      throw;
    }
    cleanup();
  }

  {
    const double plan_seconds = r.plan_seconds;
    r = assemble_load_report(plan, target, ckpt, st, direct ? cs.pinned_bytes : st.peak_staging_bytes,
                             options.plan.replica_policy, since(t0), comm);
    r.plan_seconds = plan_seconds;
  }
  r.policies.push_back("CUDA: " + cs.path + " path, source " + cs.source + ", device " + std::to_string(device));
  if (stats_out) *stats_out = cs;
  return r;
}

void cuda_release_staging() {
  std::lock_guard<std::mutex> lock(g_staging_mu);
  g_staging.release();
}

}  // namespace reshard

#endif  // RESHARD_CUDA_TARGET_IMPL
