#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "api/report.h"
#include "comm/agree.h"
#include "exec/executor.h"
#include "io/parallel.h"
#include "reshard/error.h"
#include "reshard/reshard.h"
#include "reshard/units.h"

namespace reshard {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
}  // namespace

Plan plan_load(const CheckpointReader& ckpt, const Layout& target, const PlanOptions& options, double* plan_seconds) {
  auto t0 = Clock::now();
  Plan p = make_plan(ckpt.source(), target, options);
  if (plan_seconds) *plan_seconds = since(t0);
  return p;
}

std::string plan_summary_json(const Plan& p, double plan_seconds, const Layout& target) {
  nlohmann::json j;
  {
    std::vector<uint64_t> live(size_t(target.topo.world_size()), 0), read(live.size(), 0);
    for (const Buffer& b : target.buffers) live[size_t(b.rank)] += uint64_t(b.numel) * dtype_size(b.dtype);
    for (const Fragment& f : p.fragments)
      if (f.reader >= 0 && size_t(f.reader) < read.size()) read[size_t(f.reader)] += f.bytes();
    uint64_t total = 0;
    size_t live_max = 0, read_max = 0;
    for (size_t r = 0; r < live.size(); ++r) {
      total += live[r];
      if (live[r] > live[live_max]) live_max = r;
      if (read[r] > read[read_max]) read_max = r;
    }
    j["live_bytes_per_rank_max"] = live.empty() ? 0 : live[live_max];
    j["live_bytes_max_rank"] = live_max;
    j["live_bytes_total"] = total;
    j["read_bytes_per_rank_max"] = read.empty() ? 0 : read[read_max];
    j["read_bytes_max_rank"] = read_max;
  }
  j["change"] = p.change;
  j["source_layout"] = p.source_topo.to_string();
  j["target_layout"] = p.target_topo.to_string();
  j["source_world_size"] = p.source_topo.world_size();
  j["target_world_size"] = p.target_topo.world_size();
  j["bytes_to_read"] = p.bytes_to_read;
  j["bytes_needed"] = p.bytes_needed;
  j["bytes_to_exchange"] = p.bytes_to_exchange;
  j["target_bytes"] = p.target_bytes;
  j["peak_staging_bytes_per_rank"] = p.peak_staging_bytes_per_rank;
  j["read_amplification"] = p.bytes_needed ? double(p.bytes_to_read) / double(p.bytes_needed) : 1.0;
  j["num_waves"] = p.num_waves;
  j["num_fragments"] = p.fragments.size();
  j["num_replica_compares"] = p.replica_compares.size();
  j["plan_seconds"] = plan_seconds;
  j["notes"] = p.notes;
  j["warnings"] = p.warnings;
  return j.dump(2);
}

