// format_bytes: the one way text outputs write byte counts.
#include <gtest/gtest.h>

#include "reshard/units.h"

namespace reshard {
namespace {

TEST(FormatBytes, ThreeSignificantDigitsInDecimalUnits) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(999), "999 B");
  EXPECT_EQ(format_bytes(1000), "1.00 KB");
  EXPECT_EQ(format_bytes(51200), "51.2 KB");
  EXPECT_EQ(format_bytes(65536), "65.5 KB");
  EXPECT_EQ(format_bytes(1889000), "1.89 MB");
  EXPECT_EQ(format_bytes(1880000000), "1.88 GB");
  EXPECT_EQ(format_bytes(2057832448), "2.06 GB");
  EXPECT_EQ(format_bytes(17500000000000ull), "17.5 TB");
  EXPECT_EQ(format_bytes(123456789012345ull), "123 TB");
}

TEST(FormatBytes, RoundingCarriesIntoTheNextDigitAndUnit) {
  EXPECT_EQ(format_bytes(9994), "9.99 KB");
  EXPECT_EQ(format_bytes(9995), "10.0 KB");
  EXPECT_EQ(format_bytes(99949), "99.9 KB");
  EXPECT_EQ(format_bytes(99950), "100 KB");
  EXPECT_EQ(format_bytes(999499), "999 KB");
  EXPECT_EQ(format_bytes(999500), "1.00 MB");
  EXPECT_EQ(format_bytes(1073741824), "1.07 GB");
  EXPECT_EQ(format_bytes(~uint64_t(0)), "18.4 EB");
}

}  // namespace
}  // namespace reshard
