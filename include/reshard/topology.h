// Parallel layout of a job: sizes of the mesh axes and the ZeRO stage.
//
// Rank order is tp fastest, then dp, then pp (Megatron's default order, also DeepSpeed's
// PipeModelDataParallelTopology with axes [pipe, data, model]):
//   rank = (pp_rank * dp + dp_rank) * tp + tp_rank.
// Written as "tp=2,pp=2,vpp=1,dp=4,zero=1" in CLI strings; omitted keys default to 1 (zero to 0).
#pragma once

#include <cstdint>
#include <string>

namespace reshard {

/// Largest world size (tp * pp * dp) a layout may have: every rank plans the whole job, and the
/// plan grows with the world size (a tiny model at dp=65536 took 7 GB, at 131072 13 GB).
constexpr int64_t kMaxWorldSize = int64_t(1) << 16;

struct Topology {
  int tp = 1;    // tensor parallel size (mesh axis "tp")
  int pp = 1;    // pipeline parallel size
  int vpp = 1;   // virtual pipeline chunks per pipeline rank (interleaved schedule)
  int dp = 1;    // data parallel size
  int zero = 0;  // ZeRO stage 0 (none), 1, 2 (optimizer state flat-partitioned over dp), 3 (per parameter)
  int cp = 1;    // context parallel: reserved, must be 1
  int ep = 1;    // expert parallel: reserved, must be 1

  int world_size() const { return tp * pp * dp * cp; }
  int rank_of(int pp_rank, int dp_rank, int tp_rank) const { return (pp_rank * dp + dp_rank) * tp + tp_rank; }
  int tp_rank(int rank) const { return rank % tp; }
  int dp_rank(int rank) const { return (rank / tp) % dp; }
  int pp_rank(int rank) const { return rank / (tp * dp); }

  /// Canonical string "tp=T,pp=P,vpp=V,dp=D,zero=Z".
  std::string to_string() const;
  /// Parses "tp=2,pp=2,dp=4,zero=1" (any order, spaces allowed, plain decimal digits, no empty
  /// item). Throws Error(kInvalidArgument) naming the key for an unknown key, a non-integer or a
  /// value below 1 (zero: 0..3).
  static Topology parse(const std::string& text);
  /// Checks the sizes alone (every axis >= 1, zero in 0..3, cp = ep = 1, zero 3 with pp = 1 as
  /// DeepSpeed requires, at most kMaxWorldSize ranks). Throws Error(kInvalidArgument) naming the
  /// field and the rule.
  void validate() const;

  bool operator==(const Topology& o) const {
    return tp == o.tp && pp == o.pp && vpp == o.vpp && dp == o.dp && zero == o.zero && cp == o.cp &&
           ep == o.ep;
  }
  bool operator!=(const Topology& o) const { return !(*this == o); }
};

/// The change between two layouts in words, e.g. "tp 2->4, dp 4->2, ZeRO-1 partitions re-cut".
/// "no change" when equal.
std::string describe_change(const Topology& from, const Topology& to);

}  // namespace reshard
