// libFuzzer target: arbitrary bytes as a native step folder's metadata.json, through the same
// parsing steps NativeReader::load() (csrc/formats/native/reader.cc) applies before it touches any
// data file: JSON parse, "format" / "format_version", layout_from_json (topology, model, tensors,
// arrays, buffers, pieces with their bounds checks, flat groups), state_from_json (base64 per-rank
// blobs) and the "files" list. A parsed layout is written back with layout_to_json and parsed
// again: the second parse must succeed and give the same JSON (round trip). Any reshard::Error is
// an accepted outcome; crashes, sanitizer reports, leaks, other exceptions and a failed round
// trip are bugs.
//
// The reader has no pure "parse metadata text" entry point; this target mirrors its JSON half
// (see docs/fuzzing.md for the entry point we propose so the target and the reader share it).
#include <cstddef>
#include <cstdint>
#include <string>

#include "formats/native/layout_json.h"
#include "reshard/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace reshard::native;
  const std::string path = "fuzz/metadata.json";
  json meta = json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (meta.is_discarded()) return 0;  // the reader turns this into kDataLoss "is not valid JSON"
  try {
    Field root(meta, "", path);
    (void)root["format"].str();
    int64_t version = root["format_version"].i64();
    (void)version;
    std::vector<std::string> buffer_files, checksums;
    reshard::Layout L = layout_from_json(root, &buffer_files, &checksums);
    if (buffer_files.size() != L.buffers.size() || checksums.size() != L.pieces.size()) __builtin_trap();
    for (const auto& p : L.pieces) {
      const int64_t span = piece_span(p);
      if (p.base < 0 || span < 0 || p.base + span > L.buffers[size_t(p.buffer)].numel) __builtin_trap();
    }
    reshard::NonTensorState s = state_from_json(root["state"]);
    Field files = root["files"];
    for (size_t i = 0; i < files.size(); ++i) {
      (void)files[i]["name"].str();
      (void)files[i]["bytes"].i64();
    }
    // Round trip: what we parsed must serialize and parse back to the same thing.
    json again = layout_to_json(L, buffer_files, checksums);
    std::string first = again.dump();
    std::vector<std::string> bf2, cs2;
    reshard::Layout L2 = layout_from_json(Field(again, "", path), &bf2, &cs2);
    if (layout_to_json(L2, bf2, cs2).dump() != first) __builtin_trap();
    json st = state_to_json(s);
    reshard::NonTensorState s2 = state_from_json(Field(st, "", path));
    if (s2.per_rank != s.per_rank || s2.step != s.step || s2.iteration != s.iteration) __builtin_trap();
  } catch (const reshard::Error&) {
  }
  return 0;
}
