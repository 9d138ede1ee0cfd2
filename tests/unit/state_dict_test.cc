// read_state_dict: single-file state dicts (what `reshard diff` compares a checkpoint with). The
// torch.save side is tested through the CLI with files torch itself writes
// (tests/python/test_cli_diff_torch.py).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "reshard/error.h"
#include "reshard/state_dict.h"

namespace reshard {
namespace {

std::string temp_dir() {
  std::string t = (std::filesystem::temp_directory_path() / "reshard_sd_XXXXXX").string();
  if (!mkdtemp(t.data())) throw std::runtime_error("mkdtemp failed");
  return t;
}

// A safetensors file: 8-byte little-endian header size, the JSON header, the data.
void write_safetensors(const std::string& path, const std::string& header, const std::string& data) {
  std::ofstream f(path, std::ios::binary);
  uint64_t n = header.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = (unsigned char)(n >> (8 * i));
  f.write(reinterpret_cast<const char*>(len), 8);
  f << header << data;
}

TEST(StateDict, ReadsASafetensorsFileByItsHeader) {
  const std::string dir = temp_dir();
  const float w[6] = {1, 2, 3, 4, 5, -6.5f};
  const uint16_t b[2] = {0x3f80, 0xc000};  // bf16 1.0, -2.0
  std::string data(reinterpret_cast<const char*>(w), sizeof w);
  data.append(reinterpret_cast<const char*>(b), sizeof b);
  write_safetensors(dir + "/m.safetensors",
                    R"({"a.weight":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
                    R"("a.bias":{"dtype":"BF16","shape":[2],"data_offsets":[24,28]}})",
                    data);
  ASSERT_TRUE(is_state_dict_file(dir + "/m.safetensors"));
  const StateDict sd = read_state_dict(dir + "/m.safetensors");
  ASSERT_EQ(sd.tensors.size(), 2u);
  const StateDictTensor& t = sd.tensors.at("a.weight");
  EXPECT_EQ(t.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(t.dtype, DType::F32);
  EXPECT_EQ(t.numel, 6);
  ASSERT_EQ(t.data.size(), sizeof w);
  EXPECT_EQ(std::memcmp(t.data.data(), w, sizeof w), 0);
  const StateDictTensor& bias = sd.tensors.at("a.bias");
  EXPECT_EQ(bias.dtype, DType::BF16);
  ASSERT_EQ(bias.data.size(), 4u);
  EXPECT_EQ(std::memcmp(bias.data.data(), b, 4), 0);
  EXPECT_FALSE(sd.all_f32);
  std::filesystem::remove_all(dir);
}

TEST(StateDict, BadFilesAreNamedErrors) {
  const std::string dir = temp_dir();
  auto code_of = [](const std::string& p, std::string* msg) {
    try {
      read_state_dict(p);
    } catch (const Error& e) {
      *msg = e.what();
      return e.code();
    }
    return ErrorCode::kInternal;
  };
  std::string msg;
  // Not a state-dict file: a folder, a missing file, another suffix.
  EXPECT_EQ(code_of(dir, &msg), ErrorCode::kInvalidArgument);
  EXPECT_NE(msg.find("is not a state-dict file"), std::string::npos) << msg;
  EXPECT_EQ(code_of(dir + "/none.safetensors", &msg), ErrorCode::kInvalidArgument);
  std::ofstream(dir + "/x.txt") << "hello";
  EXPECT_FALSE(is_state_dict_file(dir + "/x.txt"));
  EXPECT_EQ(code_of(dir + "/x.txt", &msg), ErrorCode::kInvalidArgument);
  EXPECT_NE(msg.find(dir + "/x.txt"), std::string::npos) << msg;
  // A header that describes more data than the file holds.
  write_safetensors(dir + "/short.safetensors", R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
                    std::string(8, '\0'));
  EXPECT_EQ(code_of(dir + "/short.safetensors", &msg), ErrorCode::kDataLoss);
  EXPECT_NE(msg.find("short.safetensors"), std::string::npos) << msg;
  // No tensors at all.
  write_safetensors(dir + "/empty.safetensors", "{}", "");
  EXPECT_EQ(code_of(dir + "/empty.safetensors", &msg), ErrorCode::kInvalidArgument);
  EXPECT_NE(msg.find("holds no tensors"), std::string::npos) << msg;
  // A torch.save name that is not a zip archive.
  std::ofstream(dir + "/bad.pt") << "not a zip";
  EXPECT_NE(code_of(dir + "/bad.pt", &msg), ErrorCode::kInternal) << "no Error raised";
  EXPECT_NE(msg.find("bad.pt"), std::string::npos) << msg;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace reshard
