// reshard plan: the dry run. Either for a model and two layouts (no checkpoint needed; the source
// files are assumed present), or for an existing checkpoint and a target layout.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "reshard/units.h"
#include "reshard/checkpoint.h"
#include "reshard/config.h"
#include "reshard/consolidate.h"
#include "reshard/error.h"
#include "reshard/reshard.h"

namespace reshard::cli {

namespace {
struct PlanArgs {
  std::string path, step, model, source, target, budget, config;
  int64_t world_size = 0;          // --world-size: with a config whose target is auto
  int64_t global_batch = 0;        // --global-batch: kept by the chosen layout (0: not checked)
  std::string elastic_reason;      // what choose_layout picked and why
  std::vector<std::string> elastic_tried;  // the candidates it turned down, and why
  std::vector<int> target_stages;  // layers per target stage (uneven pipeline); empty: uniform
  std::string vocab_padding = "warn";
  bool json = false, no_dedup = false, no_read_rate = false;
};

// Sequential read rate of the checkpoint's data files as they are now (page cache included):
// up to `budget` bytes in 8 MiB reads, spread over the files in turn. Returns bytes/s, or 0
// when nothing could be read.
double measure_read_rate(const CheckpointReader& ckpt, uint64_t budget, uint64_t* measured) {
  const size_t n = ckpt.source().files.size();
  const uint64_t chunk = uint64_t(8) << 20;
  std::vector<char> buf(chunk);
  std::vector<uint64_t> at(n, 0), size(n, 0);
  for (size_t f = 0; f < n; ++f) size[f] = ckpt.file_size(int32_t(f));
  uint64_t done = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (bool progress = true; progress && done < budget;) {
    progress = false;
    for (size_t f = 0; f < n && done < budget; ++f) {
      if (at[f] >= size[f]) continue;
      const uint64_t len = std::min({chunk, size[f] - at[f], budget - done});
      ckpt.read(int32_t(f), at[f], len, buf.data());
      at[f] += len;
      done += len;
      progress = true;
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  *measured = done;
  return done > 0 && secs > 0 ? double(done) / secs : 0.0;
}

}  // namespace

Command plan_command() {
  auto a = std::make_shared<PlanArgs>();
  Command c;
  c.add = [a](CLI::App& app) {
    CLI::App* s = app.add_subcommand("plan", "Dry run: plan a load without touching tensor data");
    s->add_option("path", a->path, "Checkpoint (root or step folder); omit with --model/--source");
    s->add_option("--step", a->step, "Step to open (default: the one `latest` names; with PATH)");
    s->add_option("--model", a->model, "Model YAML (path or name under configs/models)");
    s->add_option("--source", a->source, "Source layout, e.g. tp=8,pp=16,dp=8,zero=1 (with --model)");
    s->add_option("--target", a->target, "Target layout, e.g. tp=4,pp=8,dp=32,zero=1 (required unless --config)");
    s->add_option("--config", a->config,
                  "A resume config (configs/resume/*.yaml): its checkpoint, step, model, target and policies, "
                  "planned as the trainer that reads it would load");
    s->add_option("--world-size", a->world_size,
                  "With --config whose target is auto: the ranks of the restarting job (the elastic policy picks the layout)");
    s->add_option("--global-batch", a->global_batch,
                  "With --world-size: the job's global batch, which the chosen layout's dp must divide (as the trainer checks)");
    s->add_option("--target-stages", a->target_stages,
                  "Layers on each target pipeline stage, e.g. 2,1,1 for 4 layers over pp=3 (uneven splits "
                  "as DeepSpeed's PipelineModule makes them; default: equal)")
        ->delimiter(',');
    s->add_option("--memory-budget", a->budget, "Per-rank staging budget per wave (e.g. 1GiB)");
    s->add_flag("--no-dedup", a->no_dedup, "Each rank reads what it needs (no fan-out)");
    s->add_option("--vocab-padding", a->vocab_padding,
                  "A target whose padded vocab has other row counts: warn (drop or zero-fill padding rows, "
                  "default) or refuse")
        ->check(CLI::IsMember({"warn", "refuse"}));
    s->add_flag("--no-read-rate", a->no_read_rate,
                "Read only headers: no timed sample read of the data files (and no time estimate)");
    s->add_flag("--json", a->json, "Print a JSON summary");
    return s;
  };
  c.run = [a]() {
    PlanOptions po;
    std::string verify;  // the config's, reported
    if (!a->config.empty()) {
      // The config is the whole request, as the trainer reads it; flags that would change it are refused.
      ResumeConfig rc = read_config_request(
          "plan", a->config,
          {{!a->path.empty(), "PATH"}, {!a->target.empty(), "--target"}, {!a->step.empty(), "--step"},
           {!a->model.empty(), "--model"}, {!a->source.empty(), "--source"}, {!a->budget.empty(), "--memory-budget"},
           {a->no_dedup, "--no-dedup"}, {a->vocab_padding != "warn", "--vocab-padding"}});
      a->path = rc.checkpoint;
      a->step = rc.step;
      a->model = rc.model;
      if (rc.target_auto) {
        const LayoutChoice c = choose_config_target(rc, a->world_size, a->global_batch, a->config, &a->step);
        a->target = c.target.to_string();
        a->elastic_reason = c.reason;
        a->elastic_tried = c.tried;
      } else {
        if (a->world_size || a->global_batch)
          fail(ErrorCode::kInvalidArgument, "plan --world-size and --global-batch apply to a config whose target is auto; ",
               a->config, " names target ", rc.target.to_string());
        a->target = rc.target.to_string();
      }
      po = rc.plan;
      verify = rc.verify;
    } else {
      if (a->target.empty()) fail(ErrorCode::kInvalidArgument, "plan needs --target LAYOUT (or --config FILE)");
      if (a->world_size || a->global_batch)
        fail(ErrorCode::kInvalidArgument, "plan --world-size and --global-batch apply to --config FILE whose target is auto");
      po.memory_budget = (a->budget.empty() ? (uint64_t(1) << 30) : parse_size(a->budget, "--memory-budget"));
      po.dedup = !a->no_dedup;
      po.refuse_vocab_padding_change = a->vocab_padding == "refuse";
    }
    Topology target = Topology::parse(a->target);
    // Uneven target stages: as given, or else the source's own split where pp stays.
    auto target_options = [&](const ModelConfig& m, const Layout* source) {
      DeriveOptions o;
      if (!a->target_stages.empty()) {
        target.validate();
        o.stage_of_layer = stage_of_layer_from_sizes(a->target_stages, m.num_layers, target.pp, target.vpp);
      } else if (source) {
        o.stage_of_layer = same_pp_stages(*source, target);
      }
      return o;
    };
    Plan plan;
    Layout target_layout;
    double secs = 0;
    double rate = 0;           // bytes/s of the sample read, 0: none
    uint64_t rate_bytes = 0;   // bytes the sample read
    if (!a->path.empty()) {
      if (!a->source.empty())
        fail(ErrorCode::kInvalidArgument, "plan --source ", a->source,
             " is for planning without a checkpoint; the checkpoint at ", a->path, " records its own layout");
      OpenOptions oo;
      oo.step = a->step;
      if (!a->model.empty()) oo.model_path = resolve_model_path(a->model);
      auto ckpt = open_checkpoint(a->path, oo);
      // A layout given box by box (DCP) has no model to derive from: its tensors cut as FSDP2 cuts.
      target_layout = ckpt->source().layout.explicit_boxes
                          ? layout_like(ckpt->source(), target)
                          : derive_layout(ckpt->source().layout.model, target,
                                          target_options(ckpt->source().layout.model, &ckpt->source().layout));
      plan = plan_load(*ckpt, target_layout, po, &secs);
      if (!a->no_read_rate) rate = measure_read_rate(*ckpt, uint64_t(64) << 20, &rate_bytes);
    } else {
      if (a->model.empty() || a->source.empty())
        fail(ErrorCode::kInvalidArgument, "plan needs a checkpoint PATH, or --model and --source");
      if (!a->step.empty()) fail(ErrorCode::kInvalidArgument, "plan --step needs a checkpoint PATH");
      ModelConfig m = load_model_config(resolve_model_path(a->model));
      Topology source = Topology::parse(a->source);
      auto t0 = std::chrono::steady_clock::now();
      DeriveOptions so;
      so.weights_on_dp0_only = true;
      SourceLayout src;
      src.layout = derive_layout(m, source, so);
      // Assume one file per source rank holding its buffers back to back.
      std::vector<uint64_t> at(source.world_size(), 0);
      for (int r = 0; r < source.world_size(); ++r) src.files.push_back("rank_" + std::to_string(r));
      for (const auto& b : src.layout.buffers) {
        src.locations.push_back({int32_t(b.rank), at[b.rank]});
        at[b.rank] += uint64_t(b.numel) * dtype_size(b.dtype);
      }
      target_layout = derive_layout(m, target, target_options(m, nullptr));
      plan = make_plan(src, target_layout, po);
      secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    // With --json, stdout is the JSON alone: the change in words goes to stderr beside the warnings.
    if (a->json) std::fprintf(stderr, "change: %s\n", plan.change.c_str());
    for (const auto& w : plan.warnings) std::fprintf(stderr, "warning: %s\n", detail::one_line(w).c_str());
    nlohmann::ordered_json j = nlohmann::ordered_json::parse(plan_summary_json(plan, secs, target_layout));
    const uint64_t read_max = j["read_bytes_per_rank_max"];
    // The busiest reader at the measured rate: ranks of one machine share its storage, so this is
    // a lower bound for them; other machines and cold storage read at their own rates.
    const double estimate = rate > 0 ? double(read_max) / rate : -1.0;
    if (a->json) {
      if (rate > 0) {
        j["read_rate_bytes_per_second"] = rate;
        j["read_rate_sample_bytes"] = rate_bytes;
        j["estimated_read_seconds"] = estimate;
      }
      if (!a->config.empty()) {
        j["config"] = a->config;
        if (!a->elastic_reason.empty())
          j["elastic"] = {{"world_size", a->world_size}, {"reason", a->elastic_reason}, {"tried", a->elastic_tried}};
        j["verify"] = verify;
      }
      std::cout << j.dump(2) << std::endl;
    } else {
      std::printf("%s -> %s: %s\n", plan.source_topo.to_string().c_str(), plan.target_topo.to_string().c_str(),
                  plan.change.c_str());
      std::printf("  world size %d -> %d\n", plan.source_topo.world_size(), plan.target_topo.world_size());
      std::printf("  bytes to read %s (needed %s), to exchange %s, target state %s\n",
                  format_bytes(plan.bytes_to_read).c_str(), format_bytes(plan.bytes_needed).c_str(),
                  format_bytes(plan.bytes_to_exchange).c_str(), format_bytes(plan.target_bytes).c_str());
      std::printf("  %d wave(s), %zu fragments, peak staging %s per rank, planned in %.3f s\n", plan.num_waves,
                  plan.fragments.size(), format_bytes(plan.peak_staging_bytes_per_rank).c_str(), secs);
      std::printf("  live state per rank: up to %s (rank %d), %s over all ranks (a one-process convert "
                  "holds all of it)\n",
                  format_bytes(j["live_bytes_per_rank_max"].get<uint64_t>()).c_str(), j["live_bytes_max_rank"].get<int>(),
                  format_bytes(j["live_bytes_total"].get<uint64_t>()).c_str());
      if (rate > 0)
        std::printf("  estimated read time %.2f s: rank %d reads %s at %s/s, the rate of a %s sample "
                    "read of these files just now (page cache included; other machines and cold storage differ)\n",
                    estimate, j["read_bytes_max_rank"].get<int>(), format_bytes(uint64_t(read_max)).c_str(),
                    format_bytes(uint64_t(rate)).c_str(), format_bytes(uint64_t(rate_bytes)).c_str());
      if (!a->config.empty()) std::printf("  config %s: verify %s\n", a->config.c_str(), verify.c_str());
      if (!a->elastic_reason.empty())
        std::printf("  elastic: %s (step %s)\n", detail::one_line(a->elastic_reason).c_str(), a->step.c_str());
      for (const auto& t : a->elastic_tried) std::printf("  elastic: turned down %s\n", detail::one_line(t).c_str());
      for (const auto& n : plan.notes) std::printf("  note: %s\n", detail::one_line(n).c_str());
    }
    return 0;
  };
  return c;
}

}  // namespace reshard::cli
