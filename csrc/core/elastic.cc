#include "reshard/elastic.h"

#include <cctype>

#include "reshard/error.h"

namespace reshard {
namespace {

std::string axes(const Topology& t) {
  std::string s = "tp=" + std::to_string(t.tp) + ", pp=" + std::to_string(t.pp);
  if (t.vpp != 1) s += ", vpp=" + std::to_string(t.vpp);
  return s + ", ZeRO-" + std::to_string(t.zero);
}

// "" when `t` can run `world` ranks with the global batch and the model, else why not.
std::string rejects(const Topology& t, int64_t world, int64_t global_batch,
                    const std::function<std::string(const Topology&)>& fits) {
  if (int64_t(t.world_size()) != world)
    return "world size " + std::to_string(t.world_size()) + " != " + std::to_string(world);
  try {
    t.validate();
  } catch (const Error& e) {
    return e.what();
  }
  if (global_batch > 0 && global_batch % t.dp != 0)
    return "global batch " + std::to_string(global_batch) + " is not divisible by dp=" + std::to_string(t.dp);
  if (fits) return fits(t);
  return "";
}

// `t` with dp = world / (tp * pp) where dp is 0 (or kept, for "keep"); false when not a whole number.
bool with_dp(Topology* t, int64_t world) {
  const int64_t mp = int64_t(t->tp) * t->pp * t->cp;
  if (mp <= 0 || world % mp != 0 || world / mp > kMaxWorldSize) return false;
  t->dp = int(world / mp);
  return true;
}

[[noreturn]] void none_fits(const Topology& saved, int64_t world, const ElasticPolicy& p,
                            const std::vector<std::string>& tried) {
  std::string list;  // one line: error messages are single-line (control characters escaped)
  for (size_t i = 0; i < tried.size(); ++i) list += (i ? "; " : " ") + tried[i];
  fail(ErrorCode::kInvalidArgument, "no layout fits world size ", world, " (saved layout ", saved.to_string(),
       ", world size ", saved.world_size(), ", elastic policy '", ElasticPolicy::kind_name(p.kind),
       "'); tried:", list.empty() ? std::string(" nothing (the allowed list is empty)") : list);
}

}  // namespace

ElasticPolicy::Kind ElasticPolicy::parse_kind(const std::string& name) {
  if (name == "keep") return Kind::kKeepModelParallel;
  if (name == "list") return Kind::kAllowedList;
  if (name == "refuse") return Kind::kRefuse;
  fail(ErrorCode::kInvalidArgument, "elastic policy '", name, "' is unknown (known: keep, list, refuse)");
}

const char* ElasticPolicy::kind_name(Kind k) {
  switch (k) {
    case Kind::kKeepModelParallel: return "keep";
    case Kind::kAllowedList: return "list";
    case Kind::kRefuse: return "refuse";
  }
  return "?";
}

Topology parse_candidate(const std::string& text, const Topology& saved) {
  const Topology given = Topology::parse(text);
  auto has = [&](const char* key) {
    std::string s;
    for (char c : text)
      if (!std::isspace(static_cast<unsigned char>(c))) s += c;
    const std::string k = std::string(key) + "=";
    for (size_t at = s.find(k); at != std::string::npos; at = s.find(k, at + 1))
      if (at == 0 || s[at - 1] == ',') return true;
    return false;
  };
  Topology t = given;
  if (!has("vpp")) t.vpp = saved.vpp;
  if (!has("zero")) t.zero = saved.zero;
  if (!has("dp")) t.dp = 0;
  return t;
}

LayoutChoice choose_layout(const Topology& saved, int64_t world, const ElasticPolicy& policy, int64_t global_batch,
                           const std::function<std::string(const Topology&)>& fits) {
  if (world < 1 || world > kMaxWorldSize)
    fail(ErrorCode::kInvalidArgument, "elastic resume: world size ", world, " is outside 1..", kMaxWorldSize);
  if (global_batch < 0) fail(ErrorCode::kInvalidArgument, "elastic resume: global batch ", global_batch, " < 0");
  const int64_t was = saved.world_size();
  const std::string change = world == was ? "world size " + std::to_string(world) + " unchanged"
                                          : "world size " + std::to_string(was) + " -> " + std::to_string(world);
  LayoutChoice c;
  switch (policy.kind) {
    case ElasticPolicy::Kind::kRefuse: {
      const std::string why = world == was ? rejects(saved, world, global_batch, fits)
                                           : "policy 'refuse' allows only the saved world size " + std::to_string(was);
      if (!why.empty()) {
        c.tried.push_back(saved.to_string() + ": " + why);
        none_fits(saved, world, policy, c.tried);
      }
      c.target = saved;
      c.reason = change + ": the saved layout " + saved.to_string() + " (policy refuse)";
      return c;
    }
    case ElasticPolicy::Kind::kKeepModelParallel: {
      Topology t = saved;
      std::string why;
      if (!with_dp(&t, world))
        why = "world size " + std::to_string(world) + " is not a multiple of tp*pp = " +
              std::to_string(int64_t(saved.tp) * saved.pp);
      else
        why = rejects(t, world, global_batch, fits);
      if (!why.empty()) {
        c.tried.push_back("keep " + axes(saved) + ": " + why);
        none_fits(saved, world, policy, c.tried);
      }
      c.target = t;
      c.reason = change + ": kept " + axes(saved) + "; dp " + std::to_string(saved.dp) + " -> " +
                 std::to_string(t.dp) + " (policy keep)";
      return c;
    }
    case ElasticPolicy::Kind::kAllowedList: {
      for (size_t i = 0; i < policy.allowed.size(); ++i) {
        Topology t = policy.allowed[i];
        const std::string name = "allowed[" + std::to_string(i) + "] ";
        std::string why;
        if (t.dp == 0) {
          if (!with_dp(&t, world))
            why = "world size " + std::to_string(world) + " is not a multiple of tp*pp = " +
                  std::to_string(int64_t(t.tp) * t.pp);
        }
        if (why.empty()) why = rejects(t, world, global_batch, fits);
        if (!why.empty()) {
          c.tried.push_back(name + t.to_string() + ": " + why);
          continue;
        }
        c.target = t;
        c.reason = change + ": " + name + t.to_string() + ", the first allowed layout that fits (policy list" +
                   (c.tried.empty() ? std::string(")") : ", " + std::to_string(c.tried.size()) + " turned down before it)");
        return c;
      }
      none_fits(saved, world, policy, c.tried);
    }
  }
  fail(ErrorCode::kInternal, "choose_layout: unknown policy");
}

BatchPlan plan_batch(int64_t global_batch, int64_t micro_batch, int64_t dp) {
  if (global_batch < 1 || micro_batch < 1 || dp < 1)
    fail(ErrorCode::kInvalidArgument, "batch split: global batch ", global_batch, ", micro-batch ", micro_batch,
         ", dp ", dp, ": each must be at least 1");
  if (global_batch % dp != 0)
    fail(ErrorCode::kInvalidArgument, "global batch ", global_batch, " is not divisible by dp=", dp,
         ": the saved global batch cannot be kept at this data-parallel size (choose a layout whose dp divides it)");
  if (global_batch > kMaxGlobalBatch)
    fail(ErrorCode::kInvalidArgument, "global batch ", global_batch, " is out of range (at most 2^40 samples)");
  BatchPlan b;
  b.global_batch = global_batch;
  const int64_t per_rank = global_batch / dp;
  // The largest divisor of per_rank that is at most micro_batch (divisors come in pairs i, per_rank/i).
  int64_t mb = 1;
  for (int64_t i = 1; i * i <= per_rank; ++i) {
    if (per_rank % i != 0) continue;
    if (i <= micro_batch && i > mb) mb = i;
    if (per_rank / i <= micro_batch && per_rank / i > mb) mb = per_rank / i;
  }
  b.micro_batch = mb;
  b.grad_accum = per_rank / mb;
  if (mb != micro_batch)
    b.reason = "micro-batch " + std::to_string(micro_batch) + " -> " + std::to_string(mb) + ": global batch " +
               std::to_string(global_batch) + " over dp=" + std::to_string(dp) + " is " + std::to_string(per_rank) +
               " samples per rank, " + (micro_batch > per_rank ? "fewer than the micro-batch" : "not a multiple of it");
  return b;
}

}  // namespace reshard
