#include "exec/executor.h"

#include "io/parallel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <sstream>
#include <memory>
#include <thread>
#include <unordered_map>

#include <sys/mman.h>

#include "core/xxh3_range.h"
#include "io/file.h"
#include "reshard/consolidate.h"
#include "reshard/error.h"
#include "reshard/simulate.h"
#include "reshard/strided.h"

namespace reshard {
namespace {

// A fragment that this many other ranks need is fanned out by a group broadcast.
constexpr int kFanoutMinReceivers = 3;

using Clock = std::chrono::steady_clock;
// Bytes of a checked fragment copied and then hashed while still in cache (see check_slabs):
// well inside a core's L2 (1 MiB on the machines we measure on), with room for the destination's
// write-combining and other threads.
constexpr uint64_t kCheckSlabBytes = 256 << 10;

// Granularity of dropping source pages from a file mapping: a multiple of the PMD size on x86-64
// and arm64 (2 MiB with 4 KiB pages), the unit the kernel maps 2 MiB page-cache folios in.
// Dropping part of a PMD-mapped region unmaps all of it, so a neighbour still being copied would
// fault it in again. 16 MiB rather than 2 MiB: each drop is an madvise that flushes
// the TLBs of every core running one of this process's copy threads, and eight times fewer of
// them took the 2 GB pipeline target from 0.207 to 0.190 s (8 interleaved rounds; tp merge
// 0.184 -> 0.178 s, 8-rank split 0.206 -> 0.201 s, dp shrink no change) for 20-54 MB more peak
// RSS (at most one undropped chunk per copy in flight).
constexpr uint64_t kDropChunkBytes = uint64_t(16) << 20;

// Which file-mapping chunks this rank's copies of one wave read, and how many of their bytes are
// still to be read. When the last copy touching a chunk finishes, the rank's mapping of the
// chunk is dropped (io::drop_mapped_pages): the mapped share of its RSS is then what it is
// copying now, not every page it has read, and unmapping runs on the copy threads instead of in
// one munmap when the reader goes. Byte counts are over each fragment's span in the file
// (strided fragments count the gaps too, consistently on both sides).
class MappedChunkDrops {
 public:
  // A fragment whose bytes [lo, hi) of `file` will be read from `map` (the file's mapping) once.
  void expect(int32_t file, const uint8_t* map, uint64_t lo, uint64_t hi) {
    for_chunks(file, lo, hi, [&](uint64_t key, uint64_t a, uint64_t b) {
      auto [it, fresh] = index_.try_emplace(key, chunks_.size());
      if (fresh) chunks_.push_back(std::make_unique<Chunk>(map, a, b));
      Chunk& c = *chunks_[it->second];
      c.lo = std::min(c.lo, a);
      c.hi = std::max(c.hi, b);
      c.left.fetch_add(b - a, std::memory_order_relaxed);
    });
  }
  // That read is done (thread-safe; expect() calls must all come first).
  void done(int32_t file, uint64_t lo, uint64_t hi) {
    for_chunks(file, lo, hi, [&](uint64_t key, uint64_t a, uint64_t b) {
      auto it = index_.find(key);
      if (it == index_.end()) return;
      Chunk& c = *chunks_[it->second];
      if (c.left.fetch_sub(b - a, std::memory_order_acq_rel) == b - a)
        io::drop_mapped_pages(c.map + c.lo, c.hi - c.lo);
    });
  }

