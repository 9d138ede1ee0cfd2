// reshard bench: the measuring parts of the benchmark (scripts/bench.sh drives them, with the
// peers, from benchmarks/bench.py). Each subcommand prints one JSON object per measurement on
// stdout (rank 0 only under mpirun); nothing here asserts a time.
//
//   reshard bench load PATH --target LAYOUT [--repeat N] [--cold] [--no-dedup] [--one-read-per-job]
//                     [--verify off|free|full]
//       A distributed load as a trainer does it (load()), into this rank's preallocated and
//       pre-faulted target buffers; run under `mpirun -np K` with K = the target world size.
//       Per repeat: `seconds` from a barrier to the load's return on the slowest rank, opening
//       the checkpoint included (`open_seconds_max_rank`; `load_seconds`: load() alone), the
//       LoadReport's numbers, peak RSS (max over ranks of ru_maxrss), live bytes of the largest
//       rank, and the executor's read / exchange / scatter seconds (max over ranks).
//   reshard bench read-ceiling FILE... [--threads T] [--repeat N] [--cold] [--small-buffer]
//       Positioned reads of the files from T threads into one preallocated buffer as large as the
//       data (the copy into memory counts); --small-buffer reads through one small reused buffer
//       per thread instead (like `cat > /dev/null`; information only).
//   reshard bench memcpy --bytes N [--threads T] [--repeat N]
//       Memory-copy bandwidth (bytes copied per second) between two pre-faulted buffers.
//   reshard bench evict FILE...
//       posix_fadvise(DONTNEED) on each file; prints the resident fraction before and after.
// Units: GB = 10^9 bytes.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <system_error>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "reshard/checkpoint.h"
#include "reshard/comm_mpi.h"
#include "reshard/error.h"
#include "reshard/reshard.h"

