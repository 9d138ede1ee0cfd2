// safetensors header parser and builder (csrc/formats/safetensors), per formats.md §6.
#include <gtest/gtest.h>

#include <string>

#include "formats/safetensors/safetensors.h"
#include "reshard/error.h"

namespace reshard {
namespace {

namespace st = safetensors;

std::string parse_error(const std::string& json) {
  try {
    st::parse_header(json, "t.safetensors");
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDataLoss) << e.what();
    EXPECT_NE(std::string(e.what()).find("t.safetensors"), std::string::npos) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "accepted: " << json;
  return {};
}

TEST(Safetensors, ParsesAValidHeader) {
  const std::string j =
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[2,3],"data_offsets":[16,28]},)"
      R"("a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"f8":{"dtype":"F8_E4M3","shape":[],"data_offsets":[28,29]}})"
      "    ";
  auto h = st::parse_header(j, "t.safetensors");
  EXPECT_EQ(h.data_start, 8 + j.size());
  EXPECT_EQ(h.buffer_size, 29u);
  EXPECT_EQ(h.metadata.at("format"), "pt");
  ASSERT_EQ(h.tensors.size(), 3u);
  EXPECT_EQ(h.tensors.at("b").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(*h.tensors.at("b").rtype, DType::BF16);
  EXPECT_FALSE(h.tensors.at("f8").rtype.has_value());
  EXPECT_EQ(h.tensors.at("f8").numel(), 1);
  // Empty file: no tensors.
  EXPECT_EQ(st::parse_header("{}", "t").buffer_size, 0u);
}

TEST(Safetensors, RejectsBrokenHeaders) {
  EXPECT_NE(parse_error(" {}").find("does not start with '{'"), std::string::npos);
  EXPECT_NE(parse_error("{\"a\":").find("not valid JSON"), std::string::npos);
  EXPECT_NE(parse_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})")
                .find("names tensor 'a' twice"),
            std::string::npos);
  EXPECT_NE(parse_error(R"({"a":{"dtype":"F31","shape":[1],"data_offsets":[0,4]}})").find("unknown safetensors dtype 'F31'"),
            std::string::npos);
  EXPECT_NE(parse_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})").find("need 8"), std::string::npos);
  EXPECT_NE(parse_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})").find("leave a hole"), std::string::npos);
  EXPECT_NE(parse_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})")
                .find("overlap"),
            std::string::npos);
  EXPECT_NE(parse_error(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})").find("non-negative"), std::string::npos);
  EXPECT_NE(parse_error(R"({"a":{"dtype":"F32","shape":[1]}})").find("has no 'data_offsets'"), std::string::npos);
  EXPECT_NE(parse_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})").find("end before"), std::string::npos);
  EXPECT_NE(parse_error(R"({"__metadata__":{"x":1}})").find("must be a string"), std::string::npos);
  EXPECT_NE(parse_error(R"({"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})").find("whole number of bytes"),
            std::string::npos);
}

TEST(Safetensors, HeaderSizeLimits) {
  uint8_t p[8] = {};
  uint64_t n = 100'000'001;
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(n >> (8 * i));
  EXPECT_THROW(st::parse_header_size(p, UINT64_MAX, "x"), Error);
  n = 64;
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(n >> (8 * i));
  EXPECT_EQ(st::parse_header_size(p, 72, "x"), 64u);
  EXPECT_THROW(st::parse_header_size(p, 71, "x"), Error);
}

TEST(Safetensors, BuildThenParse) {
  std::vector<std::pair<uint64_t, uint64_t>> off;
  std::string h = st::build_header({{"w", DType::F32, {3}}, {"v", DType::BF16, {5}}, {"e", DType::F32, {0}}}, {{"format", "reshard"}}, &off);
  ASSERT_EQ(h.size() % 8, 0u);
  uint64_t n = st::parse_header_size(reinterpret_cast<const uint8_t*>(h.data()), h.size(), "built");
  EXPECT_EQ(n + 8, h.size());
  auto parsed = st::parse_header(std::string_view(h).substr(8), "built");
  EXPECT_EQ(parsed.buffer_size, 22u);
  EXPECT_EQ(parsed.tensors.at("v").begin, 12u);
  EXPECT_EQ(parsed.tensors.at("v").end, 22u);
  EXPECT_EQ(off[1], (std::pair<uint64_t, uint64_t>{12, 22}));
  EXPECT_EQ(parsed.metadata.at("format"), "reshard");
  EXPECT_THROW(st::build_header({{"a", DType::F32, {1}}, {"a", DType::F32, {1}}}, {}), Error);
  EXPECT_THROW(st::build_header({{"__metadata__", DType::F32, {1}}}, {}), Error);
}

}  // namespace
}  // namespace reshard