LoadReport assemble_load_report(const Plan& plan, const Layout& target, const CheckpointReader& ckpt,
                                const ExecStats& st, uint64_t peak_staging_bytes, ReplicaPolicy policy,
                                double local_seconds, Communicator& comm) {
  LoadReport r;
  // The job's totals and maxima in one all-gather (one round of waking every rank, instead of one
  // per number: eight rounds cost 8 ranks sharing 2 cores several ms of a 0.2 s load).
  enum { kRead, kSent, kVerifyRead, kChecksums, kVerified, kUnchecked, kSums, kStaging = kSums, kVerifyPeak, kMicros, kFields };
  int64_t mine[kFields] = {int64_t(st.bytes_read),         int64_t(st.bytes_sent),      int64_t(st.verify_bytes_read),
                           int64_t(st.checksums_verified), int64_t(st.bytes_verified), int64_t(st.bytes_unchecked),
                           int64_t(peak_staging_bytes),    int64_t(st.peak_verify_bytes), int64_t(local_seconds * 1e6)};
  int64_t job[kFields] = {0};
  if (comm.size() == 1) {
    std::copy(mine, mine + kFields, job);
  } else {
    const std::vector<std::string> all =
        comm.all_gather_strings(std::string(reinterpret_cast<const char*>(mine), sizeof mine));
    for (size_t q = 0; q < all.size(); ++q) {
      if (all[q].size() != sizeof mine)
        fail(ErrorCode::kInternal, "load report: rank ", q, " sent ", all[q].size(), " bytes of totals, not ", sizeof mine);
      int64_t v[kFields];
      std::memcpy(v, all[q].data(), sizeof v);
      for (int i = 0; i < kFields; ++i) job[i] = i < kSums ? job[i] + v[i] : std::max(job[i], v[i]);
    }
  }
  r.change = plan.change;
  r.source_layout = ckpt.source().layout.topo.to_string();
  r.target_layout = target.topo.to_string();
  r.writer = ckpt.writer();
  r.path = ckpt.path();
  r.bytes_read = uint64_t(job[kRead]);
  r.bytes_reread_on_node = plan.bytes_reread_on_node;
  r.bytes_exchanged = uint64_t(job[kSent]);
  r.verify_bytes_read = uint64_t(job[kVerifyRead]);
  r.checksums_verified = uint64_t(job[kChecksums]);
  r.bytes_verified = uint64_t(job[kVerified]);
  r.bytes_unchecked = uint64_t(job[kUnchecked]);
  r.peak_staging_bytes = uint64_t(job[kStaging]);
  r.peak_verify_bytes = uint64_t(job[kVerifyPeak]);
  r.seconds = double(job[kMicros]) / 1e6;
  r.gbps = r.seconds > 0 ? double(plan.target_bytes) / r.seconds / 1e9 : 0;
  r.rank_bytes_read = st.bytes_read;
  r.rank_bytes_sent = st.bytes_sent;
  r.rank_bytes_received = st.bytes_received;
  r.read_seconds = st.read_seconds;
  r.exchange_seconds = st.exchange_seconds;
  r.scatter_seconds = st.scatter_seconds;
  r.copy_seconds = st.copy_seconds;
  r.preflight_seconds = st.preflight_seconds;
  r.bytes_needed = plan.bytes_needed;
  r.target_bytes = plan.target_bytes;
  r.waves = plan.num_waves;
  r.policies = plan.notes;
  r.warnings = plan.warnings;
  r.policies.push_back(std::string("replica policy: ") + replica_policy_name(policy));
  r.replica_report = st.replica_report;
  for (const auto& s : ckpt.notes()) r.policies.push_back(s);
  r.state = ckpt.state();
  if (!r.state.per_rank_not_carried.empty()) r.not_carried.push_back(r.state.per_rank_not_carried);
  if (!(ckpt.source().layout.topo == target.topo)) {
    if (!r.state.per_rank.empty())
      r.not_carried.push_back("per-rank state (RNG, sampler) of " + std::to_string(r.state.per_rank.size()) +
                              " source ranks: the layout changed (" + plan.change +
                              "), so per-rank streams cannot be matched to new ranks; reseed deterministically");
    r.state.per_rank.clear();
  }
  return r;
}

std::vector<int32_t> node_of_ranks(Communicator& comm, const CheckpointReader& ckpt) {
  // Ranks share a page cache for the checkpoint when they run on one kernel (boot id, host name)
  // and see the same step folder (device and inode): two containers of one host that mount
  // different disks at the same path are two "machines" here. verify="free" checks a piece once
  // per such group (Fragment::reread_on_node), so the group must really read the same bytes.
  std::string me;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::getline(boot, me);  // empty where /proc lacks it: the host name alone then decides
  char host[256] = {0};
  ::gethostname(host, sizeof host - 1);
  me += "@";
  me += host;
  struct stat st {};
  if (::stat(ckpt.path().c_str(), &st) == 0)
    me += "#" + std::to_string(uint64_t(st.st_dev)) + ":" + std::to_string(uint64_t(st.st_ino));
  // And the data files themselves (a file bind-mounted or renamed over one of them is another
  // copy): xxh3-64 of each file's device and inode, in file order (all ones where stat fails).
  std::vector<uint64_t> ids;
  for (const std::string& f : ckpt.source().files) {
    struct stat fs {};
    const bool ok = ::stat(f.c_str(), &fs) == 0;
    ids.push_back(ok ? uint64_t(fs.st_dev) : ~uint64_t(0));
    ids.push_back(ok ? uint64_t(fs.st_ino) : ~uint64_t(0));
  }
  me += "#" + std::to_string(XXH3_64bits(ids.data(), ids.size() * sizeof(uint64_t)));
  std::vector<std::string> all = comm.all_gather_strings(me);
  std::vector<int32_t> node(all.size(), 0);
  std::vector<std::string> seen;
  for (size_t r = 0; r < all.size(); ++r) {
    auto it = std::find(seen.begin(), seen.end(), all[r]);
    node[r] = int32_t(it - seen.begin());
    if (it == seen.end()) seen.push_back(all[r]);
  }
  return node;
}

