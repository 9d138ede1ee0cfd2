#include "reshard/dtype.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "reshard/error.h"

namespace reshard {

namespace detail {
std::string one_line(std::string s) {
  size_t i = 0;
  for (; i < s.size(); ++i) {  // the common case: nothing to escape, no copy
    const uint8_t c = uint8_t(s[i]);
    if (c < 0x20 || c == 0x7f || c == 0xc2 || c == 0xe2) break;
  }
  if (i == s.size()) return s;
  std::string out = s.substr(0, i);
  char b[8];
  for (; i < s.size(); ++i) {
    const uint8_t c = uint8_t(s[i]);
    if (c < 0x20 || c == 0x7f) {
      std::snprintf(b, sizeof b, "\\x%02x", unsigned(c));
      out += b;
    } else if (c == 0xc2 && i + 1 < s.size() && uint8_t(s[i + 1]) == 0x85) {
      out += "\\u0085";
      ++i;
    } else if (c == 0xe2 && i + 2 < s.size() && uint8_t(s[i + 1]) == 0x80 &&
               (uint8_t(s[i + 2]) == 0xa8 || uint8_t(s[i + 2]) == 0xa9)) {
      out += uint8_t(s[i + 2]) == 0xa8 ? "\\u2028" : "\\u2029";
      i += 2;
    } else {
      out += char(c);
    }
  }
  return out;
}
}  // namespace detail

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "InvalidArgument";
    case ErrorCode::kNotFound: return "NotFound";
    case ErrorCode::kDataLoss: return "DataLoss";
    case ErrorCode::kUnsupported: return "Unsupported";
    case ErrorCode::kFailedPrecondition: return "FailedPrecondition";
    case ErrorCode::kInternal: return "Internal";
  }
  return "Internal";
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: case DType::I16: return 2;
    case DType::I8: case DType::U8: case DType::Bool: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F64: return "F64";
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::I16: return "I16";
    case DType::I8: return "I8";
    case DType::U8: return "U8";
    case DType::Bool: return "BOOL";
  }
  return "?";
}

DType dtype_from_name(const std::string& name) {
  std::string s = name;
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  if (s == "f64" || s == "float64" || s == "double" || s == "fp64") return DType::F64;
  if (s == "f32" || s == "float32" || s == "float" || s == "fp32") return DType::F32;
  if (s == "f16" || s == "float16" || s == "half" || s == "fp16") return DType::F16;
  if (s == "bf16" || s == "bfloat16") return DType::BF16;
  if (s == "i64" || s == "int64" || s == "long") return DType::I64;
  if (s == "i32" || s == "int32" || s == "int") return DType::I32;
  if (s == "i16" || s == "int16" || s == "short") return DType::I16;
  if (s == "i8" || s == "int8" || s == "char") return DType::I8;
  if (s == "u8" || s == "uint8" || s == "byte") return DType::U8;
  if (s == "bool") return DType::Bool;
  fail(ErrorCode::kInvalidArgument, "unknown dtype '", name,
       "' (expected one of F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL)");
}

bool dtype_is_float(DType t) {
  return t == DType::F64 || t == DType::F32 || t == DType::F16 || t == DType::BF16;
}

namespace {

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return uint16_t((u + rounding) >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; man <<= 1; } while ((man & 0x400) == 0);
      u = sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ff) << 13;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | man << 13;
  } else {
    u = sign | (exp + 127 - 15) << 23 | man << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000;
  uint32_t absu = u & 0x7fffffffu;
  if (absu > 0x7f800000u) return uint16_t(sign | 0x7e00);          // NaN
  if (absu >= 0x477ff000u) return uint16_t(sign | 0x7c00);         // overflow -> inf (after rounding)
  if (absu < 0x38800000u) {                                        // subnormal or zero in fp16
    if (absu < 0x33000000u) return uint16_t(sign);                 // underflows to zero
    uint32_t e = absu >> 23;
    uint32_t man = (absu & 0x7fffff) | 0x800000;
    uint32_t shift = 126 - e;  // value / 2^-24 = man * 2^(e - 126)
    uint32_t half = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return uint16_t(sign | half);
  }
  uint32_t r = absu + 0x0fffu + ((absu >> 13) & 1u);  // round to nearest even on bit 13
  r -= 0x38000000u;                                   // rebias exponent 127 -> 15
  return uint16_t(sign | (r >> 13));
}

