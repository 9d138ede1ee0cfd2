// Throughput of loads into CUDA buffers, with the same-run ceilings. Driven by
// benchmarks/gpu_bench.py (which adds DCP's load into CUDA tensors) from benchmarks/gpu_check.sh.
//
//   gpu_load synth ROOT --hidden H --ffn F --layers L --heads N --groups G --vocab V --topo T [--seed S]
//   gpu_load run ROOT --target T [--repeats N] [--threads K] [--sources pread,mmap] [--cold] [--json OUT]
//
// `run` measures, in this order: (1) the page-cache read ceiling: 16 threads of pread in 64 MiB
// requests into one pinned buffer as large as the checkpoint's data files; (2) the pinned
// host-to-device ceiling: one cudaMemcpy of that buffer; (3) reshard's load_to_cuda of the target
// layout into cudaMalloc'd buffers, warm, for each source mode, `repeats` times; (4) with --cold,
// after dropping the page cache: the read ceiling again, then reshard's load (pread).
// GB = 1e9 bytes. Everything it prints last is also in the JSON.
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>

#include "io/file.h"
#include "reshard/cuda.h"
#include "reshard/error.h"
#include "reshard/native.h"
#include "reshard/reshard.h"

using namespace reshard;
using Clock = std::chrono::steady_clock;
static double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

#define CK(call)                                                                                  \
  do {                                                                                            \
    cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s failed: %s: %s\n", #call, cudaGetErrorName(e_), cudaGetErrorString(e_)); \
      std::exit(3);                                                                               \
    }                                                                                             \
  } while (0)

namespace {

std::map<std::string, std::string> parse(int argc, char** argv, int from) {
  std::map<std::string, std::string> a;
  for (int i = from; i < argc; ++i) {
    std::string k = argv[i];
    if (k.rfind("--", 0) != 0) continue;
    if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) a[k.substr(2)] = argv[++i];
    else a[k.substr(2)] = "1";
  }
  return a;
}
std::string get(const std::map<std::string, std::string>& a, const std::string& k, const std::string& d) {
  auto it = a.find(k);
  return it == a.end() ? d : it->second;
}

bool drop_caches() {
  ::sync();
  FILE* f = std::fopen("/proc/sys/vm/drop_caches", "w");
  if (!f) return false;
  bool ok = std::fputs("3\n", f) >= 0;
  ok = (std::fclose(f) == 0) && ok;
  return ok;
}

// 16 threads of pread in `req`-byte requests, files laid end to end into `dst`.
double read_ceiling(const std::vector<std::string>& files, const std::vector<uint64_t>& sizes, uint8_t* dst, int threads,
                    uint64_t req) {
  struct Item {
    int fd;
    uint64_t off, len, at;
  };
  std::vector<int> fds;
  std::vector<Item> items;
  uint64_t at = 0;
  for (size_t f = 0; f < files.size(); ++f) {
    int fd = ::open(files[f].c_str(), O_RDONLY);
    if (fd < 0) {
      std::perror(files[f].c_str());
      std::exit(3);
    }
    fds.push_back(fd);
    for (uint64_t o = 0; o < sizes[f]; o += req) items.push_back({fd, o, std::min(req, sizes[f] - o), at + o});
    at += sizes[f];
  }
  std::atomic<size_t> next{0};
  auto t0 = Clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      for (size_t k; (k = next.fetch_add(1)) < items.size();) {
        const Item& it = items[k];
        uint64_t done = 0;
        while (done < it.len) {
          ssize_t n = ::pread(it.fd, dst + it.at + done, it.len - done, off_t(it.off + done));
          if (n <= 0) {
            std::perror("pread");
            std::exit(3);
          }
          done += uint64_t(n);
        }
      }
    });
  for (auto& th : pool) th.join();
  double s = since(t0);
  for (int fd : fds) ::close(fd);
  return s;
}