LoadReport load(const CheckpointReader& ckpt, const Layout& target, const std::vector<void*>& buffers,
                Communicator& comm, const LoadOptions& options) {
  auto t0 = Clock::now();
  LoadReport r;
  if (target.topo.world_size() != comm.size())
    fail(ErrorCode::kInvalidArgument, "[rank ", comm.rank(), "/", comm.size(), "] target layout ", target.topo.to_string(),
         " has world size ", target.topo.world_size(), " but the job has ", comm.size(), " ranks");
  // Every rank plans the whole job from the same inputs, and the executor checks that the plans
  // agree. A rank whose options or planning fail (a bad option, a target model that differs from
  // its peers', a data file missing from its view of the folder) says so in one all-gather after
  // planning, so every rank raises instead of the others waiting for it in the executor.
  PlanOptions po = options.plan;
  ExecOptions eo;
  Plan plan;
  // This rank's first failure (encode_error's form); with one rank, errors are raised as they come.
  std::string mine;
  auto step = [&](auto fn) {
    if (comm.size() == 1) fn();
    else if (mine.empty()) mine = try_local(fn);
  };
  step([&] {
    if (options.io_threads < 0 || options.io_threads > 1024)
      fail(ErrorCode::kInvalidArgument, "load option io_threads=", options.io_threads, " must be 1..1024 (0: the default)");
    eo.io_threads = options.io_threads == 0 ? default_threads() : options.io_threads;
    eo.memory_budget = options.plan.memory_budget;
    eo.replica_policy = options.plan.replica_policy;
    eo.replica_atol = options.plan.replica_atol;
    if (options.verify == "off") eo.verify = VerifyMode::kOff;
    else if (options.verify == "free") eo.verify = VerifyMode::kFree;
    else if (options.verify == "full") eo.verify = VerifyMode::kFull;
    else fail(ErrorCode::kInvalidArgument, "load option verify='", options.verify, "' must be off, free or full");
  });
  // With dedup on, ranks that share a machine (same boot id and host name) each read what they
  // need from the shared page cache; only ranks on other machines get bytes through the exchange.
  // The machines are known to every load (one all-gather, whatever the options): verify="full"
  // checks each unit once per machine that reads it (Plan::rank_machine).
  std::vector<int32_t> machines;
  if (comm.size() > 1) machines = node_of_ranks(comm, ckpt);
  step([&] {
    if (po.node_local_reads && po.dedup && po.rank_node.empty()) po.rank_node = machines;
    plan = plan_load(ckpt, target, po, &r.plan_seconds);
    plan.rank_machine = po.rank_node.empty() ? machines : po.rank_node;
  });
  if (comm.size() > 1)
    agree_on_errors(comm, mine, "[rank " + std::to_string(comm.rank()) + "/" + std::to_string(comm.size()) +
                                    "] load refused on every rank before anything was read or written",
                    /*keep_code=*/true);
  // Whatever the load leaves mapped (see CheckpointReader::drop_mapped_pages) is dropped when it
  // ends, also when it fails: a reader kept open holds no checkpoint pages in this process's RSS.
  struct DropMappings {
    const CheckpointReader& r;
    bool done = false;
    void now() {
      done = true;
      r.drop_mapped_pages();
    }
    ~DropMappings() {
      if (!done) r.drop_mapped_pages();
    }
  } drop_mappings{ckpt};
  std::vector<uint64_t> per_wave;  // this rank's source bytes per wave, for on_progress
  if (options.on_progress) {
    const int me = comm.rank();
    per_wave.assign(size_t(plan.num_waves) + 1, 0);
    for (const Fragment& f : plan.fragments)
      for (uint32_t k = 0; k < f.num_deliveries; ++k)
        if (plan.deliveries[f.first_delivery + k].rank == me) per_wave[size_t(f.wave) + 1] += f.bytes();
    uint64_t total = 0;
    for (uint64_t b : per_wave) total += b;
    LoadProgress p;
    p.stage = "plan";
    p.index = p.count = 1;
    p.bytes_total = total;
    p.seconds = since(t0);
    options.on_progress(p);
    // Called only inside execute_plan below, while per_wave and options live.
    eo.on_wave_done = [&per_wave, total, t0, &options, n = plan.num_waves, done = uint64_t(0)](int w) mutable {
      LoadProgress q;
      q.bytes_total = total;
      if (w == 0) {
        q.stage = "preflight";
        q.index = q.count = 1;
      } else {
        done += per_wave[size_t(w)];
        q.stage = "wave";
        q.index = w;
        q.count = n;
      }
      q.bytes_done = done;
      q.seconds = since(t0);
      options.on_progress(q);
    };
  }
  ExecStats st = execute_plan(plan, target, ckpt, buffers, comm, eo);
  drop_mappings.now();  // inside the load's time

  LoadReport filled = assemble_load_report(plan, target, ckpt, st, st.peak_staging_bytes,
                                          options.plan.replica_policy, since(t0), comm);
  filled.plan_seconds = r.plan_seconds;
  r = std::move(filled);
  // What "free" could not check, said where a trainer's log shows it (a ZeRO-3 or tp-split load
  // checks nothing under "free"). Counted fragment by fragment (bytes_unchecked), not as the
  // difference of two totals: bytes_verified counts checks, and a unit the memory budget cut is
  // checked once per rank that reads it when reads are not node-local, which made it exceed the
  // bytes read and hid this note while cut pieces went unchecked.
  const uint64_t from_storage = r.bytes_read - std::min(r.bytes_read, r.bytes_reread_on_node);
  if (eo.verify == VerifyMode::kFree && r.bytes_unchecked > 0) {
    std::ostringstream os;
    os << "verify=free did not check " << format_bytes(r.bytes_unchecked) << " of the " << format_bytes(from_storage)
       << " read: pieces the layout change cuts between ranks (tp splits, ZeRO re-cuts, DeepSpeed flat "
          "partitions) are not checked; verify=\"full\" checks every piece before any write";
    r.policies.push_back(os.str());
  }
  return r;
}

