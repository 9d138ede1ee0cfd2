// How reshard writes byte counts for people: the one formatting of every text output (the CLI's
// lines and progress bar, LoadReport::to_text, the policy notes, the Python package's log
// records). Machine-readable outputs (--json, the report's fields) carry exact byte counts.
#pragma once

#include <cstdint>
#include <string>

namespace reshard {

/// `bytes` in decimal units with three significant digits: "0 B", "512 B", "51.2 KB", "1.88 GB",
/// "17.5 TB" (KB = 10^3 B, MB = 10^6, GB = 10^9, TB = 10^12, PB = 10^15, EB = 10^18: the units
/// `--memory-budget` reads as KB/MB/GB; KiB-style binary units are not printed). Values are
/// rounded to nearest; a value that rounds up to 1000 of a unit is written in the next one
/// ("999.5 KB" -> "1.00 MB"). Never throws.
std::string format_bytes(uint64_t bytes);

}  // namespace reshard
