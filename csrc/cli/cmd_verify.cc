// reshard verify: reads every stored piece and checks its checksum, every data file's presence and
// size, coverage (every element of the checkpoint's own model stored somewhere readable), and that
// the stored weights are the fp32 master weights rounded (check_weights_against_master).
// Exit 0 when sound; 1 when the checkpoint is recognisable but has a problem (a missing, truncated
// or corrupted data file, an uncovered region); 2 when PATH is not a checkpoint.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/progress.h"
#include "reshard/checkpoint.h"
#include "reshard/consolidate.h"
#include "reshard/error.h"
#include "reshard/layout.h"
#include "reshard/native.h"
#include "reshard/plan.h"

namespace reshard::cli {

namespace {
struct VerifyArgs {
  std::string path, model, step;
  bool json = false;
};

std::string shape_of(const Layout& L, const std::string& tensor, StateKind s) {
  int a = L.find_array(tensor, s);
  if (a < 0) return "";
  std::string o = "[";
  for (int d = 0; d < L.arrays[a].ndim; ++d) o += (d ? ", " : "") + std::to_string(L.arrays[a].shape[d]);
  return o + "]";
}
}  // namespace

Command verify_command() {
  auto a = std::make_shared<VerifyArgs>();
  Command c;
  c.add = [a](CLI::App& app) {
    CLI::App* s = app.add_subcommand("verify", "Check checksums, file sizes and coverage of a checkpoint");
    s->add_option("path", a->path, "Checkpoint (root or step folder)")->required();
    s->add_option("--step", a->step, "Step to check (default: the one `latest` names)");
    s->add_option("--model", a->model, "Model YAML where the files do not record it (DeepSpeed)");
    s->add_flag("--json", a->json, "Print a JSON report");
    return s;
  };
  c.run = [a]() {
    OpenOptions oo;
    oo.step = a->step;
    if (!a->model.empty()) oo.model_path = resolve_model_path(a->model);
    std::unique_ptr<CheckpointReader> ckpt;
    std::vector<std::string> problems, missing, uncovered;
    MasterCheck masters;
    bool masters_run = false;
    Progress progress;
    try {
      progress.stage("open");
      ckpt = open_checkpoint(a->path, oo);
    } catch (const Error& e) {
      // A recognisable checkpoint whose files are damaged (truncated data file, header that
      // disagrees with metadata, bad metadata): a finding, not an unreadable input.
      if (e.code() != ErrorCode::kDataLoss) throw;
      problems.push_back(e.what());
    }
    if (ckpt) {
      const SourceLayout& src = ckpt->source();
      progress.stage("checksums");
      problems = verify_all(*ckpt);
      progress.stage("coverage");
      for (const auto& n : ckpt->notes())
        if (is_missing_file_note(n)) missing.push_back(n);
      // Coverage at pp=1, dp=1, zero=0 and the checkpoint's own tp: every element of every
      // tensor must come from some file. Keeping tp keeps partial_sum tensors (summed over tp,
      // which a tp change would need and reshard does not do) checkable.
      Topology t1;
      t1.tp = src.layout.topo.tp;
      Layout target = layout_like(src, t1);
      for (const auto& g : find_coverage_gaps(src, target))
        uncovered.push_back("tensor " + g.tensor + " (" + state_kind_name(g.state) + "): elements " +
                            g.region.to_string() + " of " + shape_of(target, g.tensor, g.state) + " covered by no file");
      // Weights against masters only where every value can be read (else the reads fail on what
      // is already reported).
      if (problems.empty() && missing.empty() && uncovered.empty()) {
        progress.stage("weights vs master");
        // With the replica check first; when copies differ (a finding of its own), once more
        // without it, so that the comparison with the masters still runs and names the files.
        for (bool replicas : {true, false}) {
          try {
            MasterCheckOptions mo;
            mo.replicas = replicas;
            masters = check_weights_against_master(*ckpt, mo);
            masters_run = true;
            break;
          } catch (const Error& e) {
            if (e.code() != ErrorCode::kDataLoss) throw;
            if (problems.empty() || problems.back() != e.what()) problems.push_back(e.what());
          }
        }
      }
    }
    progress.end();
    std::vector<std::string> disagree;
    for (const auto& m : masters.mismatches) disagree.push_back(m.to_string());
    const bool ok = problems.empty() && uncovered.empty() && missing.empty() && disagree.empty();
    if (ok && quiet() && !a->json) return 0;
    if (a->json) {
      nlohmann::json j;
      j["path"] = ckpt ? ckpt->path() : a->path;
      j["ok"] = ok;
      j["opened"] = bool(ckpt);  // false: the lists below stop at the damage the open met first
      j["problems"] = problems;
      j["missing_files"] = missing;
      j["uncovered"] = uncovered;
      j["weights_vs_master"] = masters_run ? nlohmann::json{{"tensors_checked", masters.tensors_checked},
                                                            {"elements_checked", masters.elements_checked},
                                                            {"peak_bytes_held", masters.peak_bytes_held},
                                                            {"mismatches", disagree}}
                                           : nlohmann::json();
      if (ckpt) {
        j["writer"] = ckpt->writer();
        j["layout"] = ckpt->source().layout.topo.to_string();
        j["pieces"] = ckpt->source().layout.pieces.size();
        j["files"] = ckpt->source().files.size();
      }
      std::cout << j.dump(2) << std::endl;
    } else {
      if (ckpt)
        std::printf("%s: %s checkpoint, layout %s, %zu file(s), %zu piece(s)\n", detail::one_line(ckpt->path()).c_str(),
                    detail::one_line(ckpt->writer()).c_str(), ckpt->source().layout.topo.to_string().c_str(), ckpt->source().files.size(),
                    ckpt->source().layout.pieces.size());
      for (const auto& m : missing) std::printf("missing: %s\n", detail::one_line(m).c_str());
      for (const auto& p : problems) std::printf("problem: %s\n", detail::one_line(p).c_str());
      for (const auto& u : uncovered) std::printf("uncovered: %s\n", detail::one_line(u).c_str());
      for (const auto& d : disagree) std::printf("weights differ from master: %s\n", detail::one_line(d).c_str());
      std::string checked;
      if (masters_run)
        checked = masters.tensors_checked
                      ? ", the weights of " + std::to_string(masters.tensors_checked) + " tensor(s) (" +
                            std::to_string(masters.elements_checked) + " elements) were compared with their fp32 master"
                      : ", no tensor stores both weights and an fp32 master to compare";
      if (ok)
        std::printf("OK: every checksum matches, every file is present and complete, every element is covered%s\n",
                    checked.c_str());
      else if (!ckpt)
        // The open failed on the first damaged file it met: whether other files are missing or
        // damaged, and what the files cover, is unknown (printing "0 missing file(s)" here would be
        // wrong for a folder that also lacked a file).
        std::printf("FAILED: the checkpoint could not be opened (%zu problem(s) above); missing files, coverage and "
                    "the other files were not checked\n",
                    problems.size());
      else
        std::printf("FAILED: %zu problem(s), %zu missing file(s), %zu uncovered region(s), %zu shard(s) whose weights "
                    "differ from their master\n",
                    problems.size(), missing.size(), uncovered.size(), disagree.size());
    }
    return ok ? 0 : 1;
  };
  return c;
}

}  // namespace reshard::cli