std::string LoadReport::to_json() const {
  nlohmann::json j;
  j["change"] = change;
  j["source_layout"] = source_layout;
  j["target_layout"] = target_layout;
  j["writer"] = writer;
  j["path"] = path;
  j["bytes_read"] = bytes_read;
  j["bytes_reread_on_node"] = bytes_reread_on_node;
  j["bytes_needed"] = bytes_needed;
  j["bytes_exchanged"] = bytes_exchanged;
  j["verify_bytes_read"] = verify_bytes_read;
  j["peak_verify_bytes"] = peak_verify_bytes;
  j["target_bytes"] = target_bytes;
  j["checksums_verified"] = checksums_verified;
  j["bytes_verified"] = bytes_verified;
  j["bytes_unchecked"] = bytes_unchecked;
  j["plan_seconds"] = plan_seconds;
  j["seconds"] = seconds;
  j["gbps"] = gbps;
  j["waves"] = waves;
  j["rank_bytes_read"] = rank_bytes_read;
  j["rank_bytes_sent"] = rank_bytes_sent;
  j["rank_bytes_received"] = rank_bytes_received;
  j["read_seconds"] = read_seconds;
  j["exchange_seconds"] = exchange_seconds;
  j["scatter_seconds"] = scatter_seconds;
  j["copy_seconds"] = copy_seconds;
  j["preflight_seconds"] = preflight_seconds;
  j["peak_staging_bytes"] = peak_staging_bytes;
  j["policies"] = policies;
  j["warnings"] = warnings;
  j["not_carried"] = not_carried;
  j["replica_report"] = replica_report;
  j["iteration"] = state.iteration;
  j["step"] = state.step;
  j["consumed_samples"] = state.consumed_samples;
  return j.dump(2);
}

std::string LoadReport::to_text() const {
  std::ostringstream os;
  os << "reshard: " << source_layout << " -> " << target_layout << " (" << change << "), writer " << writer << "\n";
  os << "  read " << format_bytes(bytes_read) << " (" << format_bytes(bytes_reread_on_node)
     << " of it re-read by a second rank of a machine from its page cache; needed " << format_bytes(bytes_needed)
     << "), exchanged " << format_bytes(bytes_exchanged) << ", wrote " << format_bytes(target_bytes) << " in "
     << seconds << " s (" << format_bytes(uint64_t(gbps * 1e9)) << "/s), plan " << plan_seconds << " s, " << waves
     << " wave(s)\n";
  os << "  checksums: " << format_bytes(bytes_verified) << " checked (" << checksums_verified << " pieces / records) for "
     << format_bytes(bytes_read - std::min(bytes_read, bytes_reread_on_node))
     << " read (re-reads by a second rank of a machine checked once), " << format_bytes(bytes_unchecked)
     << " of it covered by no check; " << format_bytes(verify_bytes_read)
     << " read for checks (replica comparisons, verify=full)\n";
  for (const auto& w : warnings) os << "  warning: " << w << "\n";
  for (const auto& p : policies) os << "  policy: " << p << "\n";
  for (const auto& n : not_carried) os << "  not carried over: " << n << "\n";
  for (const auto& n : replica_report) os << "  replicas differ: " << n << "\n";
  return os.str();
}

}  // namespace reshard
