// libFuzzer target: arbitrary bytes as a torch.save archive (ZIP directory, data.pkl, tensor
// validation) through an in-memory ByteSource. Any reshard::Error is an accepted outcome; crashes,
// sanitizer reports, leaks and other exceptions are bugs.
#include <cstddef>
#include <cstdint>

#include "reshard/error.h"
#include "reshard/torch_archive.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace reshard::pt;
  MemorySource src(data, size);
  try {
    ZipDirectory d = read_zip_directory(src, "fuzz.zip");
    for (const ZipEntry& e : d.entries) {
      if (e.data_offset + e.uncompressed_size > size) __builtin_trap();  // must be bounds-checked
    }
  } catch (const reshard::Error&) {
  }
  try {
    TorchArchive a = open_torch_archive(src, "fuzz.pt");
    for (const TensorRef& t : a.tensors) {
      const TensorInfo& ti = t.value->as_tensor();
      const StorageRecord& r = a.record(ti);
      if (r.offset + r.length > size) __builtin_trap();
      (void)a.tensor_data_offset(ti);
    }
    try {
      (void)a.root().to_json(64, 100000).dump(-1, ' ', false,
                                               nlohmann::ordered_json::error_handler_t::replace);
    } catch (const reshard::Error&) {
    }
    (void)a.root().repr(1000);
  } catch (const reshard::Error&) {
  }
  return 0;
}