 private:
  struct Chunk {
    Chunk(const uint8_t* m, uint64_t a, uint64_t b) : map(m), lo(a), hi(b) {}
    const uint8_t* map;
    uint64_t lo, hi;  // bytes of the chunk some expected read covers
    std::atomic<uint64_t> left{0};
  };
  template <class F>
  static void for_chunks(int32_t file, uint64_t lo, uint64_t hi, const F& f) {
    for (uint64_t k = lo / kDropChunkBytes; k * kDropChunkBytes < hi; ++k) {
      const uint64_t a = std::max(lo, k * kDropChunkBytes), b = std::min(hi, (k + 1) * kDropChunkBytes);
      f((uint64_t(uint32_t(file)) << 44) | k, a, b);
    }
  }
  std::unordered_map<uint64_t, size_t> index_;
  std::vector<std::unique_ptr<Chunk>> chunks_;
};

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Runs a copy into target buffer `b`; an error it raises (a value that does not fit the target
// dtype) names the buffer.
template <typename Fn>
void naming_buffer(const Buffer& b, Fn fn) {
  try {
    fn();
  } catch (const Error& e) {
    throw Error(e.code(), "buffer " + b.name + ": " + e.what());
  }
}

std::string prefix(const Communicator& c) {
  return "[rank " + std::to_string(c.rank()) + "/" + std::to_string(c.size()) + "] ";
}

// Gathers one status string per rank; throws on every rank if any is non-empty. Whether live
// tensors were written travels with the status, so every rank raises the same code and message:
// the job's state is unusable once any rank wrote (a rank that wrote nothing itself must not
// report "nothing written" while its peers abort with "partly written").
void agree_or_throw(Communicator& comm, const std::string& mine, ErrorCode code, const std::string& what,
                    bool live_written) {
  std::vector<std::string> all = comm.all_gather_strings((live_written ? "1" : "0") + mine);
  std::string msg;
  int nbad = 0;
  bool any_written = false;
  for (size_t r = 0; r < all.size(); ++r) {
    any_written |= !all[r].empty() && all[r][0] == '1';
    if (all[r].size() <= 1) continue;
    if (nbad++ < 8) msg += (msg.empty() ? "" : "; ") + all[r].substr(1);
  }
  if (nbad == 0) return;
  if (nbad > 8) msg += "; ... (" + std::to_string(nbad) + " ranks reported problems)";
  if (any_written)
    fail(ErrorCode::kFailedPrecondition, what, " failed after live tensors were partly written; the live state is "
         "unusable and the trainer must abort: ", msg);
  fail(code, what, " failed before any live tensor was written: ", msg);
}

// Runs fn(i) for i in [0, n) on up to `threads` threads (reshard::parallel_for); returns the
// first error's message instead of throwing it, for the ranks to agree on.
template <typename Fn>
std::string first_error_of(size_t n, int threads, Fn fn) {
  try {
    reshard::parallel_for(n, threads, [&](size_t i, int) { fn(i); });
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}
// Address of element `at` of live buffer `buffer` (this rank's memory for it).
uint8_t* live_at(const Layout& target, const std::vector<void*>& buffers, int32_t buffer, int64_t at) {
  return static_cast<uint8_t*>(buffers[size_t(buffer)]) + at * int64_t(dtype_size(target.buffers[size_t(buffer)].dtype));
}

// A box of the same shape at the origin (a fragment's box relative to its own start).
Box at_origin(Box b) {
  for (int d = 0; d < b.ndim; ++d) b.off[d] = 0;
  return b;
}

// Overwrites rank `me`'s live copies of fragment `f` (its deliveries to `me`) with poison (NaN;
// all-ones bytes for non-float dtypes): what a failed checksum leaves in a live tensor.
void poison_live_copies(const Plan& plan, const Layout& target, const std::vector<void*>& buffers, int me,
                        const Fragment& f) {
  const Box rel = at_origin(f.box);
  for (uint32_t j = 0; j < f.num_deliveries; ++j) {
    const Delivery& dv = plan.deliveries[f.first_delivery + j];
    if (dv.rank != me) continue;
    fill_poison_box(live_at(target, buffers, dv.buffer, dv.base), target.buffers[dv.buffer].dtype, rel, dv.strides);
  }
}

// Distinct ranks other than the reader that receive a fragment.
int remote_ranks(const Plan& plan, const Fragment& f) {
  int n = 0, last = -1;
  for (uint32_t k = 0; k < f.num_deliveries; ++k) {
    int r = plan.deliveries[f.first_delivery + k].rank;  // sorted by rank
    if (r != last && r != f.reader) ++n;
    last = r;
  }
  return n;
}

}  // namespace

std::vector<std::string> run_preflight(const Plan& plan, const Layout& target, const CheckpointReader& source,
                                       const std::vector<void*>& buffers, Communicator& comm, ReplicaPolicy policy,
                                       double atol, ExecStats* stats, VerifyMode verify, int io_threads,
                                       uint64_t memory_budget) {
  const int me = comm.rank();
  const int W = comm.size();
  const SourceLayout& src = source.source();
  ReadFn read = [&](int32_t file, uint64_t off, uint64_t len, void* dst) { source.read(file, off, len, dst); };
  std::vector<std::string> report;
  // 1-2. Same plan (and checksum mode) everywhere, and the pre-flight of the files this rank reads
  // and its buffers: one all-gather for both (each round costs every rank a wake-up; on 8 ranks
  // sharing 2 cores a round is ~2 ms). Then the checksum units (verify="full") and the replica
  // comparisons, each only when there is something to check; whether there is is the same on
  // every rank (the plan and the mode agree), so every rank takes the same collectives.
  {
    std::ostringstream problems;
    std::vector<uint64_t> need_end(src.files.size(), 0);
    auto note_range = [&](int32_t file, uint64_t base, DType dt, const Box& box, const std::array<int64_t, kMaxDims>& strides) {
      const Box rel = at_origin(box);
      for_each_run(rel, strides, [&](int64_t off, int64_t cnt, int64_t) {
        need_end[file] = std::max(need_end[file], base + uint64_t(off + cnt) * dtype_size(dt));
      });
    };
    for (const Fragment& f : plan.fragments)
      if (f.reader == me) note_range(f.file, f.byte_base, f.src_dtype, f.box, f.src_strides);
    for (const auto& c : plan.replica_compares)
      if (c.checker == me) {
        note_range(c.authoritative.file, c.authoritative.byte_base, c.authoritative.dtype, c.box, c.authoritative.strides);
        note_range(c.replica.file, c.replica.byte_base, c.replica.dtype, c.box, c.replica.strides);
      }
    // verify="full": every checksum unit the plan touches (the same list on every rank).
    // verify="free": the whole pieces the memory budget cut into several fragments
    // (Plan::budget_splits), which no fragment checks as it is read.
    std::vector<ChecksumCheck> checks;
    if (verify == VerifyMode::kFull) checks = checksum_checks(plan, source.checksum_units());
    if (verify == VerifyMode::kFree)
      for (const BudgetSplit& b : plan.budget_splits)
        if (source.has_checksum(b.file, b.byte_base, b.bytes)) checks.push_back({{b.file, b.byte_base, b.bytes}, b.checker, false});
    std::vector<size_t> my_checks;
    for (size_t i = 0; i < checks.size(); ++i)
      if (checks[i].checker == me) {
        my_checks.push_back(i);
        const ChecksumUnit& u = checks[i].unit;
        need_end[u.file] = std::max(need_end[u.file], u.offset + u.length);
      }
    int nprob = 0;
    for (size_t f = 0; f < need_end.size(); ++f) {
      if (need_end[f] == 0) continue;
      try {
        uint64_t size = source.file_size(int32_t(f));
        if (size < need_end[f]) {
          if (nprob++ < 4) problems << (nprob > 1 ? "; " : "") << "file " << src.files[f] << " has " << size
                                    << " bytes but the plan reads up to byte " << need_end[f] << " (truncated?)";
        }
      } catch (const Error& e) {
        if (nprob++ < 4) problems << (nprob > 1 ? "; " : "") << e.what();
      }
    }
    // The caller's memory: every buffer of this rank given, and no two overlapping (two buffers in
    // one place would load one's values over the other's, silently).
    std::ostringstream arg_problems;
    int narg = 0;
    for (size_t b = 0; b < target.buffers.size(); ++b) {
      const Buffer& tb = target.buffers[b];
      if (tb.rank == me && tb.numel > 0 && buffers[b] == nullptr && narg++ < 4)
        arg_problems << (narg > 1 ? "; " : "") << "no memory given for target buffer " << tb.name;
    }
    const std::string overlap = overlapping_buffers(target, me, std::vector<const void*>(buffers.begin(), buffers.end()));
    if (!overlap.empty() && narg++ < 4)
      arg_problems << (narg > 1 ? "; " : "") << "target " << overlap << ": each buffer needs memory of its own";
    {
      // Same plan, checksum mode and replica policy everywhere (a policy can leave the plan
      // unchanged and still change what is loaded).
      std::ostringstream hs;
      hs << plan.hash() << "/verify=" << int(verify) << "/replicas=" << int(policy) << "/atol=" << atol;
      const std::string h = hs.str();
      // Which checkpoint: the reader's fingerprint and the iteration decide; the folder is named
      // in the message only (machines may mount it at different paths).
      const std::string fingerprint = source.fingerprint().empty() ? "none" : source.fingerprint();
      const std::string id = fingerprint + ", iteration " + std::to_string(source.state().iteration);
      std::string folder = source.path();
      for (char& c : folder)
        if (c == '\t' || c == '\n') c = '?';
      // Status: "" or 'A' (the caller's arguments) / 'D' (the files) + the problems.
      std::string mine;
      if (narg) mine = "A" + prefix(comm) + arg_problems.str();
      else if (nprob) mine = "D" + prefix(comm) + problems.str();
      // Per rank: id \t folder \t plan hash \n status.
      struct Said { std::string id, folder, hash, status; };
      std::vector<Said> said;
      for (const std::string& a : comm.all_gather_strings(id + '\t' + folder + '\t' + h + '\n' + mine)) {
        const size_t t1 = a.find('\t'), t2 = a.find('\t', t1 + 1), nl = a.find('\n', t2 + 1);
        said.push_back({a.substr(0, t1), a.substr(t1 + 1, t2 - t1 - 1), a.substr(t2 + 1, nl - t2 - 1),
                        nl == std::string::npos ? std::string() : a.substr(nl + 1)});
      }
      {
        // Ranks that opened different checkpoints (another step, `latest` read while a save
        // rewrote it, another copy) must not load a mix of them: every rank fails, naming each
        // group of ranks and what it opened.
        std::vector<std::pair<std::string, std::string>> groups;  // (id, "folder (...) on rank(s) ...")
        for (int r = 0; r < W; ++r) {
          const Said& x = said[size_t(r)];
          auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& y) { return y.first == x.id; });
          if (g != groups.end()) {
            g->second += "," + std::to_string(r);
            continue;
          }
          groups.push_back({x.id, x.folder + " (fingerprint " + x.id + ") on rank(s) " + std::to_string(r)});
        }
        if (groups.size() > 1) {
          std::string msg;
          for (size_t i = 0; i < groups.size() && i < 4; ++i) msg += (i ? "; " : "") + groups[i].second;
          if (groups.size() > 4) msg += "; ... (" + std::to_string(groups.size()) + " different checkpoints)";
          fail(ErrorCode::kFailedPrecondition, "ranks opened different checkpoints: ", msg,
               "; every rank must open the same step (no live tensor was written)");
        }
      }
      std::string msg;
      int nbad = 0;
      bool args = false;
      for (int r = 0; r < W; ++r) {
        const std::string& theirs = said[size_t(r)].hash;
        const std::string& status = said[size_t(r)].status;
        if (theirs != h)
          fail(ErrorCode::kInternal, prefix(comm), "plan hash, checksum mode or replica policy differs between ranks (rank ",
               r, " has ", theirs, ", this rank ", h, "): ranks were given different inputs");
        if (status.empty()) continue;
        args |= status[0] == 'A';
        if (nbad++ < 8) msg += (msg.empty() ? "" : "; ") + status.substr(1);
      }
      if (nbad > 8) msg += "; ... (" + std::to_string(nbad) + " ranks reported problems)";
      if (nbad && args) fail(ErrorCode::kInvalidArgument, "pre-flight check failed before any live tensor was written: ", msg);
      if (nbad) fail(ErrorCode::kDataLoss, "pre-flight check failed before any live tensor was written: ", msg);
    }

    // verify="full": every unit read whole by its checker and checked before any write (all or
    // nothing).
    std::vector<ChecksumUnit> my_units;
    uint64_t unit_bytes = 0;
    for (size_t i : my_checks) {
      my_units.push_back(checks[i].unit);
      unit_bytes += checks[i].unit.length;
    }
    if (verify == VerifyMode::kFull || !checks.empty()) {
      // "full": pages stay mapped, since this rank is the unit's main reader and its copy step
      // reads them next (faulting them in again would slow the load down); the copy step drops
      // them as it finishes each. "free" checks only pieces the budget cut, i.e. pieces larger
      // than what a wave may hold: each is dropped once checked, so the check does not hold
      // more than the budget mapped (the copy step maps it again, wave by wave).
      std::vector<std::string> bad_units =
          check_checksum_units(source, my_units, io_threads, /*drop_pages=*/verify == VerifyMode::kFree);
      std::string uerr;
      for (size_t i = 0; i < bad_units.size() && i < 4; ++i) uerr += (i ? "; " : "") + bad_units[i];
      if (bad_units.size() > 4) uerr += "; ... (" + std::to_string(bad_units.size()) + " units fail)";
      stats->verify_bytes_read += unit_bytes;
      stats->bytes_verified += unit_bytes;
      stats->checksums_verified += my_units.size();
      agree_or_throw(comm, uerr.empty() ? "" : prefix(comm) + uerr, ErrorCode::kDataLoss,
                     verify == VerifyMode::kFull ? "checksum check (verify=\"full\")"
                                                 : "checksum check (verify=\"free\": pieces the memory budget splits)",
                     false);
    }
    if (verify == VerifyMode::kFull) {
      // The checkpoint's weights against its fp32 master (check_weights_against_master: swapped
      // DeepSpeed tp layer files, files from two saves), the ranks sharing the tensors; after the
      // checksums, so that a damaged file is named as such first. The load compares replicas
      // itself, below, under its own policy.
      std::string merr;
      try {
        MasterCheckOptions mo;
        mo.part = me;
        mo.parts = W;
        mo.replicas = false;
        mo.threads = io_threads;
        mo.memory_budget = std::min(mo.memory_budget, memory_budget);
        const MasterCheck mc = check_weights_against_master(source, mo);
        stats->verify_bytes_read += mc.bytes_read;
        stats->peak_verify_bytes = std::max(stats->peak_verify_bytes, mc.peak_bytes_held);
        for (size_t i = 0; i < mc.mismatches.size() && i < 4; ++i)
          merr += (i ? "; " : "") + mc.mismatches[i].to_string();
        if (mc.mismatches.size() > 4) merr += "; ... (" + std::to_string(mc.mismatches.size()) + " shards differ)";
      } catch (const Error& e) {
        merr = std::string("reading the weights and masters: ") + e.what();
      }
      agree_or_throw(comm, merr.empty() ? "" : prefix(comm) + merr, ErrorCode::kDataLoss,
                     "weights against the fp32 master (verify=\"full\")", false);
    }
    if (plan.replica_compares.empty()) return report;

    // Replica comparisons (before any write), this rank's on the io threads; reported in plan
    // order.
    std::vector<size_t> mine;
    for (size_t i = 0; i < plan.replica_compares.size(); ++i)
      if (plan.replica_compares[i].checker == me) mine.push_back(i);
    std::vector<double> maxdiff(mine.size(), 0.0);
    std::string err = first_error_of(mine.size(), io_threads, [&](size_t k) {
      maxdiff[k] = replica_max_abs_diff(plan.replica_compares[mine[k]], read);
    });
    if (!err.empty()) err = prefix(comm) + err;
    std::ostringstream diffs;
    int ndiff = 0;
    for (size_t k = 0; k < mine.size(); ++k) {
      const ReplicaCompare& c = plan.replica_compares[mine[k]];
      stats->verify_bytes_read += uint64_t(c.box.numel()) * (dtype_size(c.authoritative.dtype) + dtype_size(c.replica.dtype));
      if (maxdiff[k] > atol && ndiff++ < 6)
        diffs << (ndiff > 1 ? "; " : "") << c.tensor << " (" << state_kind_name(c.state) << ") " << c.box.to_string()
              << " in " << src.files[c.replica.file] << ": max |diff| " << maxdiff[k];
    }
    agree_or_throw(comm, err, ErrorCode::kDataLoss, "replica comparison", false);
    std::string dmsg = ndiff ? prefix(comm) + diffs.str() : "";
    if (policy == ReplicaPolicy::kError) {
      std::vector<std::string> all = comm.all_gather_strings(dmsg);
      std::string msg;
      for (const auto& s : all)
        if (!s.empty()) msg += (msg.empty() ? "" : "; ") + s;
      if (!msg.empty())
        fail(ErrorCode::kDataLoss, "replicated values differ between copies in the checkpoint: ", msg,
             " (replica policy 'error', atol ", atol,
             "; if `reshard verify` finds a checksum mismatch in a copy, the copy is damaged: restore the file; "
             "if not, either a file comes from another run or step (check where each file was copied from; a "
             "replica policy would load a mix of two runs) or the copies diverged in training (then choose policy "
             "'first' or 'average', or a tolerance, to load anyway)); no live tensor was written");
    } else {
      for (const auto& s : comm.all_gather_strings(dmsg))
        if (!s.empty()) report.push_back(s);
    }
  }