namespace reshard::cli {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

uint64_t peak_rss_bytes() {
  struct rusage ru;
  ::getrusage(RUSAGE_SELF, &ru);
  return uint64_t(ru.ru_maxrss) * 1024;  // Linux: KiB
}


// Ceilings are measured with every core reading (not reshard::default_threads(), which caps at 8).
int all_cores() { return int(std::max(1u, std::thread::hardware_concurrency())); }

// Fraction of the file's pages resident in the page cache (mincore), -1 when unknown.
double resident_fraction(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  off_t size = ::lseek(fd, 0, SEEK_END);
  if (size <= 0) { ::close(fd); return size == 0 ? 1.0 : -1; }
  void* p = ::mmap(nullptr, size_t(size), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return -1;
  const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  const size_t n = (size_t(size) + page - 1) / page;
  std::vector<unsigned char> v(n);
  double frac = -1;
  if (::mincore(p, size_t(size), v.data()) == 0) {
    size_t in = 0;
    for (unsigned char c : v) in += c & 1;
    frac = double(in) / double(n);
  }
  ::munmap(p, size_t(size));
  return frac;
}

// Drops the files' clean pages from the page cache. Returns the resident fraction after (bytes
// weighted); -1 when unknown.
double evict_files(const std::vector<std::string>& files) {
  double in = 0, total = 0;
  for (const auto& f : files) {
    int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail(ErrorCode::kNotFound, "evict: cannot open ", f);
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    off_t size = ::lseek(fd, 0, SEEK_END);
    ::close(fd);
    double r = resident_fraction(f);
    if (r < 0) return -1;
    in += r * double(size);
    total += double(size);
  }
  return total > 0 ? in / total : 0;
}

// Touches every page so that page faults of fresh memory are not timed (a trainer's live tensors
// and a reused read buffer already exist).
// A page-aligned allocation of n bytes (at least one page), freed with std::free. The ceilings
// read and copy into page-aligned memory: `rep movsb`, which glibc's memcpy and the kernel's copy
// to user memory (pread) use, runs about 3x slower on this machine's CPU when destination and
// source differ by an offset that is not a multiple of 64 bytes (measured: 2.2-2.8 GB/s
// at offsets 1, 8 and 16 against 8-9 GB/s at 0 and 64-4032, 1 MiB copies, one core). new[] of
// a large block returns memory 16 bytes past a page boundary, which had slowed the read ceiling
// of files read back to back into it: 0.21-0.32 s against 0.11-0.14 s for the 1.88 GB of /tmp/p8n.
std::unique_ptr<uint8_t, decltype(&std::free)> page_aligned(uint64_t n) {
  if (n > (uint64_t(1) << 62)) fail(ErrorCode::kFailedPrecondition, "cannot allocate ", n, " bytes");
  const uint64_t bytes = (std::max<uint64_t>(n, 1) + 4095) / 4096 * 4096;
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(4096, bytes));
  if (!p) fail(ErrorCode::kFailedPrecondition, "cannot allocate ", bytes, " bytes");
  return {p, &std::free};
}

// Runs worker(k) on `threads` threads and joins them; a thread that cannot be started joins the
// ones that were and fails (kFailedPrecondition) instead of terminating the process.
template <typename Fn>
void run_threads(int threads, Fn worker) {
  std::vector<std::thread> pool;
  pool.reserve(size_t(threads));
  std::string err;
  try {
    for (int k = 0; k < threads; ++k) pool.emplace_back(worker, k);
  } catch (const std::system_error& e) {
    err = e.what();
  }
  for (auto& th : pool) th.join();
  if (!err.empty())
    fail(ErrorCode::kFailedPrecondition, "cannot start ", threads, " threads (", pool.size(), " started): ", err);
}

void prefault(uint8_t* p, size_t n) {
  const size_t page = 4096;
  for (size_t i = 0; i < n; i += page) p[i] = 0;
  if (n) p[n - 1] = 0;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

// ---------------------------------------------------------------------------------------------
struct LoadArgs {
  std::string path, target, model, budget = "1GiB", verify = kDefaultVerify, label;
  int repeat = 1, io_threads = 4;
  bool cold = false, no_dedup = false, one_read_per_job = false;
};

int run_load(const LoadArgs& a) {
#ifdef RESHARD_HAVE_MPI
  std::unique_ptr<Communicator> comm = make_world_communicator();
#else
  std::unique_ptr<Communicator> comm = make_local_communicator();
#endif
  const int me = comm->rank();
  OpenOptions oo;
  if (!a.model.empty()) oo.model_path = resolve_model_path(a.model);
  auto ckpt = open_checkpoint(a.path, oo);
  Topology topo = Topology::parse(a.target);
  Layout target = derive_layout(ckpt->source().layout.model, topo);
  // This rank's live buffers: allocated and touched once, reused by every repeat. Each starts on
  // a 64-byte boundary, as torch's CPU allocator places tensors.
  std::vector<void*> ptrs(target.buffers.size(), nullptr);
  auto padded = [](const Buffer& b) { return (uint64_t(b.numel) * dtype_size(b.dtype) + 63) / 64 * 64; };
  uint64_t live = 0, span = 0;
  for (const auto& b : target.buffers)
    if (b.rank == me) {
      live += uint64_t(b.numel) * dtype_size(b.dtype);
      span += padded(b);
    }
  std::unique_ptr<uint8_t, decltype(&std::free)> mem(
      static_cast<uint8_t*>(std::aligned_alloc(4096, (std::max<uint64_t>(span, 1) + 4095) / 4096 * 4096)), &std::free);
  if (!mem) fail(ErrorCode::kFailedPrecondition, "cannot allocate ", span, " bytes of live buffers");
  prefault(mem.get(), span);
  {
    uint64_t at = 0;
    for (size_t b = 0; b < target.buffers.size(); ++b)
      if (target.buffers[b].rank == me) {
        ptrs[b] = mem.get() + at;
        at += padded(target.buffers[b]);
      }
  }
  const uint64_t rss_before = peak_rss_bytes();
  LoadOptions lo;
  lo.plan.memory_budget = parse_size(a.budget, "--memory-budget");
  lo.plan.dedup = !a.no_dedup;
  lo.plan.node_local_reads = !a.one_read_per_job;
  lo.io_threads = a.io_threads;
  lo.verify = a.verify;
  // --cold evicts every file of the step folder: the data files and what the open reads
  // (metadata.json; DeepSpeed's pickles are in the data files), since the open is timed too.
  std::vector<std::string> files = ckpt->source().files;
  {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(ckpt->path(), ec))
      if (e.is_regular_file(ec) && std::find(files.begin(), files.end(), e.path().string()) == files.end())
        files.push_back(e.path().string());
  }
  for (int rep = 0; rep < a.repeat; ++rep) {
    // Each repeat opens the checkpoint afresh, as a restarting trainer does: no file mapping or
    // handle survives from the previous load. The time runs from a barrier to the load's return
    // on the slowest rank and includes the open (metadata, file headers; DCP's and UCP's loads
    // read their metadata inside the time too).
    ckpt.reset();
    double resident = -2;
    if (a.cold && me == 0) resident = evict_files(files);
    comm->barrier();
    const auto t0 = Clock::now();
    ckpt = open_checkpoint(a.path, oo);
    const double open_seconds = since(t0);
    LoadReport r = load(*ckpt, target, ptrs, *comm, lo);
    const double local_seconds = since(t0);
    nlohmann::json j = nlohmann::json::parse(r.to_json());
    j.erase("policies");
    j.erase("not_carried");
    j.erase("replica_report");
    j["repeat"] = rep;
    j["load_seconds"] = r.seconds;  // load() alone (LoadReport::seconds: planning to return)
    j["seconds"] = double(comm->all_reduce_max(int64_t(local_seconds * 1e6))) / 1e6;
    j["gbps"] = j["seconds"].get<double>() > 0 ? double(r.target_bytes) / j["seconds"].get<double>() / 1e9 : 0;
    j["ranks"] = comm->size();
    j["cold"] = a.cold;
    if (a.cold) j["resident_fraction_after_evict"] = resident;
    j["dedup"] = !a.no_dedup;
    j["verify"] = a.verify;
    j["io_threads"] = a.io_threads;
    j["memory_budget_bytes"] = lo.plan.memory_budget;
    // Storage-level: bytes a second rank of the same machine copies out of the shared page
    // cache are not read from storage again. The copies out of files count in the other figure.
    j["read_amplification"] =
        r.bytes_needed ? double(r.bytes_read - r.bytes_reread_on_node) / double(r.bytes_needed) : 1.0;
    j["read_amplification_copies"] = r.bytes_needed ? double(r.bytes_read) / double(r.bytes_needed) : 1.0;
    j["node_local_reads"] = lo.plan.node_local_reads;
    j["peak_rss_bytes"] = comm->all_reduce_max(int64_t(peak_rss_bytes()));
    j["rss_before_load_bytes"] = comm->all_reduce_max(int64_t(rss_before));
    j["live_bytes_max_rank"] = comm->all_reduce_max(int64_t(live));
    // Largest rank's RSS above its live tensors (binary, MPI and staging included).
    j["rss_above_live_bytes"] = comm->all_reduce_max(int64_t(peak_rss_bytes()) - int64_t(live));
    // Phases of the executor, max over ranks (the slowest rank sets the pace).
    auto mx = [&](double v) { return double(comm->all_reduce_max(int64_t(v * 1e6))) / 1e6; };
    j["read_seconds_max_rank"] = mx(r.read_seconds);
    j["exchange_seconds_max_rank"] = mx(r.exchange_seconds);
    j["scatter_seconds_max_rank"] = mx(r.scatter_seconds);
    j["copy_seconds_max_rank"] = mx(r.copy_seconds);
    j["preflight_seconds_max_rank"] = mx(r.preflight_seconds);
    j["open_seconds_max_rank"] = mx(open_seconds);
    j["bytes_read_max_rank"] = comm->all_reduce_max(int64_t(r.rank_bytes_read));
    j["bytes_sent_max_rank"] = comm->all_reduce_max(int64_t(r.rank_bytes_sent));
    if (!a.label.empty()) j["label"] = a.label;
    if (me == 0) std::cout << j.dump() << std::endl;
  }
  comm->barrier();
  return 0;
}

// ---------------------------------------------------------------------------------------------
struct CeilingArgs {
  std::vector<std::string> files;
  int threads = 0, repeat = 1;
  std::string chunk = "8MiB", small = "1MiB";
  bool cold = false, small_buffer = false;
};

int run_read_ceiling(const CeilingArgs& a) {
  const int T = a.threads > 0 ? a.threads : all_cores();
  const uint64_t chunk = parse_size(a.chunk, "--chunk");
  if (chunk == 0 || chunk % 4096 != 0)
    fail(ErrorCode::kInvalidArgument, "read-ceiling: --chunk ", a.chunk, " must be a positive multiple of 4096 bytes");
  struct Job { int fd; uint64_t off, len, dst; };
  std::vector<int> fds;
  std::vector<Job> jobs;
  uint64_t total = 0;
  uint64_t span = 0;  // bytes of the buffer: each file starts on a page boundary of it
  for (const auto& f : a.files) {
    int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail(ErrorCode::kNotFound, "read-ceiling: cannot open ", f);
    fds.push_back(fd);
    uint64_t size = uint64_t(::lseek(fd, 0, SEEK_END));
    // Byte o of the file goes to a buffer address with the same offset within its page as o has
    // in the file's (see page_aligned): what a careful reader does.
    for (uint64_t o = 0; o < size; o += chunk) jobs.push_back({fd, o, std::min(chunk, size - o), span + o});
    total += size;
    span += (size + 4095) / 4096 * 4096;
  }
  // Large-buffer mode: one buffer as large as the data (plus less than a page per file), touched
  // once before timing.
  std::unique_ptr<uint8_t, decltype(&std::free)> big(nullptr, &std::free);
  const uint64_t small = parse_size(a.small, "--small");
  // Small-buffer mode: one reused buffer per thread, allocated here (an allocation that fails
  // is an error, not an exception inside a thread).
  std::vector<std::unique_ptr<uint8_t, decltype(&std::free)>> small_buffers;
  if (!a.small_buffer) {
    big = page_aligned(span);
    prefault(big.get(), span);
  } else {
    for (int k = 0; k < T; ++k) {
      small_buffers.push_back(page_aligned(small));
      prefault(small_buffers.back().get(), small);
    }
  }
  std::vector<double> secs;
  double resident = -2;
  for (int rep = 0; rep < a.repeat; ++rep) {
    if (a.cold) resident = evict_files(a.files);
    std::atomic<size_t> next{0};
    std::atomic<bool> bad{false};
    auto worker = [&](int k) {
      uint8_t* sb = a.small_buffer ? small_buffers[size_t(k)].get() : nullptr;
      while (true) {
        size_t i = next.fetch_add(1);
        if (i >= jobs.size()) return;
        const Job& j = jobs[i];
        uint64_t done = 0;
        while (done < j.len) {
          uint64_t n = j.len - done;
          uint8_t* dst;
          if (a.small_buffer) {
            n = std::min(n, small);
            dst = sb;
          } else {
            dst = big.get() + j.dst + done;
          }
          ssize_t got = ::pread(j.fd, dst, n, off_t(j.off + done));
          if (got <= 0) { bad = true; return; }
          done += uint64_t(got);
        }
      }
    };
    auto t0 = Clock::now();
    run_threads(T, worker);
    secs.push_back(since(t0));
    if (bad) fail(ErrorCode::kDataLoss, "read-ceiling: a read failed or ended early");
  }
  for (int fd : fds) ::close(fd);
  nlohmann::json j;
  j["system"] = a.small_buffer ? "read_small_buffer" : "read_ceiling";
  j["bytes"] = total;
  j["files"] = a.files.size();
  j["threads"] = T;
  j["cold"] = a.cold;
  if (a.cold) j["resident_fraction_after_evict"] = resident;
  j["seconds_all"] = secs;
  j["seconds"] = median(secs);
  j["gbps"] = j["seconds"].get<double>() > 0 ? double(total) / j["seconds"].get<double>() / 1e9 : 0;
  j["buffer_bytes"] = a.small_buffer ? small : span;
  j["peak_rss_bytes"] = peak_rss_bytes();
  std::cout << j.dump() << std::endl;
  return 0;
}

// ---------------------------------------------------------------------------------------------
struct MemcpyArgs {
  std::string bytes = "1GiB";
  int threads = 0, repeat = 3;
};

int run_memcpy(const MemcpyArgs& a) {
  const int T = a.threads > 0 ? a.threads : all_cores();
  const uint64_t n = parse_size(a.bytes, "--bytes");
  auto src = page_aligned(n), dst = page_aligned(n);
  std::memset(src.get(), 1, n);
  prefault(dst.get(), n);
  std::vector<double> secs;
  for (int rep = 0; rep < a.repeat; ++rep) {
    auto t0 = Clock::now();
    const uint64_t per = (n + T - 1) / T;
    run_threads(T, [&](int k) {
      uint64_t b = std::min(n, per * uint64_t(k)), e = std::min(n, per * uint64_t(k + 1));
      std::memcpy(dst.get() + b, src.get() + b, e - b);
    });
    secs.push_back(since(t0));
  }
  nlohmann::json j;
  j["system"] = "memcpy_ceiling";
  j["bytes"] = n;
  j["threads"] = T;
  j["seconds_all"] = secs;
  j["seconds"] = median(secs);
  j["gbps"] = double(n) / median(secs) / 1e9;
  j["peak_rss_bytes"] = peak_rss_bytes();
  std::cout << j.dump() << std::endl;
  return 0;
}
}  // namespace

