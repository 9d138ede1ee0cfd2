// Single-file state dicts: one file of name -> full tensor, the form a consolidated or exported
// model takes (safetensors files; torch.save files such as DeepSpeed's zero_to_fp32 output or a
// Megatron module dict). What `reshard diff` compares a checkpoint with. Nothing is unpickled:
// torch.save files go through the restricted reader of reshard/torch_archive.h.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "reshard/dtype.h"

namespace reshard {

/// One tensor of a state dict, as stored: `numel` elements of `dtype` in row-major order over
/// `shape` (data.size() == numel * dtype_size(dtype) bytes).
struct StateDictTensor {
  std::vector<int64_t> shape;
  int64_t real_rows = -1;  // vocab tensors consolidated from a checkpoint: rows >= it are padding; -1 here
  DType dtype = DType::F32;
  std::vector<char> data;
  int64_t numel = 0;
};

struct StateDict {
  std::string path;
  /// By canonical tensor name (the names `reshard inspect` shows): safetensors names are taken as
  /// they are; torch.save names are mapped from DeepSpeed's pipeline module names (each spec's
  /// role from its local names, transformer specs numbered in spec order) or plain-engine
  /// Megatron paths (shared/research format facts; docs/format.md).
  std::map<std::string, StateDictTensor> tensors;
  bool all_f32 = true;  // every tensor is F32 (an fp32 export: compare with the master)
};

/// True for a regular file named *.safetensors, *.pt, *.pth or *.bin.
bool is_state_dict_file(const std::string& path);

/// Reads a whole state-dict file into memory: *.safetensors by its JSON header (dtype, shape,
/// data_offsets), *.pt / *.pth / *.bin as a torch.save zip archive whose root is a dict of
/// tensors (nested dicts flattened with "."; a top-level "module" dict is descended into).
/// Memory: every tensor's bytes. Errors (Error, naming the path and the tensor): kInvalidArgument
/// for another kind of file, a root that is not a dict, no tensors, two names mapping to one
/// canonical name; kUnsupported for a dtype reshard does not read or a non-contiguous tensor;
/// kDataLoss for a header that describes more bytes than the file holds; kNotFound for a file
/// that cannot be opened.
StateDict read_state_dict(const std::string& path);

}  // namespace reshard