  return report;
}

ExecStats execute_plan(const Plan& plan, const Layout& target, const CheckpointReader& source,
                       const std::vector<void*>& buffers, Communicator& comm, const ExecOptions& opt) {
  const auto t0 = Clock::now();
  ExecStats st;
  const int me = comm.rank();
  const int W = comm.size();
  if (W != plan.world_size)
    fail(ErrorCode::kInvalidArgument, prefix(comm), "the plan is for ", plan.world_size, " ranks but the job has ", W);
  RESHARD_CHECK(buffers.size() == target.buffers.size(), "one pointer slot per target buffer");
  ReadFn read = [&](int32_t file, uint64_t off, uint64_t len, void* dst) { source.read(file, off, len, dst); };

  // 1-2. Same plan everywhere; pre-flight of files and buffers; replica comparisons.
  const auto tp0 = Clock::now();
  st.replica_report = run_preflight(plan, target, source, buffers, comm, opt.replica_policy, opt.replica_atol,
                                    &st, opt.verify, opt.io_threads, opt.memory_budget);
  st.preflight_seconds = seconds_since(tp0);
  if (opt.on_wave_done) opt.on_wave_done(0);

  // 3. Waves. Fragments are sorted by wave; find each wave's range once.
  std::vector<size_t> wave_begin(plan.num_waves + 1, plan.fragments.size());
  for (size_t i = plan.fragments.size(); i-- > 0;) wave_begin[plan.fragments[i].wave] = i;
  for (int w = plan.num_waves - 1; w >= 0; --w) wave_begin[w] = std::min(wave_begin[w], wave_begin[w + 1]);

  bool written = false;
  // Elements still to be written per buffer of this rank (for on_buffer_done).
  std::vector<int64_t> remaining(target.buffers.size(), 0);
  for (size_t b = 0; b < target.buffers.size(); ++b)
    if (target.buffers[b].rank == me) remaining[b] = target.buffers[b].numel;
  auto wrote = [&](int32_t buffer, int64_t n) {
    remaining[buffer] -= n;
    RESHARD_CHECK(remaining[buffer] >= 0, "buffer ", target.buffers[buffer].name, " written more than once");
    if (remaining[buffer] == 0 && opt.on_buffer_done) opt.on_buffer_done(buffer);
  };
  // Zero fills first: they need no reads, and buffers with padding then complete with their last
  // fragment.
  for (const Fill& f : plan.fills) {
    if (f.rank != me) continue;
    const Box rel = at_origin(f.extent);
    fill_zero_box(live_at(target, buffers, f.buffer, f.base), target.buffers[f.buffer].dtype, rel, f.strides);
    written = true;
    wrote(f.buffer, rel.numel());
  }
  // Single-copy waves. A fragment read by this rank goes straight to where it ends up:
  //  - "direct" (verify off only): its only delivery is this rank, same dtype, contiguous on both
  //    sides -> pread into the live buffer (no staging, no unpack);
  //  - it has remote deliveries -> pread into its slot of the send buffer of the first remote
  //    receiver (copied to further receivers' slots; local deliveries unpack from there);
  //  - otherwise -> staging, then unpack.
  // Checksums: a fragment that is a whole stored piece is checked as it is read: by the reading
  // thread before any of its bytes leave the rank (pack, then hash, while the bytes are in
  // cache), or, when only this rank receives it straight from the file mapping, slab by
  // slab while the copy task copies it (check_slabs: one pass over memory; a piece that
  // fails is overwritten with NaN in the live tensors). A mismatch found in the copy step fails
  // every rank after that step; other, checked pieces may have been copied by then.
  // Staging/send/recv memory is reused across waves and never zero-initialised; unpack and
  // receive-scatter run on the thread pool.
  auto dense = box_is_dense;
  // A fragment whose bytes are exactly one checksummed unit, in file order: its reader checks it
  // (verify="free"; "full" checked every unit in the pre-flight).
  // A node-local re-read (Fragment::reread_on_node) is not: its twin on another rank of this
  // machine checks the same page-cache bytes (PoisonTwinsOnFailure below covers its copy).
  auto checkable = [&](const Fragment& f) {
    return opt.verify == VerifyMode::kFree && dense(f.box, f.src_strides) && source.has_checksum(f.file, f.byte_base, f.bytes());
  };
  auto checked = [&](const Fragment& f) { return !f.reread_on_node && checkable(f); };
  // Checks a checked fragment whose bytes are at `src` (its file mapping) slab by slab: each
  // slab (a cache-sized, contiguous part, whole inner rows) goes to use(slab, byte offset, bytes,
  // hash), and into the running checksum as it goes, so the fragment crosses memory once. Returns
  // the checksum's verdict ("" when it matches); callers act on it before any byte of the
  // fragment leaves the rank, and overwrite its live copies with NaN when it fails.
  // Where the stored checksum is XXH3-64 (native files), `hash` is the fragment's Xxh3Range: use()
  // copies the slab through it (one loop that copies and hashes, the hash reading what the copy
  // just loaded), and whatever it did not pass through is hashed after it, from cache. Otherwise
  // `hash` is null and the slab goes to the reader's check after use() copied it. Measured:
  // 1 GiB in 256 KiB slabs on 2 threads, copy alone 16.2-19.1 GB/s, copy then libxxhash's AVX2
  // XXH3 of the slab 14.2-15.5, the fused loop 15.1-17.9 (the older comparison, hashing before
  // copying, read the slab from memory with no store in flight: 13.4-14.1 against 16.8-17.5).
  auto check_slabs = [&](const Fragment& f, const uint8_t* src, const auto& use) {
    std::unique_ptr<RangeCheck> chk = source.begin_check(f.file, f.byte_base, f.bytes());
    RESHARD_CHECK(chk != nullptr, "a range with a stored checksum has a check");
    const size_t es = dtype_size(f.src_dtype);
    const Box rel = at_origin(f.box);
    std::optional<Xxh3Range> fused;
    if (chk->is_xxh3_64()) fused.emplace(src, f.bytes());
    for_each_slab(rel, int64_t(kCheckSlabBytes / es), [&](const Box& slab, int64_t packed) {
      // The fragment is dense in file order, so a slab's packed offset is its offset in memory.
      const uint64_t off = uint64_t(packed) * es, n = uint64_t(slab.numel()) * es;
      if (fused) {
        use(slab, off, n, &*fused);
        fused->hash_upto(src + off + n);
      } else {
        use(slab, off, n, static_cast<Xxh3Range*>(nullptr));
        chk->update(src + off, n);
      }
    });
    return fused ? chk->finish_xxh3_64(fused->digest()) : chk->finish();
  };
  // End of a fragment's bytes in its file: [byte_base, span_end).
  auto span_end = [&](const Fragment& f) {
    return f.byte_base + uint64_t(box_span(f.box, f.src_strides)) * dtype_size(f.src_dtype);
  };
  // Whether some check covers a fragment this rank reads from storage: "full" checks every unit
  // the load touches in the pre-flight; "free" checks a fragment that is a whole unit as it is
  // read, and a unit the memory budget cut (Plan::budget_splits, sorted by file and byte_base)
  // in the pre-flight, on every machine that reads part of it. What is left (units the layout
  // change cuts between ranks) is LoadReport::bytes_unchecked.
  auto covered = [&](const Fragment& f) {
    if (opt.verify == VerifyMode::kFull) return true;
    if (opt.verify == VerifyMode::kOff) return false;
    if (checkable(f)) return true;
    auto it = std::upper_bound(plan.budget_splits.begin(), plan.budget_splits.end(), std::make_pair(f.file, f.byte_base),
                               [](const std::pair<int32_t, uint64_t>& k, const BudgetSplit& b) {
                                 return k < std::make_pair(b.file, b.byte_base);
                               });
    if (it == plan.budget_splits.begin()) return false;
    --it;
    return it->file == f.file && span_end(f) <= it->byte_base + it->bytes && source.has_checksum(it->file, it->byte_base, it->bytes);
  };
  // Staging, send and receive memory: anonymous mappings asking for transparent huge pages, so
  // first touch costs one fault per 2 MiB instead of per 4 KiB (fresh memory is most of a load's
  // page faults).
  struct Grow {
    uint8_t* p = nullptr;
    uint64_t cap = 0;
    uint8_t* get(uint64_t n) {
      if (n <= cap) return p;
      release();
      const uint64_t huge = uint64_t(2) << 20;
      const uint64_t len = (n + huge - 1) / huge * huge;
      void* m = ::mmap(nullptr, size_t(len), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) fail(ErrorCode::kFailedPrecondition, "cannot allocate ", len, " bytes of staging memory (lower the memory budget)");
#ifdef MADV_HUGEPAGE
      ::madvise(m, size_t(len), MADV_HUGEPAGE);  // advisory
#endif
      p = static_cast<uint8_t*>(m);
      cap = len;
      return p;
    }
    void release() {
      if (p) ::munmap(p, size_t(cap));
      p = nullptr;
      cap = 0;
    }
    ~Grow() { release(); }
  } staging_mem, send_mem, recv_mem, fan_mem;
  // Node-local re-reads this rank copied without a check (their twins' readers check the same
  // bytes). When the load fails, whatever the reason, their live copies are overwritten with
  // poison (NaN) on the way out, as a failing checked piece's are: no value of a piece whose
  // check failed on another rank of this machine stays in a live tensor here.
  struct PoisonTwinsOnFailure {
    const Plan& plan;
    const Layout& target;
    const std::vector<void*>& buffers;
    int me;
    std::vector<size_t> copied;
    bool armed = true;
    ~PoisonTwinsOnFailure() {
      if (!armed) return;
      for (size_t i : copied) poison_live_copies(plan, target, buffers, me, plan.fragments[i]);
    }
  } unchecked_twins{plan, target, buffers, me, {}};
  std::string late_err;  // the first error of a scatter or fan-out copy on this rank (see below)
  for (int w = 0; w < plan.num_waves; ++w) {
    const size_t lo = wave_begin[w], hi = wave_begin[w + 1];
    std::vector<uint64_t> send_counts(W, 0), recv_counts(W, 0);
    // src: the fragment's bytes in the reader's file mapping (nullptr: read with pread). dst: where
    // the packed fragment goes (staging, a send slot, or a live buffer when direct); nullptr for a
    // mapped fragment that only this rank receives (copied from the mapping in the copy step).
    struct Mine { size_t frag; uint8_t* dst; bool direct, verify; int32_t peer; uint64_t off; bool fan; const uint8_t* src; };
    std::vector<Mine> mine;
    std::vector<std::pair<size_t, uint64_t>> incoming;  // (fragment, offset within its sender's recv block)
    std::vector<std::pair<size_t, uint64_t>> fan_in;    // group fan-out fragments this rank receives
    uint64_t stage_bytes = 0, fan_bytes = 0;
    // Pass 1: counts, and which of my fragments go where.
    for (size_t i = lo; i < hi; ++i) {
      const Fragment& f = plan.fragments[i];
      int32_t last = -1;
      bool remote = false, for_me = false;
      int32_t first_peer = -1;
      uint64_t first_off = 0;
      // Bytes many ranks need go out as one broadcast inside the group of their receivers (a tree),
      // not as one send per receiver from the reader.
      const bool fan = remote_ranks(plan, f) >= kFanoutMinReceivers;
      // Copy out of the reader's read-only file mapping where it has one (one copy from the page
      // cache into the live tensor or send slot, no staging); readers without mappings, and
      // fragments averaged from replicas, take positioned reads into staging.
      const uint8_t* map = (f.reader == me && f.num_replicas == 0) ? source.mapped(f.file) : nullptr;
      const uint8_t* src_at = map ? map + f.byte_base : nullptr;
      if (fan) {
        bool in = false;
        for (uint32_t k = 0; k < f.num_deliveries; ++k) in |= plan.deliveries[f.first_delivery + k].rank == me;
        if (f.reader != me) {
          if (in) {
            fan_in.push_back({i, fan_bytes});
            fan_bytes += f.bytes();
          }
          continue;
        }
        Mine m{i, nullptr, false, checked(f), -1, stage_bytes, true, src_at};
        stage_bytes += f.bytes();
        mine.push_back(m);
        continue;
      }
      for (uint32_t k = 0; k < f.num_deliveries; ++k) {
        int32_t r = plan.deliveries[f.first_delivery + k].rank;
        if (r == me) for_me = true;
        if (r == last) continue;
        last = r;
        if (f.reader == me && r != me) {
          if (!remote) { first_peer = r; first_off = send_counts[r]; }
          remote = true;
          send_counts[r] += f.bytes();
        }
        if (r == me && f.reader != me) {
          incoming.push_back({i, recv_counts[f.reader]});
          recv_counts[f.reader] += f.bytes();
        }
      }
      if (f.reader != me) continue;
      Mine m{i, nullptr, false, false, first_peer, first_off, false, src_at};
      if (!remote && src_at) {
        // Mapped and only this rank receives it: no staging, the copy step reads the mapping.
      } else if (!remote && f.num_deliveries == 1 && for_me) {
        const Delivery& dv = plan.deliveries[f.first_delivery];
        // Straight into live memory only when no checksum is to be checked: a corrupted byte must
        // be found before it reaches a live tensor (then the error is clean, not "state unusable").
        m.direct = opt.verify == VerifyMode::kOff && target.buffers[dv.buffer].dtype == f.src_dtype &&
                   dense(f.box, f.src_strides) && dense(f.box, dv.strides);
      }
      if (!m.direct && !remote && !src_at) {
        m.off = stage_bytes;  // staging offset
        stage_bytes += f.bytes();
      }
      m.verify = checked(f);
      mine.push_back(m);
    }
    for (const Mine& m : mine) {
      const Fragment& f = plan.fragments[m.frag];
      // A node-local re-read copies page-cache bytes its twin on this machine reads (and counts).
      if (!f.reread_on_node && !covered(f)) st.bytes_unchecked += f.bytes();
    }
    std::vector<uint64_t> send_displs(W, 0), recv_displs(W, 0);
    uint64_t total_send = 0, total_recv = 0;
    for (int r = 0; r < W; ++r) {
      send_displs[r] = total_send;
      total_send += send_counts[r];
      recv_displs[r] = total_recv;
      total_recv += recv_counts[r];
    }
    uint8_t* staging = staging_mem.get(std::max<uint64_t>(stage_bytes, 1));
    uint8_t* sendbuf = send_mem.get(std::max<uint64_t>(total_send, 1));
    uint8_t* recvbuf = recv_mem.get(std::max<uint64_t>(total_recv, 1));
    for (Mine& m : mine) {
      const Fragment& f = plan.fragments[m.frag];
      if (m.direct) {
        const Delivery& dv = plan.deliveries[f.first_delivery];
        m.dst = live_at(target, buffers, dv.buffer, dv.base);
      } else if (m.peer >= 0) {
        m.dst = sendbuf + send_displs[m.peer] + m.off;
      } else if (m.src && !m.fan) {
        m.dst = nullptr;
      } else {
        m.dst = staging + m.off;
      }
    }
    // Every fragment read out of the mapping is read once: in the read step when it is packed,
    // else by its copy task.
    MappedChunkDrops drops;
    for (const Mine& m : mine)
      if (m.src) {
        const Fragment& f = plan.fragments[m.frag];
        drops.expect(f.file, m.src - f.byte_base, f.byte_base, span_end(f));
      }
    auto read_out = [&](const Fragment& f) { drops.done(f.file, f.byte_base, span_end(f)); };
    bool any_direct = false;
    for (const Mine& m : mine) any_direct |= m.direct;
    // Read (+ verify) on the pool.
    auto tr = Clock::now();
    std::atomic<uint64_t> nverified{0}, nverified_bytes{0}, replica_bytes{0};
    std::string err = first_error_of(mine.size(), opt.io_threads, [&](size_t k) {
      const Mine& m = mine[k];
      const Fragment& f = plan.fragments[m.frag];
      const Box rel = at_origin(f.box);
      if (m.src) {
        // Checked out of the mapping, slab by slab as it is packed into its send slot or staging
        // (the slab is copied, then hashed from cache: one pass over memory); nothing packed
        // leaves this rank before the read step's verdict is agreed. A fragment that only this
        // rank receives is checked in the copy step instead, slab by slab as it is copied.
        if (m.verify && m.dst) {
          // A checked fragment is dense in file order: packing it is a byte copy.
          std::string bad = check_slabs(f, m.src, [&](const Box&, uint64_t at, uint64_t n, Xxh3Range* hash) {
            if (hash) hash->copy(m.dst + at, m.src + at, n, Store::kCached);  // read again at once
            else std::memcpy(m.dst + at, m.src + at, n);
          });
          if (!bad.empty()) throw Error(ErrorCode::kDataLoss, bad);
          read_out(f);
          nverified.fetch_add(1);
          nverified_bytes.fetch_add(f.bytes());
          return;
        }
        if (m.dst) {
          pack_box(m.src, f.src_dtype, rel, f.src_strides, m.dst);
          read_out(f);
        }
        return;
      }
      if (m.direct || dense(f.box, f.src_strides)) {
        source.read(f.file, f.byte_base, f.bytes(), m.dst);
      } else {
        read_box(f.file, f.byte_base, f.src_dtype, rel, f.src_strides, read, m.dst);
      }
      if (m.verify) {
        std::string bad = source.verify_range(f.file, f.byte_base, f.bytes(), m.dst);
        if (!bad.empty()) throw Error(ErrorCode::kDataLoss, bad);
        nverified.fetch_add(1);
        nverified_bytes.fetch_add(f.bytes());
      }
      if (f.num_replicas > 0) {
        // Replica policy average: the other saved copies are read (and their checksums checked)
        // and averaged into this box before it goes anywhere.
        ReadFn checked = [&](int32_t file, uint64_t off, uint64_t len, void* dst) {
          source.read(file, off, len, dst);
          if (opt.verify == VerifyMode::kOff) return;
          std::string bad = source.verify_range(file, off, len, dst);
          if (!bad.empty()) throw Error(ErrorCode::kDataLoss, bad);
        };
        replica_bytes.fetch_add(average_replicas(plan, f, checked, m.dst));
      }
    });
    st.read_seconds += seconds_since(tr);
    st.bytes_read += replica_bytes.load() +
                     [&] { uint64_t n = 0; for (const Mine& m : mine) n += plan.fragments[m.frag].bytes(); return n; }();
    st.checksums_verified += nverified.exchange(0);
    st.bytes_verified += nverified_bytes.exchange(0);
    agree_or_throw(comm, err.empty() ? "" : prefix(comm) + err, ErrorCode::kDataLoss,
                   "reading wave " + std::to_string(w), written || any_direct);
    for (const Mine& m : mine)
      if (m.direct) {
        written = true;
        const Fragment& f = plan.fragments[m.frag];
        wrote(plan.deliveries[f.first_delivery].buffer, f.box.numel());
      }
    // Copies to further receivers' slots, and local unpacks, on the pool.
    auto tx = Clock::now();
    std::vector<uint64_t> send_at = send_displs;
    // src_strided: src is the fragment in the file mapping (source strides), not packed.
    struct Copy { const uint8_t* src; size_t frag; int32_t peer_or_delivery; uint64_t dst_off; bool local, src_strided; };
    std::vector<Copy> copies;
    for (const Mine& m : mine) {
      if (m.direct) continue;
      const Fragment& f = plan.fragments[m.frag];
      if (!m.dst) {
        for (uint32_t j = 0; j < f.num_deliveries; ++j)
          copies.push_back({m.src, m.frag, int32_t(f.first_delivery + j), 0, true, true});
        continue;
      }
      int32_t last = -1;
      bool first_remote = true;
      for (uint32_t j = 0; j < f.num_deliveries; ++j) {
        const Delivery& dv = plan.deliveries[f.first_delivery + j];
        if (dv.rank == me) {
          copies.push_back({m.dst, m.frag, int32_t(f.first_delivery + j), 0, true, false});
        } else if (m.fan) {
          continue;  // sent by the group broadcast below
        } else if (dv.rank != last) {
          if (!first_remote) copies.push_back({m.dst, m.frag, dv.rank, send_at[dv.rank], false, false});
          first_remote = false;
          send_at[dv.rank] += f.bytes();
        }
        if (dv.rank != me) last = dv.rank;
      }
    }
    auto do_copy = [&](const Copy& c) {
      const Fragment& f = plan.fragments[c.frag];
      if (!c.local) {
        std::memcpy(sendbuf + c.dst_off, c.src, f.bytes());
        return;
      }
      const Delivery& dv = plan.deliveries[c.peer_or_delivery];
      const Buffer& b = target.buffers[dv.buffer];
      const Box rel = at_origin(f.box);
      uint8_t* dst = live_at(target, buffers, dv.buffer, dv.base);
      naming_buffer(b, [&] {
        if (c.src_strided) {
          copy_box(c.src, f.src_dtype, f.src_strides, dst, b.dtype, dv.strides, rel, Store::kStream);
        } else {
          unpack_box(c.src, f.src_dtype, dst, b.dtype, rel, dv.strides, Store::kStream);
        }
      });
    };
    // Send-slot copies first (the exchange reads them); then the local copies into live tensors run
    // on the pool while this thread runs the all-to-all-v, so a rank copies while it waits for its
    // peers instead of after.
    std::vector<size_t> to_slots, to_live;
    for (size_t k = 0; k < copies.size(); ++k) (copies[k].local ? to_live : to_slots).push_back(k);
    std::string cerr = first_error_of(to_slots.size(), opt.io_threads, [&](size_t k) { do_copy(copies[to_slots[k]]); });
    if (!cerr.empty()) fail(ErrorCode::kInternal, prefix(comm), "packing sends failed: ", cerr);
    // Local copy tasks: the copies of one fragment out of the file mapping form one task (which
    // first checks the fragment's checksum where the read step deferred it, slab by slab as it
    // copies, and drops the fragment's pages from the mapping at the end); every other local copy
    // is a task of its own.
    std::vector<char> check_in_copy(hi - lo, 0);
    for (const Mine& m : mine)
      if (m.src && !m.dst && m.verify) check_in_copy[m.frag - lo] = 1;
    struct Task { size_t first, count; bool check; };
    std::vector<Task> tasks;
    for (size_t k = 0; k < to_live.size(); ++k) {
      const Copy& c = copies[to_live[k]];
      if (c.src_strided && !tasks.empty() && copies[to_live[tasks.back().first]].src_strided &&
          copies[to_live[tasks.back().first]].frag == c.frag) {
        ++tasks.back().count;
        continue;
      }
      tasks.push_back({k, 1, c.src_strided && check_in_copy[c.frag - lo] != 0});
    }
    if (!to_live.empty()) written = true;
    // A checked fragment copied straight out of the file mapping goes to every local delivery
    // slab by slab (check_slabs). When its checksum fails, every delivery of the fragment is
    // overwritten with poison (NaN) before the error is raised: no corrupt value stays in a live
    // tensor, and a trainer that ignores the error sees NaN, not plausible numbers.
    auto check_and_copy = [&](const Copy& c0, const Fragment& f, size_t first, size_t count) {
      std::string bad = check_slabs(f, c0.src, [&](const Box& slab, uint64_t off, uint64_t, Xxh3Range* hash) {
        for (size_t k = first; k < first + count; ++k) {
          const Delivery& dv = plan.deliveries[copies[to_live[k]].peer_or_delivery];
          const Buffer& b = target.buffers[dv.buffer];
          int64_t at = dv.base;
          for (int d = 0; d < slab.ndim; ++d) at += slab.off[d] * dv.strides[d];
          uint8_t* dst = live_at(target, buffers, dv.buffer, at);
          naming_buffer(b, [&] {
            // The first delivery's copy feeds the hash; further ones read the slab from cache.
            if (hash && k == first) {
              copy_box_hashing(c0.src + off, f.src_dtype, f.src_strides, dst, b.dtype, dv.strides, at_origin(slab), *hash);
            } else {
              copy_box(c0.src + off, f.src_dtype, f.src_strides, dst, b.dtype, dv.strides, at_origin(slab), Store::kStream);
            }
          });
        }
      });
      if (bad.empty()) return;
      // The task holds every local delivery of the fragment.
      poison_live_copies(plan, target, buffers, me, f);
      throw Error(ErrorCode::kDataLoss, bad + "; the piece's live copy was overwritten with NaN");
    };
    std::string lerr;
    std::thread local_copies([&] {
      lerr = first_error_of(tasks.size(), opt.io_threads, [&](size_t t) {
        const Task& task = tasks[t];
        if (task.check) {
          const Copy& c = copies[to_live[task.first]];
          const Fragment& f = plan.fragments[c.frag];
          check_and_copy(c, f, task.first, task.count);
          read_out(f);
          nverified.fetch_add(1);
          nverified_bytes.fetch_add(f.bytes());
          return;
        }
        for (size_t k = task.first; k < task.first + task.count; ++k) do_copy(copies[to_live[k]]);
        const Copy& c = copies[to_live[task.first]];
        if (c.src_strided) read_out(plan.fragments[c.frag]);
      });
    });
    auto ta = Clock::now();
    std::string xerr;
    try {
      comm.all_to_all_v(sendbuf, send_counts, send_displs, recvbuf, recv_counts, recv_displs);
      st.exchange_seconds += seconds_since(ta);
    } catch (const Error& e) {
      xerr = e.what();
      if (!written) {
        local_copies.join();
        throw;
      }
    }
    local_copies.join();
    for (const Mine& m : mine)
      if (plan.fragments[m.frag].reread_on_node && checkable(plan.fragments[m.frag])) unchecked_twins.copied.push_back(m.frag);
    st.copy_seconds += seconds_since(tx);
    st.checksums_verified += nverified.exchange(0);
    st.bytes_verified += nverified_bytes.exchange(0);
    if (!xerr.empty())
      fail(ErrorCode::kFailedPrecondition, prefix(comm), "exchange of wave ", w, " failed after live tensors were "
           "partly written; the live state is unusable and the trainer must abort: ", xerr,
           lerr.empty() ? "" : "; and on this rank: " + lerr);
    // A checksum mismatch found in the copy step fails every rank, naming the piece.
    agree_or_throw(comm, lerr.empty() ? "" : prefix(comm) + lerr, ErrorCode::kDataLoss,
                   "copying wave " + std::to_string(w) + " (pieces copied out of the file mapping are checked as they "
                   "are copied; a failing piece's live copy was overwritten with NaN)", written);
    for (size_t k : to_live) wrote(plan.deliveries[copies[k].peer_or_delivery].buffer, plan.fragments[copies[k].frag].box.numel());
    for (int r = 0; r < W; ++r) {
      st.bytes_sent += send_counts[r];
      st.bytes_received += recv_counts[r];
    }
    // Scatter received fragments on the pool.
    auto ts = Clock::now();
    std::vector<std::pair<const uint8_t*, uint32_t>> rx;  // (packed, delivery index)
    for (const auto& [i, off] : incoming) {
      const Fragment& f = plan.fragments[i];
      const uint8_t* packed = recvbuf + recv_displs[f.reader] + off;
      for (uint32_t j = 0; j < f.num_deliveries; ++j)
        if (plan.deliveries[f.first_delivery + j].rank == me) rx.push_back({packed, uint32_t(f.first_delivery + j)});
    }
    // Fragment of each delivery: deliveries are contiguous per fragment, so map back through incoming.
    std::vector<size_t> rx_frag;
    for (const auto& [i, off] : incoming) {
      const Fragment& f = plan.fragments[i];
      for (uint32_t j = 0; j < f.num_deliveries; ++j)
        if (plan.deliveries[f.first_delivery + j].rank == me) rx_frag.push_back(i);
    }
    std::string serr = first_error_of(rx.size(), opt.io_threads, [&](size_t k) {
      const Fragment& f = plan.fragments[rx_frag[k]];
      const Delivery& dv = plan.deliveries[rx[k].second];
      const Buffer& b = target.buffers[dv.buffer];
      const Box rel = at_origin(f.box);
      naming_buffer(b, [&] {
        unpack_box(rx[k].first, f.src_dtype, live_at(target, buffers, dv.buffer, dv.base), b.dtype, rel, dv.strides,
                   Store::kStream);
      });
    });
    for (size_t k = 0; k < rx.size(); ++k) {
      written = true;
      wrote(plan.deliveries[rx[k].second].buffer, plan.fragments[rx_frag[k]].box.numel());
    }
    // Raised on every rank after the last wave (late_err): a rank that raised here alone would
    // leave its peers waiting in the next collective.
    if (!serr.empty() && late_err.empty()) late_err = "scatter of wave " + std::to_string(w) + ": " + serr;
    st.scatter_seconds += seconds_since(ts);
    // Group fan-out: every rank walks the wave's fan-out fragments in plan order and joins the
    // broadcasts of the groups it belongs to (same order everywhere, so no cycle can form).
    auto tf = Clock::now();
    uint8_t* fanbuf = fan_mem.get(std::max<uint64_t>(fan_bytes, 1));
    size_t next_in = 0, next_mine = 0;
    for (size_t i = lo; i < hi; ++i) {
      const Fragment& f = plan.fragments[i];
      if (remote_ranks(plan, f) < kFanoutMinReceivers) continue;
      std::vector<int> group = {f.reader};
      for (uint32_t k = 0; k < f.num_deliveries; ++k) group.push_back(plan.deliveries[f.first_delivery + k].rank);
      std::sort(group.begin(), group.end());
      group.erase(std::unique(group.begin(), group.end()), group.end());
      if (!std::binary_search(group.begin(), group.end(), me)) continue;
      uint8_t* data = nullptr;
      if (f.reader == me) {
        while (next_mine < mine.size() && mine[next_mine].frag != i) ++next_mine;
        RESHARD_CHECK(next_mine < mine.size(), "fan-out fragment not staged by its reader");
        data = mine[next_mine].dst;
        st.bytes_sent += f.bytes() * uint64_t(remote_ranks(plan, f));
      } else {
        while (next_in < fan_in.size() && fan_in[next_in].first != i) ++next_in;
        RESHARD_CHECK(next_in < fan_in.size(), "fan-out fragment without a receive slot");
        data = fanbuf + fan_in[next_in].second;
        st.bytes_received += f.bytes();
      }
      try {
        comm.broadcast(data, f.bytes(), f.reader, group);
      } catch (const Error& e) {
        if (!written) throw;
        fail(ErrorCode::kFailedPrecondition, prefix(comm), "group broadcast of wave ", w, " failed after live tensors "
             "were partly written; the live state is unusable and the trainer must abort: ", e.what());
      }
      if (f.reader == me) continue;  // the reader's own deliveries were scattered from staging
      const Box rel = at_origin(f.box);
      for (uint32_t j = 0; j < f.num_deliveries; ++j) {
        const Delivery& dv = plan.deliveries[f.first_delivery + j];
        if (dv.rank != me) continue;
        const Buffer& b = target.buffers[dv.buffer];
        written = true;
        try {
          unpack_box(data, f.src_dtype, live_at(target, buffers, dv.buffer, dv.base), b.dtype, rel, dv.strides,
                     Store::kStream);
        } catch (const Error& e) {
          if (late_err.empty()) late_err = "group fan-out of wave " + std::to_string(w) + ": buffer " + b.name + ": " + e.what();
        }
        wrote(dv.buffer, rel.numel());
      }
    }
    st.exchange_seconds += seconds_since(tf);
    st.peak_staging_bytes = std::max<uint64_t>(st.peak_staging_bytes, stage_bytes + total_send + total_recv + fan_bytes);
    if (opt.on_wave_done) opt.on_wave_done(w + 1);
  }


  agree_or_throw(comm, late_err.empty() ? "" : prefix(comm) + late_err, ErrorCode::kFailedPrecondition,
                 "writing received fragments into live tensors", written);
  unchecked_twins.armed = false;
  // Buffers of tensors the checkpoint lacks (strict_missing off) stay as they were: nothing to check.
  // No barrier here: the all-gather above already waits for every rank's last write.
  st.total_seconds = seconds_since(t0);
  return st;
}

}  // namespace reshard
