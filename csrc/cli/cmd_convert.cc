// reshard convert: offline conversion of a checkpoint to another layout through the same engine,
// written as a native checkpoint. Two ways to run it:
//  - one process (not launched by mpirun, or mpirun -np 1): plan to the target layout, hold every
//    target buffer in memory, execute the whole plan with simulate_plan, save_native_all_ranks;
//  - K ranks under mpirun with K = the target world size: each rank loads its buffers with
//    reshard::load over make_world_communicator() and they save collectively with save_native.
// Every input check (coverage, missing files, checksums of the pieces to read) runs before
// anything is written under OUT; a failure leaves OUT as it was.
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/progress.h"
#include "formats/native/native_internal.h"
#include "io/file.h"
#include "io/parallel.h"
#include "reshard/checkpoint.h"
#include "reshard/comm.h"
#include "reshard/comm_mpi.h"
#include "reshard/config.h"
#include "reshard/consolidate.h"
#include "reshard/error.h"
#include "reshard/native.h"
#include "reshard/reshard.h"
#include "reshard/simulate.h"
#include "reshard/units.h"

namespace reshard::cli {

namespace {
struct ConvertArgs {
  std::string config;
  std::string in, out, target, budget, step, source_step, model, verify = kDefaultVerify, qkv_order;
  std::string vocab_padding = "warn";
  int vocab_divisible_by = 0;      // --target-vocab-divisible-by; 0: the source's
  int64_t world_size = 0;          // --world-size: with a config whose target is auto
  std::vector<int> target_stages;  // layers per target stage (uneven pipeline); empty: uniform
  bool no_dedup = false;
  bool overwrite = false;  // replace an existing OUT/<step> (atomically); otherwise refused
  bool json = false;       // one JSON object on stdout instead of the text summary
};


std::string real_path(const std::string& p) {
  char buf[PATH_MAX];
  return ::realpath(p.c_str(), buf) ? std::string(buf) : p;
}

// Checks every checksummed unit of the source (native: each piece's xxh3; DeepSpeed: each zip
// record's CRC-32) with index % parts == part, each read whole.
std::vector<std::string> check_pieces(const CheckpointReader& ckpt, int part, int parts) {
  const std::vector<ChecksumUnit> all = ckpt.checksum_units();
  std::vector<ChecksumUnit> mine;
  for (size_t i = 0; i < all.size(); ++i)
    if (int(i % size_t(parts)) == part) mine.push_back(all[i]);
  return check_checksum_units(ckpt, mine, default_threads());
}

[[noreturn]] void fail_checksums(const std::vector<std::string>& problems, const std::string& out) {
  std::string msg = std::to_string(problems.size()) + " source piece(s) fail their checks; nothing was written to " + out + ": ";
  for (size_t i = 0; i < problems.size() && i < 8; ++i) msg += (i ? "; " : "") + problems[i];
  if (problems.size() > 8) msg += "; ... (`reshard verify` lists all)";
  fail(ErrorCode::kDataLoss, msg);
}

// convert writes new checksums over what it read: say how much of that it checked first.
// `unchecked`: bytes read that no check of the source's checksums covered (LoadReport::
// bytes_unchecked; not "read minus checked", which a unit checked by several ranks overstates).
void warn_unchecked(const std::string& verify, uint64_t unchecked, uint64_t read) {
  if (unchecked == 0) return;
  std::fprintf(stderr,
               "reshard: warning: --verify %s left %s of the %s read unchecked against the source's "
               "checksums; the output's new checksums cover those bytes as they were read (--verify full, the "
               "default, checks every source piece first)\n",
               verify.c_str(), format_bytes(unchecked).c_str(), format_bytes(read).c_str());
}

// Source data files that do not exist, for a coverage error's message.
std::string missing_files(const CheckpointReader& ckpt) {
  std::string out;
  int n = 0;
  for (const auto& f : ckpt.source().files)
    if (!io::exists(f)) out += (n++ ? ", " : "") + f;
  return n ? "missing data file(s): " + out + "; " : "";
}

std::string step_name(const ConvertArgs& a, const CheckpointReader& ckpt) {
  if (!a.step.empty()) return a.step;
  if (ckpt.state().iteration >= 0) return "step-" + std::to_string(ckpt.state().iteration);
  return io::base_name(ckpt.path());
}

double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Every rank's lines, in rank order (a newline inside a line becomes a space). Without a
// communicator the lines are returned as they are. Collective when comm is set.
std::vector<std::string> gather_lines(Communicator* comm, const std::vector<std::string>& lines) {
  if (!comm) return lines;
  std::string mine;
  for (std::string l : lines) {
    std::replace(l.begin(), l.end(), '\n', ' ');
    mine += l + "\n";
  }
  std::vector<std::string> all;
  for (const auto& s : comm->all_gather_strings(mine)) {
    size_t i = 0, j;
    while ((j = s.find('\n', i)) != std::string::npos) {
      all.push_back(s.substr(i, j - i));
      i = j + 1;
    }
  }
  return all;
}

bool same_file(const std::string& a, const std::string& b) {
  struct stat sa, sb;
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

// What convert may write at OUT (`out`, resolved; `shown`, as given): a checkpoint root that is
// not a step folder, not a DeepSpeed root (its `latest` would then name a native step DeepSpeed
// cannot load), not inside the source step folder, whose OUT/<step> is free (or a step folder
// with --overwrite) and whose `latest` can be replaced. Refused before anything is written:
// the commit renames the step in first and `latest` last, and a `latest` that cannot be
// replaced then would leave OUT changed by a convert that failed.
void check_output(const std::string& out, const std::string& shown, const std::string& step,
                  const std::string& source_step_dir, bool overwrite) {
  if (io::exists(out) && !io::is_dir(out)) fail(ErrorCode::kInvalidArgument, "convert: OUT ", shown, " is a file; give a folder");
  const std::string src_real = real_path(source_step_dir) + "/";
  if ((out + "/").compare(0, src_real.size(), src_real) == 0)
    fail(ErrorCode::kInvalidArgument, "convert: OUT ", shown, " is inside the source step folder ", source_step_dir,
         "; give the output root outside it");
  if (io::is_dir(out)) {
    const bool native_step = is_native_step(out);
    if (native_step || is_deepspeed_step(out))
      fail(ErrorCode::kInvalidArgument, "convert: OUT ", shown, " is a checkpoint's step folder (it holds ",
           native_step ? native::kMetadataFile : "*_model_states.pt",
           "); give a checkpoint root: convert writes OUT/<step> and OUT/latest");
    bool ds_root = io::exists(io::join(out, "latest_checkpointed_iteration.txt"));
    for (const auto& n : io::list_dir(out)) ds_root = ds_root || is_deepspeed_step(io::join(out, n));
    if (ds_root)
      fail(ErrorCode::kInvalidArgument, "convert: OUT ", shown, " is a DeepSpeed checkpoint root (it holds DeepSpeed "
           "step folders); convert would write a native step and replace its `latest`, which DeepSpeed's own load "
           "follows: give another OUT");
  }
  const std::string dst = io::join(out, step);
  std::error_code ec;
  const auto dst_status = std::filesystem::symlink_status(dst, ec);
  if (std::filesystem::exists(dst_status)) {
    if (same_file(dst, source_step_dir))
      fail(ErrorCode::kInvalidArgument, "convert: OUT ", shown, " step ", step,
           " is the source step folder itself; write elsewhere or choose --out-step");
    if (!std::filesystem::is_directory(dst_status) && !std::filesystem::is_symlink(dst_status))
      fail(ErrorCode::kInvalidArgument, "convert: ", io::join(shown, step),
           " exists and is not a folder; remove it or choose another --out-step (--overwrite replaces step folders only)");
    if (!overwrite)
      fail(ErrorCode::kInvalidArgument, "convert: ", io::join(shown, step),
           is_native_step(dst) ? " already holds a checkpoint" : " already exists",
           "; pass --overwrite to replace it or choose another --out-step");
  }
  // The save refuses this too (commit_step), but only after writing every data file.
  const std::string latest = io::join(out, native::kLatestFile);
  const auto latest_status = std::filesystem::symlink_status(latest, ec);
  if (std::filesystem::is_directory(latest_status))
    fail(ErrorCode::kInvalidArgument, "convert: ", io::join(shown, native::kLatestFile),
         " is a folder; the save replaces `latest` with a file naming the new step: remove it or give another OUT");
}
}  // namespace

Command convert_command() {
  auto a = std::make_shared<ConvertArgs>();
  Command c;
  c.add = [a](CLI::App& app) {
    CLI::App* s = app.add_subcommand("convert", "Convert a checkpoint to another layout (native output)");
    // With --config the source comes from the config, and the one path given is OUT.
    s->add_option("IN", a->in, "Source checkpoint (root or step folder; native or DeepSpeed); with --config: OUT")
        ->required();
    s->add_option("OUT", a->out, "Output checkpoint root (a new step folder and `latest` are written)");
    s->add_option("--target", a->target, "Target layout, e.g. tp=4,pp=2,dp=2,zero=1 (required unless --config)");
    s->add_option("--config", a->config,
                  "A resume config (configs/resume/*.yaml): the source checkpoint and step, model, target layout, "
                  "verify and policies (replicas, strictness, memory budget, dedup, vocab padding) come from it");
    s->add_option("--world-size", a->world_size,
                  "With --config whose target is auto: the ranks of the job the output is for (the elastic policy picks "
                  "the layout)");
    s->add_option("--target-stages", a->target_stages,
                  "Layers on each target pipeline stage, e.g. 2,1,1 for 4 layers over pp=3 (uneven splits "
                  "as DeepSpeed's PipelineModule makes them; default: equal)")
        ->delimiter(',');
    s->add_option("--memory-budget", a->budget, "Per-rank staging budget per wave (e.g. 1GiB; default 1GiB)");
    // One meaning per flag across the commands: --step is the step read (as in plan, inspect,
    // verify), --out-step the step folder written.
    s->add_option("--step,--source-step", a->source_step, "Source step to read (default: the one `latest` names)");
    s->add_option("--out-step", a->step, "Output step folder name (default step-<source iteration>)");
    s->add_option("--model", a->model, "Model YAML where the source files do not record it (DeepSpeed)");
    s->add_option("--target-qkv-order", a->qkv_order,
                  "Fused QKV row order of the output: interleaved ([groups, heads/groups+2, head_dim] per tp rank: "
                  "Megatron-LM, Megatron-DeepSpeed before 2024-12) or blocked ([Q | K | V] per tp rank: "
                  "Megatron-DeepSpeed since 2024-12); default: the source's")
        ->check(CLI::IsMember({"interleaved", "blocked"}));
    s->add_option("--target-vocab-divisible-by", a->vocab_divisible_by,
                  "Pad the output's vocab to a multiple of N x tp (Megatron's --make-vocab-size-divisible-by; "
                  "default: the source's)")
        ->check(CLI::PositiveNumber);
    s->add_option("--vocab-padding", a->vocab_padding,
                  "An output whose padded vocab has other row counts than the source's: warn (drop or zero-fill "
                  "padding rows, default) or refuse")
        ->check(CLI::IsMember({"warn", "refuse"}));
    s->add_option("--verify", a->verify,
                  std::string("Source checksum checks before writing: full (every stored piece / DeepSpeed record), "
                              "free (only what is read as whole pieces / records; a warning says how much), off; "
                              "default ") + kDefaultVerify + " (LoadOptions::verify)")
        ->check(CLI::IsMember({"full", "free", "off"}));
    s->add_flag("--no-dedup", a->no_dedup, "Each rank reads what it needs (no fan-out)");
    s->add_flag("--json", a->json, "Print one JSON object (what was written, the load report) instead of text");
    s->add_flag("--overwrite", a->overwrite, "Replace OUT's step folder if it exists (atomically); without it "
                "an existing step is refused");
    return s;
  };
  c.run = [a]() -> int {
    const auto t0 = std::chrono::steady_clock::now();
    PlanOptions po;
    std::string elastic_reason;  // config target: auto: what choose_layout picked and why
    if (!a->config.empty()) {
      if (!a->out.empty())
        fail(ErrorCode::kInvalidArgument, "convert --config ", a->config, " names the source checkpoint; give only OUT");
      a->out = a->in;  // the one path given
      // Flags the config also sets are refused rather than silently overriding one or the other.
      ResumeConfig rc = read_config_request(
          "convert", a->config,
          {{!a->target.empty(), "--target"}, {!a->source_step.empty(), "--step"}, {!a->model.empty(), "--model"},
           {!a->budget.empty(), "--memory-budget"}, {a->no_dedup, "--no-dedup"},
           {a->vocab_padding != "warn", "--vocab-padding"}, {a->verify != kDefaultVerify, "--verify"}});
      a->in = rc.checkpoint;
      a->source_step = rc.step;
      a->model = rc.model;
      if (rc.target_auto) {
        const LayoutChoice c = choose_config_target(rc, a->world_size, 0, a->config, &a->source_step);
        a->target = c.target.to_string();
        elastic_reason = c.reason + " (step " + a->source_step + ")";
      } else if (a->world_size) {
        fail(ErrorCode::kInvalidArgument, "convert --world-size applies to a config whose target is auto; ", a->config,
             " names target ", rc.target.to_string());
      } else {
        a->target = rc.target.to_string();
      }
      a->verify = rc.verify;
      po = rc.plan;
    } else {
      if (a->out.empty()) fail(ErrorCode::kInvalidArgument, "convert needs IN and OUT (or --config FILE and OUT)");
      if (a->target.empty()) fail(ErrorCode::kInvalidArgument, "convert needs --target LAYOUT (or --config FILE)");
      if (a->world_size)
        fail(ErrorCode::kInvalidArgument, "convert --world-size applies to --config FILE whose target is auto");
      po.memory_budget = (a->budget.empty() ? (uint64_t(1) << 30) : parse_size(a->budget, "--memory-budget"));
      po.dedup = !a->no_dedup;
      po.refuse_vocab_padding_change = a->vocab_padding == "refuse";
    }
    Topology target_topo = Topology::parse(a->target);
    target_topo.validate();

    std::unique_ptr<Communicator> comm;
#ifdef RESHARD_HAVE_MPI
    if (mpi_launched()) {
      comm = make_world_communicator();
      if (comm->size() != 1 && comm->size() != target_topo.world_size()) {
        const int r = comm->rank();
        const std::string msg = "convert under mpirun runs one rank per target rank: the target layout " +
                                target_topo.to_string() + " has world size " + std::to_string(target_topo.world_size()) +
                                " but the job has " + std::to_string(comm->size()) +
                                " ranks (launch with -np " + std::to_string(target_topo.world_size()) +
                                ", or run convert as one process)";
        if (r == 0) fail(ErrorCode::kInvalidArgument, msg);
        return 2;
      }
      if (comm->size() == 1) comm.reset();
    }
#endif
    const int rank = comm ? comm->rank() : 0;
    Progress progress(rank);
    try {
      progress.stage("open");
      OpenOptions oo;
      oo.step = a->source_step;
      if (!a->model.empty()) oo.model_path = resolve_model_path(a->model);
      auto ckpt = open_checkpoint(a->in, oo);
      const SourceLayout& src = ckpt->source();
      LikeOptions lo;
      lo.weights_on_dp0_only = true;  // a saved checkpoint holds dp-replicated weights once
      lo.qkv_order = a->qkv_order;
      lo.vocab_divisible_by = a->vocab_divisible_by;
      if (!a->target_stages.empty())
        lo.stage_of_layer = stage_of_layer_from_sizes(a->target_stages, src.layout.model.num_layers, target_topo.pp,
                                                      target_topo.vpp);
      else
        lo.stage_of_layer = same_pp_stages(src.layout, target_topo);  // the source's split where pp stays
      const Layout target = layout_like(src, target_topo, lo);  // the source's own tensors at the target
      const std::string step = step_name(*a, *ckpt);
      native::check_step_name(step);
      // Every check on OUT works on its path with the existing part resolved and the rest folded
      // (weakly_canonical), and the writes go there: "missing/../src" names the source root
      // once "missing" is created, which the kernel would not resolve while it does not exist.
      std::error_code ec;
      const std::string out = std::filesystem::weakly_canonical(a->out, ec).string();
      if (ec || out.empty()) fail(ErrorCode::kInvalidArgument, "convert: cannot resolve OUT ", a->out, ": ", ec.message());
      check_output(out, a->out, step, ckpt->path(), a->overwrite);
      a->out = out;

      // Plan first: coverage errors (missing files, uncovered ranges) before any read.
      progress.stage("plan");
      Plan plan;
      try {
        plan = make_plan(src, target, po);
      } catch (const Error& e) {
        if (e.code() != ErrorCode::kDataLoss) throw;
        fail(ErrorCode::kDataLoss, missing_files(*ckpt), e.what());
      }
      if (rank == 0)
        for (const auto& w : plan.warnings) std::fprintf(stderr, "reshard: warning: %s\n", detail::one_line(w).c_str());
      // Checksums of every stored piece / record, split over the ranks, before anything is written.
      if (a->verify == "full") {
        progress.stage("checksums");
        std::vector<std::string> problems = gather_lines(comm.get(), check_pieces(*ckpt, rank, comm ? comm->size() : 1));
        std::sort(problems.begin(), problems.end());
        if (!problems.empty()) fail_checksums(problems, a->out);
        // Then the weights against the fp32 master (check_weights_against_master): a converted
        // checkpoint would carry a disagreement on with fresh checksums.
        // Under mpirun each rank takes a share of the tensors; every rank reaches the all-gather,
        // also when its share fails to read.
        progress.stage("weights vs master");
        MasterCheckOptions mo;
        mo.part = rank;
        mo.parts = comm ? comm->size() : 1;
        mo.replicas = false;  // the conversion compares replicas itself, under its policy
        std::vector<std::string> differ;
        try {
          for (const MasterMismatch& m : check_weights_against_master(*ckpt, mo).mismatches) differ.push_back(m.to_string());
        } catch (const Error& e) {
          if (!comm) throw;
          differ.push_back(std::string("reading the weights and masters: ") + e.what());
        }
        differ = gather_lines(comm.get(), differ);
        if (!differ.empty()) {
          std::string msg;
          for (size_t i = 0; i < differ.size() && i < 4; ++i) msg += (i ? "; " : "") + differ[i];
          if (differ.size() > 4) msg += "; ... (`reshard verify` lists all)";
          fail(ErrorCode::kDataLoss, differ.size(), " shard(s) of the source hold weights that differ from their fp32 "
               "master; nothing was written to ", a->out, ": ", msg);
        }
      }

      NonTensorState state = ckpt->state();
      if (!(src.layout.topo == target.topo)) state.per_rank.clear();  // streams cannot be matched to new ranks

      std::vector<std::vector<char>> storage(target.buffers.size());
      std::vector<void*> ptrs(target.buffers.size(), nullptr);
      for (size_t b = 0; b < target.buffers.size(); ++b) {
        if (comm && target.buffers[b].rank != rank) continue;
        storage[b].assign(std::max<size_t>(1, size_t(target.buffers[b].numel) * dtype_size(target.buffers[b].dtype)), 0);
        ptrs[b] = storage[b].data();
      }
      std::vector<const void*> cptrs(ptrs.begin(), ptrs.end());
      if (comm) {
        LoadOptions lo;
        lo.plan = po;
        lo.verify = a->verify == "full" ? "off" : a->verify;  // "full": every unit was checked above
        // Each event says a step finished: it starts the next one's line.
        progress.stage("load: plan");
        if (progress.enabled())
          lo.on_progress = [&progress](const LoadProgress& p) {
            const std::string stage(p.stage);
            if (stage == "plan") progress.stage("load: pre-flight");
            else if (stage == "preflight") progress.stage("load: read, exchange, copy", p.bytes_total);
            else if (stage == "wave") progress.update(p.bytes_done);
          };
        LoadReport r = load(*ckpt, target, ptrs, *comm, lo);
        progress.stage("write");
        save_native(a->out, step, target, cptrs, state, *comm, /*replace_step=*/a->overwrite);
        progress.end();
        if (rank == 0 && a->json) {
          nlohmann::ordered_json j;
          j["output"] = io::join(a->out, step);
          j["ranks"] = comm->size();
          j["seconds"] = since(t0);
          j["verify"] = a->verify;
          j["report"] = nlohmann::ordered_json::parse(r.to_json());
          if (!elastic_reason.empty()) j["elastic"] = elastic_reason;
          std::printf("%s\n", j.dump(1).c_str());
          if (a->verify != "full") warn_unchecked(a->verify, r.bytes_unchecked, r.bytes_read - r.bytes_reread_on_node);
        } else if (rank == 0 && !quiet()) {
          if (!elastic_reason.empty()) std::printf("elastic: %s\n", elastic_reason.c_str());
          std::fputs(r.to_text().c_str(), stdout);
          // Re-reads by a second rank of a machine are checked once (by the first), not again.
          if (a->verify != "full") warn_unchecked(a->verify, r.bytes_unchecked, r.bytes_read - r.bytes_reread_on_node);
          if (a->verify == "full") std::printf("  checksums: every stored piece / record of the source checked first, and the weights against "
                      "their fp32 master\n");
          std::printf("wrote %s/%s (%d ranks under mpirun) in %.3f s\n", a->out.c_str(), step.c_str(), comm->size(),
                      since(t0));
        }
      } else {
        // verify free: a read that is exactly one checksummed piece is checked as it is read (full
        // checked every piece above).
        progress.stage("read and copy", plan.bytes_to_read);
        uint64_t copied = 0;
        simulate_plan(plan, target,
                      [&](int32_t f, uint64_t off, uint64_t len, void* dst) {
                        ckpt->read(f, off, len, dst);
                        progress.update(copied += len);
                        if (a->verify != "free" || !ckpt->has_checksum(f, off, len)) return;
                        std::string bad = ckpt->verify_range(f, off, len, dst);
                        if (!bad.empty())
                          fail(ErrorCode::kDataLoss, bad, "; nothing was written to ", a->out);
                      },
                      ptrs, po.replica_policy, po.replica_atol);
        // What no check covered, fragment by fragment: simulate_plan reads a dense fragment in one
        // read, which is checked when it is one whole piece; every other fragment is not. (Summing
        // the checked reads counted replica comparisons' reads too, and hid a corrupted byte the
        // re-cut left unchecked.)
        uint64_t unchecked = 0;
        for (const Fragment& f : plan.fragments)
          if (a->verify != "free" || !box_is_dense(f.box, f.src_strides) ||
              !ckpt->has_checksum(f.file, f.byte_base, f.bytes()))
            unchecked += f.bytes();
        progress.stage("write");
        save_native_all_ranks(a->out, step, target, cptrs, state, /*replace_step=*/a->overwrite);
        progress.end();
        if (a->json) {
          nlohmann::ordered_json j;
          j["output"] = io::join(a->out, step);
          j["ranks"] = 1;
          j["seconds"] = since(t0);
          j["verify"] = a->verify;
          j["source_layout"] = src.layout.topo.to_string();
          j["target_layout"] = target.topo.to_string();
          j["change"] = plan.change;
          j["writer"] = ckpt->writer();
          j["bytes_read"] = plan.bytes_to_read;
          j["target_bytes"] = plan.target_bytes;
          j["waves"] = plan.num_waves;
          j["bytes_unchecked"] = a->verify == "full" ? uint64_t(0) : unchecked;
          j["notes"] = plan.notes;
          j["not_carried"] = state.per_rank_not_carried;
          std::printf("%s\n", j.dump(1).c_str());
          if (a->verify != "full") warn_unchecked(a->verify, unchecked, plan.bytes_to_read);
          return 0;
        }
        if (quiet()) {
          if (a->verify != "full") warn_unchecked(a->verify, unchecked, plan.bytes_to_read);
          return 0;
        }
        std::printf("reshard: %s -> %s (%s), writer %s\n", src.layout.topo.to_string().c_str(),
                    target.topo.to_string().c_str(), plan.change.c_str(), ckpt->writer().c_str());
        std::printf("  read %s, wrote %s of state, %d wave(s)\n", format_bytes(plan.bytes_to_read).c_str(),
                    format_bytes(plan.target_bytes).c_str(), plan.num_waves);
        for (const auto& n : plan.notes) std::printf("  note: %s\n", detail::one_line(n).c_str());
        if (!state.per_rank_not_carried.empty())
          std::printf("  not carried over: %s\n", detail::one_line(state.per_rank_not_carried).c_str());
        if (a->verify != "full") warn_unchecked(a->verify, unchecked, plan.bytes_to_read);
        if (a->verify == "full") std::printf("  checksums: every stored piece / record of the source checked first, and the weights against "
                      "their fp32 master\n");
        std::printf("wrote %s/%s (one process) in %.3f s\n", a->out.c_str(), step.c_str(), since(t0));
      }
    } catch (const Error& e) {
      if (comm) {
#ifdef RESHARD_HAVE_MPI
        // A communication failure or a failure after writes began may be on some ranks only:
        // end the whole job so that no peer stays blocked in a collective.
        if (e.code() == ErrorCode::kFailedPrecondition || e.code() == ErrorCode::kInternal)
          abort_world(2, "reshard: error: [rank " + std::to_string(rank) + "] " + e.what());
#endif
        // Input errors (open, plan, checksums, pre-flight) are raised on every rank alike:
        // print them once.
        if (rank != 0) return 2;
      }
      throw;
    } catch (const std::exception& e) {
#ifdef RESHARD_HAVE_MPI
      if (comm) abort_world(2, "reshard: error: [rank " + std::to_string(rank) + "] " + e.what());
#endif
      throw;
    }
    return 0;
  };
  return c;
}

}  // namespace reshard::cli