int cmd_synth(const std::string& root, const std::map<std::string, std::string>& a) {
  ModelConfig m;
  m.name = get(a, "name", "bench-gpt");
  m.hidden = std::stoi(get(a, "hidden", "2048"));
  m.ffn = std::stoi(get(a, "ffn", "5632"));
  m.num_layers = std::stoi(get(a, "layers", "10"));
  m.heads = std::stoi(get(a, "heads", "16"));
  m.query_groups = std::stoi(get(a, "groups", "16"));
  m.vocab = std::stoll(get(a, "vocab", "32000"));
  m.vocab_divisible_by = 128;
  m.swiglu = true;
  m.bias = false;
  m.norm = "rmsnorm";
  m.param_dtype = DType::BF16;
  const Topology topo = Topology::parse(get(a, "topo", "tp=2,pp=2,dp=2,zero=1"));
  auto t0 = Clock::now();
  synth_checkpoint(root, m, topo, std::stoull(get(a, "seed", "1")));
  auto ck = open_checkpoint(root);
  uint64_t bytes = 0;
  for (size_t f = 0; f < ck->source().files.size(); ++f) bytes += ck->file_size(int32_t(f));
  std::printf("synth: %s at %s: %.2f GB in %zu files, %.1f s\n", m.name.c_str(), topo.to_string().c_str(), bytes / 1e9,
              ck->source().files.size(), since(t0));
  return 0;
}

