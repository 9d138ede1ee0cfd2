// Layouts: where every element of every tensor and optimizer state lives, as pieces.
//
// One vocabulary serves every source and target, so the planner never knows file formats:
//  - a LogicalArray is one (tensor, state kind) pair with a logical shape (fused tensors get a
//    logical view in which every tp shard is a box);
//  - a Buffer is a run of elements of one dtype on one rank: a tp-local weight tensor, or a ZeRO
//    flat partition of one param group for one state kind; a reader maps each source buffer to a
//    (file, byte offset);
//  - a Piece says that the elements of a Box of a logical array live in a buffer at
//    base + sum(i_d * strides[d]) (element units), i_d relative to the box origin.
// Flat partitions become ordinary pieces: a flat sub-range of a tensor cut in its local memory
// order decomposes into at most 2*ndim-1 boxes.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "reshard/dtype.h"
#include "reshard/model.h"
#include "reshard/topology.h"

namespace reshard {

constexpr int kMaxDims = 5;

enum class StateKind : uint8_t { kWeight = 0, kMaster = 1, kExpAvg = 2, kExpAvgSq = 3 };
constexpr int kNumStateKinds = 4;
const char* state_kind_name(StateKind s);  // "weight", "fp32", "exp_avg", "exp_avg_sq"
StateKind state_kind_from_name(const std::string& s);

struct Box {
  int ndim = 0;
  std::array<int64_t, kMaxDims> off{};
  std::array<int64_t, kMaxDims> len{};
  int64_t numel() const;
  bool empty() const { return numel() == 0; }
  bool operator==(const Box& o) const;
  bool operator<(const Box& o) const;
  std::string to_string() const;  // "[0:4, 2:6]"
};
/// Intersection of two boxes of the same rank; empty box (len 0) when disjoint.
Box intersect(const Box& a, const Box& b);
bool contains(const Box& outer, const Box& inner);

struct LogicalArray {
  std::string tensor;
  StateKind state = StateKind::kWeight;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  int64_t real_rows = -1;  // vocab tensors: dim 0 rows >= real_rows are padding
  Reduction reduction = Reduction::kReplicated;
  std::string key() const { return tensor + "/" + state_kind_name(state); }
};

struct Buffer {
  std::string name;  // e.g. "weight/layers.0.mlp.dense_4h_to_h.weight", "fp32/group0"
  int rank = 0;      // owning rank of the layout
  DType dtype = DType::F32;
  int64_t numel = 0;
  StateKind state = StateKind::kWeight;
  int group = -1;    // param group for flat partitions, -1 for per-tensor buffers
};

struct Piece {
  int32_t array = -1;   // index into Layout::arrays
  int32_t buffer = -1;  // index into Layout::buffers
  Box box;              // in the array's logical index space
  int64_t base = 0;     // element offset in the buffer of the box origin
  std::array<int64_t, kMaxDims> strides{};  // elements per unit step in each logical dim
};

/// One parameter group of one (pp, tp) model shard, in flat order. Names the tensor of each
/// entry; offsets are in elements of the unpadded flat buffer.
struct FlatGroup {
  struct Entry {
    std::string tensor;
    int64_t offset = 0;
    int64_t numel = 0;
  };
  std::vector<Entry> entries;
  int64_t numel = 0;           // N: sum of entries plus gaps, without tail padding
  int64_t partition_size = 0;  // P: elements per dp rank (padded)
  bool no_weight_decay = false;
};

/// Options for deriving a layout from (model, topology).
struct DeriveOptions {
  /// Weight buffers only on dp rank 0 (what a saved checkpoint holds) instead of every rank.
  bool weights_on_dp0_only = false;
  /// Include the optimizer state kinds (fp32 master, exp_avg, exp_avg_sq).
  bool optimizer = true;
  /// Alignment of a ZeRO-1/2 flat group: the padded size is a multiple of align_factor * dp
  /// (DeepSpeed's nccl_start_alignment_factor is 2 [DS zero/stage_1_and_2.py]).
  int align_factor = 2;
  /// Pipeline stage (pp rank) of each global layer, num_layers entries in [0, pp); empty means
  /// uniform_stage_of_layer. Given, it may be uneven (a trainer's own partition): the model's
  /// layers need not divide by pp*vpp then.
  std::vector<int> stage_of_layer;
};

struct Layout {
  Topology topo;
  ModelConfig model;
  std::vector<TensorSpec> tensors;
  std::vector<LogicalArray> arrays;
  std::vector<Buffer> buffers;
  std::vector<Piece> pieces;
  /// Flat groups per (pp_rank, tp_rank): groups[pp * tp + tp_rank]; empty for ZeRO 0.
  std::vector<std::vector<FlatGroup>> flat_groups;
  /// Built by explicit_layout: every buffer holds one given box of one tensor (a DCP chunk, a
  /// DTensor's local shard). `model` is a placeholder then (its name only): no tp or pipeline
  /// rules apply, and `topo` only counts ranks.
  bool explicit_boxes = false;

