// Internals of the native format shared by the writer, the reader and synth.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "reshard/checkpoint.h"
#include "reshard/layout.h"

namespace reshard::native {

constexpr const char* kMetadataFile = "metadata.json";
constexpr const char* kLatestFile = "latest";
constexpr const char* kFormatName = "reshard";

/// "rank_00003.safetensors".
std::string rank_file_name(int rank);
/// Throws Error(kInvalidArgument) for a step name that is not a plain folder name.
void check_step_name(const std::string& step);
/// xxh3-64 as 16 lowercase hex digits.
std::string xxh3_hex(const void* data, size_t bytes);
/// xxh3-64 over bytes given in pieces; hex() is what xxh3_hex gives for their concatenation.
class Xxh3Stream {
 public:
  Xxh3Stream();
  ~Xxh3Stream();
  Xxh3Stream(const Xxh3Stream&) = delete;
  Xxh3Stream& operator=(const Xxh3Stream&) = delete;
  void update(const void* data, size_t bytes);
  std::string hex() const;

 private:
  void* state_;  // XXH3_state_t
};
/// 16 random hex digits.
std::string make_nonce();
/// A value read from a file for a message: quoted, cut at 40 bytes with its length said
/// ("'abc'", "'<40 bytes>' (3000 bytes, cut)"); fail() escapes what would break the line.
std::string quoted_cut(const std::string& v);

/// Per buffer, the indices of its pieces.
std::vector<std::vector<int>> pieces_by_buffer(const Layout& L);

struct RankFileResult {
  uint64_t bytes = 0;
  std::vector<std::pair<int, std::string>> checksums;  // (piece index, xxh3 hex)
};
/// Writes and fsyncs dir/rank_<rank>.safetensors holding `rank`'s buffers (ptr(b) gives the bytes
/// of buffer b), ordered by decreasing dtype size then layout order; checksums every piece. The
/// header's __metadata__ records the file's rank, `save` (the save's id, also in metadata.json) and
/// `layout` (layout_digest(L)), so a file renamed, swapped or copied in from another save, and a
/// metadata.json edited after the save, are refused at open (format.md §2).
RankFileResult write_rank_file(const std::string& dir, const Layout& L, int rank, const std::string& save,
                               const std::string& layout_digest,
                               const std::vector<std::vector<int>>& by_buffer,
                               const std::function<const void*(int buffer)>& ptr);

/// Saves from one process; provide(rank) returns pointers indexed like L.buffers valid at least
/// for that rank's buffers until the next call. `replace_step` as in save_native_all_ranks.
void save_all_ranks_with(const std::string& root, const std::string& step, const Layout& L,
                         const NonTensorState& state,
                         const std::function<std::vector<const void*>(int rank)>& provide,
                         bool replace_step = true);

}  // namespace reshard::native

namespace reshard {
/// A folder holding DeepSpeed's per-step files (*_model_states.pt) / a native step (metadata.json).
bool is_deepspeed_step(const std::string& dir);
bool is_native_step(const std::string& dir);
}  // namespace reshard