int cmd_run(const std::string& root, const std::map<std::string, std::string>& a) {
  const int repeats = std::stoi(get(a, "repeats", "3"));
  const int threads = std::stoi(get(a, "threads", "16"));
  const std::string sources = get(a, "sources", "pread,mmap");
  const bool cold = a.count("cold") > 0;
  nlohmann::json J;
  auto ck = open_checkpoint(root);
  const Layout target = derive_layout(ck->source().layout.model, Topology::parse(get(a, "target", "tp=1,dp=1,zero=1")));
  std::vector<std::string> files = ck->source().files;
  std::vector<uint64_t> sizes;
  uint64_t file_bytes = 0;
  for (size_t f = 0; f < files.size(); ++f) sizes.push_back(ck->file_size(int32_t(f))), file_bytes += sizes.back();
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  CK(cudaSetDevice(0));
  J["device"] = prop.name;
  J["checkpoint"] = root;
  J["checkpoint_bytes"] = file_bytes;
  J["source_layout"] = ck->source().layout.topo.to_string();
  J["target_layout"] = target.topo.to_string();
  std::printf("checkpoint %s: %.2f GB in %zu files, %s -> %s, device %s\n", root.c_str(), file_bytes / 1e9, files.size(),
              J["source_layout"].get<std::string>().c_str(), J["target_layout"].get<std::string>().c_str(), prop.name);

  // Warm the page cache (and measure once more after).
  {
    uint8_t* pinned = nullptr;
    auto ta = Clock::now();
    CK(cudaHostAlloc(reinterpret_cast<void**>(&pinned), file_bytes, cudaHostAllocDefault));
    J["pinned_alloc_seconds"] = since(ta);
    read_ceiling(files, sizes, pinned, threads, uint64_t(64) << 20);  // warm-up
    double best = 1e30;
    for (int i = 0; i < 2; ++i) best = std::min(best, read_ceiling(files, sizes, pinned, threads, uint64_t(64) << 20));
    J["ceiling_pagecache_read_seconds"] = best;
    J["ceiling_pagecache_read_gbps"] = file_bytes / best / 1e9;
    double one = read_ceiling(files, sizes, pinned, 1, uint64_t(64) << 20);
    J["pagecache_read_1thread_gbps"] = file_bytes / one / 1e9;
    void* dev = nullptr;
    CK(cudaMalloc(&dev, file_bytes));
    CK(cudaMemcpy(dev, pinned, std::min<uint64_t>(file_bytes, 1 << 30), cudaMemcpyHostToDevice));  // warm-up
    double h2d = 1e30;
    for (int i = 0; i < 2; ++i) {
      auto t0 = Clock::now();
      CK(cudaMemcpy(dev, pinned, file_bytes, cudaMemcpyHostToDevice));
      h2d = std::min(h2d, since(t0));
    }
    J["ceiling_pinned_h2d_seconds"] = h2d;
    J["ceiling_pinned_h2d_gbps"] = file_bytes / h2d / 1e9;
    CK(cudaFree(dev));
    CK(cudaFreeHost(pinned));
  }

  // Target buffers on the device.
  std::vector<void*> bufs(target.buffers.size(), nullptr);
  uint64_t target_bytes = 0;
  for (size_t i = 0; i < target.buffers.size(); ++i) {
    const uint64_t b = uint64_t(target.buffers[i].numel) * dtype_size(target.buffers[i].dtype);
    CK(cudaMalloc(&bufs[i], std::max<uint64_t>(b, 1)));
    target_bytes += b;
  }
  J["target_bytes"] = target_bytes;
  auto comm = make_local_communicator();
  nlohmann::json runs = nlohmann::json::array();
  auto one_load = [&](const std::string& src, const std::string& label) {
    CudaLoadOptions co;
    co.io_threads = threads;
    co.source = src;
    CudaLoadStats cs;
    LoadReport r = load_to_cuda(*ck, target, bufs, *comm, {}, co, &cs);
    nlohmann::json j;
    j["label"] = label;
    j["source"] = cs.source;
    j["path"] = cs.path;
    j["seconds"] = r.seconds;
    j["gbps"] = r.gbps;
    j["target_bytes"] = r.target_bytes;
    j["bytes_read"] = r.bytes_read;
    j["plan_seconds"] = r.plan_seconds;
    j["setup_seconds"] = cs.setup_seconds;
    j["copy_seconds"] = cs.copy_seconds;
    j["h2d_bytes"] = cs.h2d_bytes;
    j["gpu_converted_bytes"] = cs.gpu_converted_bytes;
    j["chunks"] = cs.chunks;
    j["registered_bytes"] = cs.registered_bytes;
    j["checksums_verified"] = r.checksums_verified;
    std::printf("  %-14s %-5s %6.2f GB in %6.3f s = %6.2f GB/s (plan %.3f s, setup %.3f s, copy %.3f s, %llu chunks)\n",
                label.c_str(), cs.source.c_str(), r.target_bytes / 1e9, r.seconds, r.gbps, r.plan_seconds,
                cs.setup_seconds, cs.copy_seconds, (unsigned long long)cs.chunks);
    std::fflush(stdout);
    runs.push_back(j);
    return r.gbps;
  };
  std::map<std::string, double> best;
  for (size_t p = 0; p < sources.size();) {
    size_t q = sources.find(',', p);
    if (q == std::string::npos) q = sources.size();
    const std::string src = sources.substr(p, q - p);
    p = q + 1;
    for (int i = 0; i < repeats; ++i) {
      double g = one_load(src, i == 0 ? "warm-first" : "warm");
      best[src] = std::max(best[src], g);
    }
  }
  for (auto& [k, v] : best) J["reshard_warm_best_gbps_" + k] = v;
  if (cold) {
    uint8_t* pinned = nullptr;
    CK(cudaHostAlloc(reinterpret_cast<void**>(&pinned), file_bytes, cudaHostAllocDefault));
    if (drop_caches()) {
      double s = read_ceiling(files, sizes, pinned, threads, uint64_t(64) << 20);
      J["ceiling_cold_read_gbps"] = file_bytes / s / 1e9;
      CK(cudaFreeHost(pinned));
      pinned = nullptr;
      drop_caches();
      J["reshard_cold_gbps"] = one_load("pread", "cold");
      // Checkpoint bytes over time, as the ceiling counts them.
      J["reshard_cold_file_gbps"] = file_bytes / runs.back()["seconds"].get<double>() / 1e9;
    } else {
      J["cold_error"] = "cannot write /proc/sys/vm/drop_caches";
      std::printf("cold runs skipped: cannot write /proc/sys/vm/drop_caches\n");
    }
    if (pinned) CK(cudaFreeHost(pinned));
  }
  J["runs"] = runs;
  for (void* b : bufs) cudaFree(b);
  cuda_release_staging();
  const std::string out = get(a, "json", "");
  if (!out.empty()) std::ofstream(out) << J.dump(2) << "\n";
  std::printf("\n%-34s %10s\n", "gpu_load (GB = 1e9 B)", "GB/s");
  for (const char* k : {"ceiling_pagecache_read_gbps", "pagecache_read_1thread_gbps", "ceiling_pinned_h2d_gbps",
                        "reshard_warm_best_gbps_pread", "reshard_warm_best_gbps_mmap", "ceiling_cold_read_gbps",
                        "reshard_cold_gbps", "reshard_cold_file_gbps"})
    if (J.contains(k)) std::printf("%-34s %10.2f\n", k, J[k].get<double>());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: gpu_load synth ROOT [--hidden ...] | gpu_load run ROOT [--target T] ...\n");
    return 2;
  }
  try {
    const std::string cmd = argv[1], root = argv[2];
    auto a = parse(argc, argv, 3);
    if (cmd == "synth") return cmd_synth(root, a);
    if (cmd == "run") return cmd_run(root, a);
    std::fprintf(stderr, "unknown command %s\n", cmd.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_load: %s\n", e.what());
    return 1;
  }
}