template <typename From>
double load_as_double(const From* p, size_t i) { return double(p[i]); }

// A finite value that became +-inf in a narrower type: the value does not fit, and loading it
// as inf would be a wrong value that no checksum catches (bf16 1e6 into an
// f16 model loaded as inf with every check passing).
[[noreturn]] void overflow(double v, DType to) {
  fail(ErrorCode::kInvalidArgument, "a value of ", v, " does not fit in ", dtype_name(to), " (largest finite ",
       to == DType::F16 ? "65504" : to == DType::BF16 ? "3.39e38" : "3.40e38",
       "): converting it would give inf; load into a wider dtype (the checkpoint's own)");
}
}  // namespace

void convert_elements(const void* src, DType from, void* dst, DType to, size_t n) {
  if (from == to) {
    std::memcpy(dst, src, n * dtype_size(from));
    return;
  }
  if (!dtype_is_float(from) || !dtype_is_float(to)) {
    fail(ErrorCode::kUnsupported, "cannot convert ", dtype_name(from), " to ", dtype_name(to),
         ": only float types convert into each other");
  }
  // Go through float for the 16-bit types and fp32; through double when fp64 is involved.
  auto read_f32 = [&](size_t i) -> float {
    switch (from) {
      case DType::F32: return static_cast<const float*>(src)[i];
      case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(src)[i]);
      case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(src)[i]);
      case DType::F64: return float(static_cast<const double*>(src)[i]);
      default: return 0.f;
    }
  };
  // Whether source element i is finite (read as double where it is fp64: its float may be inf).
  auto finite = [&](size_t i) {
    return from == DType::F64 ? std::isfinite(static_cast<const double*>(src)[i]) : std::isfinite(read_f32(i));
  };
  auto source_value = [&](size_t i) {
    return from == DType::F64 ? static_cast<const double*>(src)[i] : double(read_f32(i));
  };
  if (to == DType::F64) {
    double* d = static_cast<double*>(dst);
    for (size_t i = 0; i < n; ++i) d[i] = double(read_f32(i));
    return;
  }
  if (to == DType::F32) {
    float* d = static_cast<float*>(dst);
    if (from == DType::BF16) {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
    } else {
      for (size_t i = 0; i < n; ++i) {
        d[i] = read_f32(i);
        if (std::isinf(d[i]) && finite(i)) overflow(source_value(i), to);
      }
    }
    return;
  }
  uint16_t* d = static_cast<uint16_t*>(dst);
  if (to == DType::BF16 && from == DType::F32) {
    // The common case (a master rounded to its weight's dtype): a loop with no call or switch in
    // it, which the compiler vectorises, and the overflow check folded into one flag; only when
    // it is set does the loop below find the value to name.
    const float* s = static_cast<const float*>(src);
    uint32_t overflowed = 0;
    for (size_t i = 0; i < n; ++i) {
      d[i] = f32_to_bf16(s[i]);
      overflowed |= uint32_t((d[i] & 0x7fffu) == 0x7f80u) & uint32_t(std::isfinite(s[i]));
    }
    if (!overflowed) return;
  }
  if (to == DType::BF16) {
    for (size_t i = 0; i < n; ++i) {
      d[i] = f32_to_bf16(read_f32(i));
      if ((d[i] & 0x7fff) == 0x7f80 && finite(i)) overflow(source_value(i), to);
    }
    return;
  }
  if (to == DType::F16) {
    for (size_t i = 0; i < n; ++i) {
      d[i] = f32_to_f16(read_f32(i));
      if ((d[i] & 0x7fff) == 0x7c00 && finite(i)) overflow(source_value(i), to);
    }
    return;
  }
  RESHARD_CHECK(false, "unhandled conversion");
}

}  // namespace reshard
