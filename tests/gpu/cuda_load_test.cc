// Loading into CUDA buffers: synth a checkpoint at one layout, load it at another into device
// memory (direct path with pread and with the registered mmap, host path), copy back and compare
// bitwise with the CPU load of the same plan. Built by cmake/nccl.cmake; run on a GPU machine.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>

#include "io/file.h"
#include "reshard/cuda.h"
#include "reshard/error.h"
#include "reshard/native.h"
#include "reshard/reshard.h"
#include "unit/test_util.h"

namespace reshard {
namespace {

ModelConfig model(int hidden, int ffn, int layers, int64_t vocab) {
  ModelConfig m;
  m.name = "gpu-test";
  m.num_layers = layers;
  m.hidden = hidden;
  m.heads = 8;
  m.query_groups = 4;
  m.ffn = ffn;
  m.vocab = vocab;
  m.vocab_divisible_by = 64;
  m.swiglu = true;
  m.param_dtype = DType::BF16;
  return m;
}

struct HostBuffers {
  std::vector<std::vector<uint8_t>> data;
  std::vector<void*> ptrs;
};

HostBuffers cpu_load(const CheckpointReader& ck, const Layout& target, LoadReport* rep) {
  HostBuffers h;
  for (const Buffer& b : target.buffers) h.data.emplace_back(uint64_t(b.numel) * dtype_size(b.dtype), uint8_t(0xCD));
  for (auto& d : h.data) h.ptrs.push_back(d.data());
  auto local = make_local_communicator();
  *rep = load(ck, target, h.ptrs, *local);
  return h;
}

class CudaLoad : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  }
  // Loads `target` from `root` on the GPU with `co` and compares with the CPU load.
  void check(const std::string& root, const Layout& target, const CudaLoadOptions& co, const std::string& want_path) {
    auto ck = open_checkpoint(root);
    LoadReport cpu_rep;
    HostBuffers cpu = cpu_load(*ck, target, &cpu_rep);
    std::vector<void*> dev(target.buffers.size(), nullptr);
    for (size_t i = 0; i < target.buffers.size(); ++i) {
      const uint64_t bytes = uint64_t(target.buffers[i].numel) * dtype_size(target.buffers[i].dtype);
      ASSERT_EQ(cudaMalloc(&dev[i], std::max<uint64_t>(bytes, 1)), cudaSuccess);
      ASSERT_EQ(cudaMemset(dev[i], 0xCD, bytes), cudaSuccess);  // poison: unwritten bytes show
    }
    auto local = make_local_communicator();
    CudaLoadStats cs;
    LoadReport rep = load_to_cuda(*ck, target, dev, *local, {}, co, &cs);
    EXPECT_EQ(cs.path, want_path);
    EXPECT_EQ(rep.target_bytes, cpu_rep.target_bytes);
    EXPECT_EQ(rep.bytes_read, cpu_rep.bytes_read);
    EXPECT_EQ(rep.change, cpu_rep.change);
    std::printf("  %s: path %s source %s, %.3f GB in %.3f s, %llu chunks, %llu H2D bytes, %llu converted, verified %llu\n",
                target.topo.to_string().c_str(), cs.path.c_str(), cs.source.c_str(), rep.target_bytes / 1e9, rep.seconds,
                (unsigned long long)cs.chunks, (unsigned long long)cs.h2d_bytes,
                (unsigned long long)cs.gpu_converted_bytes, (unsigned long long)rep.checksums_verified);
    size_t bad = 0;
    for (size_t i = 0; i < target.buffers.size(); ++i) {
      std::vector<uint8_t> back(cpu.data[i].size());
      ASSERT_EQ(cudaMemcpy(back.data(), dev[i], back.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      if (std::memcmp(back.data(), cpu.data[i].data(), back.size()) != 0) {
        size_t at = 0;
        while (back[at] == cpu.data[i][at]) ++at;
        if (bad++ < 5)
          ADD_FAILURE() << "buffer " << target.buffers[i].name << " (" << dtype_name(target.buffers[i].dtype)
                        << ") differs from the CPU load at byte " << at << " of " << back.size();
      }
      cudaFree(dev[i]);
    }
    EXPECT_EQ(bad, 0u);
  }
};

TEST_F(CudaLoad, EightToOneAllPaths) {
  const ModelConfig m = model(256, 512, 4, 1000);
  const std::string root = testing::make_temp_dir("cuda_8to1_");
  synth_checkpoint(root, m, Topology::parse("tp=2,pp=2,dp=2,zero=1"), 17);
  for (const char* t : {"tp=1,dp=1,zero=1", "tp=1,dp=1,zero=0"}) {
    SCOPED_TRACE(t);
    const Layout target = derive_layout(m, Topology::parse(t));
    CudaLoadOptions co;
    check(root, target, co, "direct");
    co.source = "mmap";
    check(root, target, co, "direct");
    co.source = "pread";
    co.force_host_path = true;
    check(root, target, co, "host");
  }
  io::remove_all(root);
}

// Small slots: fragments are cut into many chunks, small ones packed together; few threads.
TEST_F(CudaLoad, SmallChunksAndThreads) {
  const ModelConfig m = model(512, 1024, 2, 3000);
  const std::string root = testing::make_temp_dir("cuda_chunks_");
  synth_checkpoint(root, m, Topology::parse("tp=4,dp=2,zero=1"), 5);
  const Layout target = derive_layout(m, Topology::parse("tp=1,dp=1,zero=1"));
  for (int threads : {1, 3}) {
    for (const char* src : {"pread", "mmap"}) {
      CudaLoadOptions co;
      co.io_threads = threads;
      co.chunk_bytes = 1 << 20;
      co.source = src;
      check(root, target, co, "direct");
    }
  }
  cuda_release_staging();
  io::remove_all(root);
}

// ZeRO-3 source (no 16-bit copies): the bf16 weights come from the fp32 master, converted on the
// GPU; must equal the CPU's round-to-nearest-even downcast.
TEST_F(CudaLoad, WeightsFromMasterConvertOnGpu) {
  const ModelConfig m = model(256, 512, 2, 1000);
  const std::string root = testing::make_temp_dir("cuda_zero3_");
  synth_checkpoint(root, m, Topology::parse("tp=1,dp=4,zero=3"), 9);
  const Layout target = derive_layout(m, Topology::parse("tp=1,dp=1,zero=1"));
  CudaLoadOptions co;
  check(root, target, co, "direct");
  io::remove_all(root);
}

TEST_F(CudaLoad, CorruptPieceIsCaught) {
  const ModelConfig m = model(256, 512, 2, 1000);
  const std::string root = testing::make_temp_dir("cuda_corrupt_");
  synth_checkpoint(root, m, Topology::parse("tp=2,dp=1,zero=1"), 3);
  const Layout target = derive_layout(m, Topology::parse("tp=2,dp=1,zero=1"));
  // Flip one byte late in rank 0's file (inside some piece's data).
  const std::string f = io::join(root, "step-1/rank_00000.safetensors");
  {
    const uint64_t size = io::file_size(f);
    FILE* fp = std::fopen(f.c_str(), "r+b");
    ASSERT_NE(fp, nullptr);
    std::fseek(fp, long(size - 1000), SEEK_SET);
    int ch = std::fgetc(fp);
    std::fseek(fp, long(size - 1000), SEEK_SET);
    std::fputc(ch ^ 0x40, fp);
    std::fclose(fp);
  }
  auto ck = open_checkpoint(root);
  // Target of world size 2 at rank 0 only needs a 2-rank communicator; load the same layout at
  // world size 1 instead: tp=1.
  const Layout t1 = derive_layout(m, Topology::parse("tp=1,dp=1,zero=1"));
  std::vector<void*> dev(t1.buffers.size(), nullptr);
  for (size_t i = 0; i < t1.buffers.size(); ++i)
    ASSERT_EQ(cudaMalloc(&dev[i], std::max<uint64_t>(uint64_t(t1.buffers[i].numel) * dtype_size(t1.buffers[i].dtype), 1)),
              cudaSuccess);
  auto local = make_local_communicator();
  bool raised = false;
  try {
    load_to_cuda(*ck, t1, dev, *local);
  } catch (const Error& e) {
    raised = true;
    EXPECT_NE(std::string(e.what()).find("xxh3"), std::string::npos) << e.what();
  }
  // The CPU load must agree on whether the corruption is detectable under verify=free.
  bool cpu_raised = false;
  {
    LoadReport rep;
    try {
      cpu_load(*ck, t1, &rep);
    } catch (const Error&) {
      cpu_raised = true;
    }
  }
  EXPECT_EQ(raised, cpu_raised);
  for (void* p : dev) cudaFree(p);
  io::remove_all(root);
}

}  // namespace
}  // namespace reshard
