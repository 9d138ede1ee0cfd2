// libFuzzer target: arbitrary bytes as a safetensors file, through the pure header parser
// (csrc/formats/safetensors): parse_header_size on the 8-byte prefix with the real input size, then
// parse_header on the N header bytes; and the whole input as a header text (so mutations reach
// the JSON validation without first having to fix up the length prefix). Any reshard::Error is an
// accepted outcome; crashes, sanitizer reports, leaks and other exceptions are bugs. The target
// also traps when a returned header breaks its documented invariants (offsets tile the buffer,
// end - begin = numel * dtype size, data_start = 8 + N).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "formats/safetensors/safetensors.h"
#include "reshard/error.h"

namespace {

void check(const reshard::safetensors::Header& h, size_t header_len) {
  if (h.header_size != header_len || h.data_start != 8 + header_len) __builtin_trap();
  uint64_t total = 0;
  for (const auto& [name, t] : h.tensors) {
    if (t.end < t.begin || t.end > h.buffer_size) __builtin_trap();
    const int bits = reshard::safetensors::dtype_bits(t.dtype);
    if (bits == 0) __builtin_trap();
    unsigned __int128 n = 1;
    for (int64_t d : t.shape) n *= uint64_t(d);
    if (n * unsigned(bits) / 8 != t.end - t.begin) __builtin_trap();
    (void)t.numel();
    total += t.end - t.begin;
  }
  if (total != h.buffer_size) __builtin_trap();  // tiles exactly: no hole, no overlap
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace st = reshard::safetensors;
  if (size >= 8) {
    try {
      const uint64_t n = st::parse_header_size(data, size, "fuzz.safetensors");
      if (8 + n > size) __builtin_trap();  // must have been refused
      std::string_view text(reinterpret_cast<const char*>(data) + 8, size_t(n));
      st::Header h = st::parse_header(text, "fuzz.safetensors");
      check(h, size_t(n));
    } catch (const reshard::Error&) {
    }
  }
  try {
    std::string_view text(reinterpret_cast<const char*>(data), size);
    st::Header h = st::parse_header(text, "fuzz.json");
    check(h, size);
  } catch (const reshard::Error&) {
  }
  return 0;
}
