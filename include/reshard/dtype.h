// Element types reshard moves. Names follow safetensors' dtype strings ("F32", "BF16", ...)
// [safetensors README, Format section], which is also what our native format writes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace reshard {

enum class DType : uint8_t { F64, F32, F16, BF16, I64, I32, I16, I8, U8, Bool };

/// Bytes per element.
size_t dtype_size(DType t);
/// safetensors-style name: "F32", "BF16", "I64", "BOOL", ...
const char* dtype_name(DType t);
/// Parses a safetensors-style name (also accepts lower-case and torch names such as "float32",
/// "bfloat16", "fp16"). Throws Error(kInvalidArgument) naming the string otherwise.
DType dtype_from_name(const std::string& name);
/// True for F64/F32/F16/BF16.
bool dtype_is_float(DType t);

/// Converts `n` elements from `src` (type `from`) to `dst` (type `to`). Same type is a memcpy.
/// Float conversions round to nearest even (fp32 -> bf16/fp16), as torch's `.to()` does on CPU.
/// Throws Error(kUnsupported) for integer <-> float pairs, and Error(kInvalidArgument) when a
/// finite value does not fit `to` (rounds to +-inf: |v| > 65504 into F16; past bf16's or fp32's
/// largest from a wider type); elements before it may have been written. Values below the smallest
/// subnormal round to zero, as in torch.
void convert_elements(const void* src, DType from, void* dst, DType to, size_t n);

}  // namespace reshard
