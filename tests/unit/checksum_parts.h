// Checks one checksum unit the way a load's copy step does (RangeCheck fed the bytes in uneven
// parts) and the way verify=full does (verify_range: the bytes in one update), and expects the
// same verdict and message from both: a checksum state carried across parts must give what one
// pass gives.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "reshard/checkpoint.h"

namespace reshard::testing {

/// Returns the problem found in unit `u` of `r` ("" when it passes).
inline std::string check_unit_in_parts(const CheckpointReader& r, const ChecksumUnit& u) {
  std::vector<uint8_t> data(u.length);
  r.read(u.file, u.offset, u.length, data.data());
  EXPECT_TRUE(r.has_checksum(u.file, u.offset, u.length));
  std::unique_ptr<RangeCheck> c = r.begin_check(u.file, u.offset, u.length);
  if (!c) {
    ADD_FAILURE() << "no incremental check for file " << u.file << " bytes [" << u.offset << ", +" << u.length << ")";
    return "no incremental check";
  }
  size_t at = 0, step = 1;
  while (at < data.size()) {
    const size_t n = std::min(step, data.size() - at);
    c->update(data.data() + at, n);
    at += n;
    step = step * 3 + 5;
  }
  const std::string parts = c->finish();
  EXPECT_EQ(parts, r.verify_range(u.file, u.offset, u.length, data.data()));
  return parts;
}

}  // namespace reshard::testing