  int find_array(const std::string& tensor, StateKind s) const;  // -1 if absent
  int find_buffer(int rank, const std::string& name) const;      // -1 if absent
  /// Total bytes of all buffers (the state a job holds).
  uint64_t total_bytes() const;
};

/// Memory a caller gives for `rank`'s buffers of `L` (`memory[i]` for buffer i, nullptr for other
/// ranks' buffers or where none is given): "buffers A and B overlap in memory (N bytes)" for the
/// first two buffers whose bytes overlap, or "" when none do. Two buffers in one place would load
/// one's values over the other's, silently; loads refuse that before reading anything.
std::string overlapping_buffers(const Layout& L, int rank, const std::vector<const void*>& memory);

/// Logical shape of a tensor and the pieces of tp rank `tp_rank`, relative to that rank's local
/// tensor (row-major over its local shape; base and strides in local elements).
struct TpShard {
  std::vector<int64_t> logical_shape;
  std::vector<int64_t> local_shape;
  std::vector<Piece> pieces;  // array/buffer fields unset
};
TpShard tp_shard(const TensorSpec& spec, const ModelConfig& cfg, int tp, int tp_rank);

/// Everything build_layout needs besides the model and topology: the tensors (classified, global
/// shapes at this topology's tp), which pipeline stages hold each, and optionally the param
/// groups of each (pp, tp) model shard as the optimizer built them (flat order, offsets, partition
/// size). Readers build recipes from files; trainers from the live optimizer.
struct LayoutRecipe {
  std::vector<TensorSpec> tensors;
  std::vector<std::vector<int>> stages;  // per tensor: stages that hold it (tied: {0, pp-1})
  /// groups[pp_rank * tp + tp_rank]; an empty vector means "compute as derive_layout does".
  /// Entries name tensors; ZeRO-1/2 offsets are in the unpadded flat buffer (gaps allowed), ZeRO-3
  /// offsets are positions in each rank's per-parameter partition buffer.
  std::vector<std::vector<FlatGroup>> groups;
};

/// The stage of each global layer a layout at `topo` uses: `given` (DeriveOptions::stage_of_layer,
/// LikeOptions::stage_of_layer) after checks, or uniform_stage_of_layer when it is empty. Throws
/// Error(kInvalidArgument): the model does not fit the topology (ModelConfig::validate_for; the
/// layer count only for the uniform split), or `given` has not num_layers entries, a stage outside
/// [0, pp), or differs from the interleaved split where vpp > 1.
std::vector<int> checked_stage_of_layer(const ModelConfig& cfg, const Topology& topo, const std::vector<int>& given);

/// Pipeline stage of each global layer in a layout: the pp rank of the ranks that hold the
/// layer's weights (a checkpoint's own split, uneven or not). Empty when a layer's weights are on
/// no stage or on more than one (a layout that does not place layers by stage).
std::vector<int> stage_of_layer_in(const Layout& L);

/// The recipe derive_layout uses: model_tensors + uniform stages, no explicit groups.
LayoutRecipe default_recipe(const ModelConfig& cfg, const Topology& topo, const DeriveOptions& opt = {});

/// Builds a layout from a recipe (see derive_layout for what it contains). Throws
/// Error(kInvalidArgument) naming the tensor or group when explicit groups disagree with the
/// tensors (unknown tensor, numel mismatch, partition too small).
Layout build_layout(const ModelConfig& cfg, const Topology& topo, const LayoutRecipe& recipe,
                    const DeriveOptions& opt = {});

/// Builds the full layout of a job: weight buffers per tp-local tensor on every rank that holds
/// it (tied embedding on the first and last stage), and for the optimizer: ZeRO 0 per-tensor
/// buffers, ZeRO 1/2 one flat partition per param group and state kind (groups: weight decay /
/// no weight decay, in parameter order), ZeRO 3 per-parameter partitions (each padded to a
/// multiple of dp). Throws Error(kInvalidArgument) when the model does not fit the topology.
Layout derive_layout(const ModelConfig& cfg, const Topology& topo, const DeriveOptions& opt = {});

/// Appends the pieces of a flat partition: elements [range_begin, range_end) of a tensor's tp-local
/// memory (row-major order of the local tensor) placed at buffer offset `buffer_offset`.
void append_flat_range_pieces(const TpShard& shard, int64_t range_begin, int64_t range_end,
                              int32_t array, int32_t buffer, int64_t buffer_offset,
                              std::vector<Piece>* out);

/// A tensor of a layout given box by box (explicit_layout): its name, state kind and global shape.
struct ExplicitArray {
  std::string tensor;
  StateKind state = StateKind::kWeight;
  std::vector<int64_t> shape;  // global shape, 1..kMaxDims dims, each >= 0
};
/// One rank's buffer holding one box of one ExplicitArray, in row-major order of the box.
struct ExplicitBuffer {
  std::string name;   // unique per rank
  int rank = 0;
  DType dtype = DType::F32;
  int32_t array = 0;  // index into the ExplicitArray list
  std::vector<int64_t> offsets, sizes;  // the box in global coordinates (elements)
};
/// A layout given box by box, for sources and targets that are not described by a model and a
/// tp/pp/dp topology: a torch.distributed.checkpoint folder's chunks, the local shards of a live
/// FSDP2 / DTensor module. Pure. Each buffer is one box (base 0, row-major strides); boxes of one
/// tensor may overlap (replicas). `topo` gives the world size (tp = pp = 1). Throws
/// Error(kInvalidArgument) naming the tensor or buffer: an array index out of range, a box with
/// another number of dims than its tensor or outside its global shape, more than
/// kMaxModelParameters elements in a tensor, a rank outside [0, world size), a
/// buffer name used twice on one rank, a tensor and state kind listed twice, a 0-d tensor.
Layout explicit_layout(const std::string& name, const Topology& topo, const std::vector<ExplicitArray>& arrays,
                       const std::vector<ExplicitBuffer>& buffers);

/// Decomposes the row-major flat range [begin, end) of a box of extents `len` (ndim dims) into
/// at most 2*ndim-1 sub-boxes (offsets relative to the box), in increasing flat order.
std::vector<Box> flat_range_to_boxes(const Box& extent, int64_t begin, int64_t end);

}  // namespace reshard
