// Placeholder until the DeepSpeed reader lands: delete this file when csrc/formats/deepspeed
// defines open_deepspeed.
#include "formats/deepspeed/deepspeed_reader.h"

#include "reshard/error.h"

namespace reshard {

std::unique_ptr<CheckpointReader> open_deepspeed(const std::string& step_dir, const OpenOptions&) {
  fail(ErrorCode::kUnsupported, "DeepSpeed reader not built yet (", step_dir, ")");
}

}  // namespace reshard