Command bench_command() {
  auto la = std::make_shared<LoadArgs>();
  auto ca = std::make_shared<CeilingArgs>();
  auto ma = std::make_shared<MemcpyArgs>();
  auto ev = std::make_shared<std::vector<std::string>>();
  auto which = std::make_shared<std::string>();
  Command c;
  c.add = [=](CLI::App& app) {
    CLI::App* s = app.add_subcommand("bench", "Benchmark parts: loads, read and memcpy ceilings (scripts/bench.sh runs them all)");
    s->require_subcommand(1);
    CLI::App* l = s->add_subcommand("load", "Time load() of a checkpoint into this rank's buffers (run under mpirun -np K)");
    l->add_option("path", la->path, "Checkpoint (root or step folder)")->required();
    l->add_option("--target", la->target, "Target layout, e.g. tp=2,pp=1,dp=1,zero=1 (world size = ranks)")->required();
    l->add_option("--model", la->model, "Model YAML for checkpoints that do not record it (DeepSpeed)");
    l->add_option("--repeat", la->repeat, "Loads to time (default 1)")->check(CLI::Range(1, 1 << 20));
    l->add_option("--io-threads", la->io_threads, "Read threads per rank (default 4)");
    l->add_option("--memory-budget", la->budget, "Per-rank staging budget per wave (default 1GiB)");
    l->add_option("--verify", la->verify, std::string("Checksum checks while loading: off, free or full (default ") + kDefaultVerify + "; see LoadOptions::verify)")
        ->check(CLI::IsMember({"off", "free", "full"}));
    l->add_option("--label", la->label, "Free text copied into the output");
    l->add_flag("--cold", la->cold, "Evict the step folder's files (data and metadata) from the page cache before each load");
    l->add_flag("--no-dedup", la->no_dedup, "Each rank reads what it needs (no fan-out)");
    l->add_flag("--one-read-per-job", la->one_read_per_job,
                "Dedup across the whole job: ranks on one machine also exchange instead of each reading "
                "from the page cache");
    l->callback([which] { *which = "load"; });
    CLI::App* r = s->add_subcommand("read-ceiling", "Positioned reads of files from all cores into one buffer as large as the data");
    r->add_option("files", ca->files, "Files to read")->required();
    r->add_option("--threads", ca->threads, "Threads, 1..1024 (default: all cores)")->check(CLI::Range(1, 1024));
    r->add_option("--repeat", ca->repeat, "Timed passes (median reported)")->check(CLI::Range(1, 1 << 20));
    r->add_option("--chunk", ca->chunk, "Bytes per positioned read (default 8MiB)");
    r->add_option("--small", ca->small, "Size of the reused buffer with --small-buffer (default 1MiB)");
    r->add_flag("--cold", ca->cold, "Evict the files from the page cache before each pass");
    r->add_flag("--small-buffer", ca->small_buffer, "Read through a small reused buffer per thread (information only)");
    r->callback([which] { *which = "read-ceiling"; });
    CLI::App* m = s->add_subcommand("memcpy", "Memory-copy bandwidth from all cores");
    m->add_option("--bytes", ma->bytes, "Bytes per copy (default 1GiB)");
    m->add_option("--threads", ma->threads, "Threads, 1..1024 (default: all cores)")->check(CLI::Range(1, 1024));
    m->add_option("--repeat", ma->repeat, "Timed copies (median reported)")->check(CLI::Range(1, 1 << 20));
    m->callback([which] { *which = "memcpy"; });
    CLI::App* e = s->add_subcommand("evict", "Drop files from the page cache (posix_fadvise DONTNEED)");
    e->add_option("files", *ev, "Files")->required();
    e->callback([which] { *which = "evict"; });
    return s;
  };
  c.run = [=]() {
    if (*which == "load") return run_load(*la);
    if (*which == "read-ceiling") return run_read_ceiling(*ca);
    if (*which == "memcpy") return run_memcpy(*ma);
    if (*which == "evict") {
      double before = 0;
      for (const auto& f : *ev) before += resident_fraction(f);
      double after = evict_files(*ev);
      nlohmann::json j;
      j["files"] = ev->size();
      j["resident_fraction_before_mean"] = ev->empty() ? 0 : before / double(ev->size());
      j["resident_fraction_after"] = after;
      std::cout << j.dump() << std::endl;
      return 0;
    }
    fail(ErrorCode::kInvalidArgument, "bench: unknown subcommand");
  };
  return c;
}

}  // namespace reshard::cli
