// libFuzzer target: arbitrary bytes as a pickle stream (the restricted unpickler), then the
// JSON/repr views and the accessors on every node. Any reshard::Error is an accepted outcome.
#include <cstddef>
#include <cstdint>

#include "reshard/error.h"
#include "reshard/torch_archive.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace reshard::pt;
  try {
    auto doc = parse_pickle(data, size, "fuzz.pkl");
    try {
      (void)doc->root().to_json(64, 100000).dump(-1, ' ', false,
                                                  nlohmann::ordered_json::error_handler_t::replace);
    } catch (const reshard::Error&) {
    }
    (void)doc->root().repr(1000);
    for (const auto& n : doc->nodes()) {
      try {
        if (n->kind == PyValue::Kind::Tensor) {
          (void)n->tensor->extent();
          (void)n->tensor->numel();
          (void)n->tensor->is_contiguous();
        }
        (void)n->get("key");
      } catch (const reshard::Error&) {
      }
    }
  } catch (const reshard::Error&) {
  }
  return 0;
}
