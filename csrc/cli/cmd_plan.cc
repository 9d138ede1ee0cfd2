// reshard plan: the dry run. Either for a model and two layouts (no checkpoint needed; the source
// files are assumed present), or for an existing checkpoint and a target layout.
#include <chrono>
#include <cstdio>
#include <iostream>

#include "cli/commands.h"
#include "reshard/checkpoint.h"
#include "reshard/config.h"
#include "reshard/error.h"
#include "reshard/reshard.h"

namespace reshard::cli {

namespace {
struct PlanArgs {
  std::string path, step, model, source, target, budget;
  std::vector<int> target_stages;  // layers per target stage (uneven pipeline); empty: uniform
  std::string vocab_padding = "warn";
  bool json = false, no_dedup = false;
};

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
    s->add_option("--target", a->target, "Target layout, e.g. tp=4,pp=8,dp=32,zero=1")->required();
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
    s->add_flag("--json", a->json, "Print a JSON summary");
    return s;
  };
  c.run = [a]() {
    PlanOptions po;
    po.memory_budget = (a->budget.empty() ? (uint64_t(1) << 30) : parse_size(a->budget, "--memory-budget"));
    po.dedup = !a->no_dedup;
    po.refuse_vocab_padding_change = a->vocab_padding == "refuse";
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
    double secs = 0;
    if (!a->path.empty()) {
      if (!a->source.empty())
        fail(ErrorCode::kInvalidArgument, "plan --source ", a->source,
             " is for planning without a checkpoint; the checkpoint at ", a->path, " records its own layout");
      OpenOptions oo;
      oo.step = a->step;
      if (!a->model.empty()) oo.model_path = resolve_model_path(a->model);
      auto ckpt = open_checkpoint(a->path, oo);
      Layout tl = derive_layout(ckpt->source().layout.model, target,
                                target_options(ckpt->source().layout.model, &ckpt->source().layout));
      plan = plan_load(*ckpt, tl, po, &secs);
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
      Layout tl = derive_layout(m, target, target_options(m, nullptr));
      plan = make_plan(src, tl, po);
      secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    std::fprintf(stderr, "change: %s\n", plan.change.c_str());
    for (const auto& w : plan.warnings) std::fprintf(stderr, "warning: %s\n", detail::one_line(w).c_str());
    if (a->json) {
      std::cout << plan_summary_json(plan, secs) << std::endl;
    } else {
      std::printf("%s -> %s: %s\n", plan.source_topo.to_string().c_str(), plan.target_topo.to_string().c_str(),
                  plan.change.c_str());
      std::printf("  world size %d -> %d\n", plan.source_topo.world_size(), plan.target_topo.world_size());
      std::printf("  bytes to read %.3f GB (needed %.3f GB), to exchange %.3f GB, target state %.3f GB\n",
                  plan.bytes_to_read / 1e9, plan.bytes_needed / 1e9, plan.bytes_to_exchange / 1e9,
                  plan.target_bytes / 1e9);
      std::printf("  %d wave(s), %zu fragments, peak staging %.3f GiB per rank, planned in %.3f s\n", plan.num_waves,
                  plan.fragments.size(), plan.peak_staging_bytes_per_rank / double(1 << 30), secs);
      for (const auto& n : plan.notes) std::printf("  note: %s\n", detail::one_line(n).c_str());
    }
    return 0;
  };
  return c;
}

}  // namespace reshard::cli
