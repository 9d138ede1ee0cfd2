// libFuzzer target: arbitrary bytes as a native step folder's metadata.json, through
// parse_metadata (csrc/formats/native/layout_json.cc), the function NativeReader::load() calls
// before it touches any data file: JSON parse, "format" / "format_version", layout_from_json
// (topology, model, tensors, arrays, buffers, pieces with their bounds checks, flat groups),
// state_from_json (base64 per-rank blobs), the "files" list (plain rank file names, no
// duplicates) and each buffer's file. A parsed layout is written back with layout_to_json and
// parsed again: the second parse must succeed and give the same JSON (round trip). Any
// reshard::Error is an accepted outcome; crashes, sanitizer reports, leaks, other exceptions and a
// failed round trip are bugs.
#include <cstddef>
#include <cstdint>
#include <string>

#include "formats/native/layout_json.h"
#include "reshard/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace reshard::native;
  const std::string path = "fuzz/metadata.json";
  try {
    Metadata md = parse_metadata(std::string_view(reinterpret_cast<const char*>(data), size), path);
    const reshard::Layout& L = md.layout;
    const std::vector<std::string>& buffer_files = md.buffer_files;
    const std::vector<std::string>& checksums = md.checksums;
    const reshard::NonTensorState& s = md.state;
    if (buffer_files.size() != L.buffers.size() || checksums.size() != L.pieces.size() ||
        md.buffer_file.size() != L.buffers.size())
      __builtin_trap();
    for (size_t b = 0; b < L.buffers.size(); ++b)
      if (md.buffer_file[b] < 0 || size_t(md.buffer_file[b]) >= md.files.size() ||
          md.files[size_t(md.buffer_file[b])].first != buffer_files[b])
        __builtin_trap();
    for (const auto& p : L.pieces) {
      const int64_t span = piece_span(p);
      if (p.base < 0 || span < 0 || p.base + span > L.buffers[size_t(p.buffer)].numel) __builtin_trap();
    }
    // Round trip: what we parsed must serialize and parse back to the same thing.
    json again = layout_to_json(L, buffer_files, checksums);
    std::string first = again.dump();
    try {  // from here on an Error is a failed round trip, not an accepted outcome
      std::vector<std::string> bf2, cs2;
      const JsonDoc again_doc(first, path);
      reshard::Layout L2 = layout_from_json(again_doc.root(), &bf2, &cs2);
      if (layout_to_json(L2, bf2, cs2).dump() != first) __builtin_trap();
      const JsonDoc st_doc(state_to_json(s).dump(), path);
      reshard::NonTensorState s2 = state_from_json(st_doc.root());
      if (s2.per_rank != s.per_rank || s2.step != s.step || s2.iteration != s.iteration)
        __builtin_trap();
    } catch (const reshard::Error&) {
      __builtin_trap();
    }
  } catch (const reshard::Error&) {
  }
  return 0;
}
