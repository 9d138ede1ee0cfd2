#include "reshard/units.h"

#include <cstdio>

namespace reshard {

std::string format_bytes(uint64_t bytes) {
  if (bytes < 1000) return std::to_string(bytes) + " B";
  static const char* const kUnits[] = {"KB", "MB", "GB", "TB", "PB", "EB"};
  double v = double(bytes) / 1000.0;
  int u = 0;
  // Pick the unit after rounding to three significant digits, so 999,999 B is "1.00 MB".
  while (u < 5 && v >= 999.5) {
    v /= 1000.0;
    ++u;
  }
  char buf[32];
  if (v >= 99.95) std::snprintf(buf, sizeof(buf), "%.0f %s", v, kUnits[u]);
  else if (v >= 9.995) std::snprintf(buf, sizeof(buf), "%.1f %s", v, kUnits[u]);
  else std::snprintf(buf, sizeof(buf), "%.2f %s", v, kUnits[u]);
  return buf;
}

}  // namespace reshard
