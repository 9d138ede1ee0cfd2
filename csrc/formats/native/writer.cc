// Native checkpoint writer: the atomic save protocol of docs/format.md.
#include <unistd.h>
#include <xxhash.h>
#if RESHARD_HAVE_XXH_DISPATCH
// libxxhash's run-time dispatch picks the widest vector unit the CPU has (AVX2/AVX-512 instead of
// the SSE2 code a plain x86-64 build gets); same hash values.
#include <xxh_x86dispatch.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <sstream>

#include "comm/agree.h"
#include "formats/native/layout_json.h"
#include "formats/native/native_internal.h"
#include "formats/safetensors/safetensors.h"
#include "io/file.h"
#include "reshard/error.h"
#include "reshard/native.h"

namespace reshard {
namespace native {

// A step name is a folder name that `latest` can hold on one line and readers find again as
// written: printable ASCII without spaces (a trailing space or newline was saved, then not found
// when `latest` was read back trimmed).
void check_step_name(const std::string& step) {
  const bool plain = std::all_of(step.begin(), step.end(), [](char c) { return c > ' ' && c < 127; });
  if (step.empty() || !plain || step == "." || step == ".." || step == kLatestFile || step[0] == '.' ||
      step.find('/') != std::string::npos || step.size() > 200) {
    fail(ErrorCode::kInvalidArgument, "step name '", step,
         "' is not allowed: use a plain folder name of printable characters (no spaces or control characters, "
         "no '/', not starting with '.', not 'latest')");
  }
}


std::string quoted_cut(const std::string& v) {
  return "'" + v.substr(0, 40) + "'" + (v.size() > 40 ? " (" + std::to_string(v.size()) + " bytes, cut)" : std::string());
}

std::string xxh3_hex(const void* data, size_t bytes) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)XXH3_64bits(data, bytes));
  return buf;
}

std::string make_nonce() {
  std::random_device rd;
  uint64_t x = (uint64_t(rd()) << 32) ^ rd();
  x ^= uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()) * 0x9e3779b97f4a7c15ull;
  x ^= uint64_t(::getpid()) << 17;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)x);
  return buf;
}

std::vector<std::vector<int>> pieces_by_buffer(const Layout& L) {
  std::vector<std::vector<int>> out(L.buffers.size());
  for (size_t i = 0; i < L.pieces.size(); ++i) out[L.pieces[i].buffer].push_back(int(i));
  return out;
}

RankFileResult write_rank_file(const std::string& dir, const Layout& L, int rank, const std::string& save,
                               const std::string& layout_digest,
                               const std::vector<std::vector<int>>& by_buffer,
                               const std::function<const void*(int buffer)>& ptr) {
  std::vector<int> mine;
  for (size_t b = 0; b < L.buffers.size(); ++b)
    if (L.buffers[b].rank == rank) mine.push_back(int(b));
  // Decreasing element size keeps every tensor aligned to its element size (as the reference
  // safetensors writer does), since the data starts at a multiple of 8.
  std::stable_sort(mine.begin(), mine.end(), [&](int a, int b) {
    return dtype_size(L.buffers[a].dtype) > dtype_size(L.buffers[b].dtype);
  });
  std::vector<safetensors::TensorToWrite> tensors;
  for (int b : mine) tensors.push_back({L.buffers[b].name, L.buffers[b].dtype, {L.buffers[b].numel}});
  std::vector<std::pair<uint64_t, uint64_t>> offsets;
  const std::string header = safetensors::build_header(
      tensors, {{"format", "reshard"}, {"rank", std::to_string(rank)}, {"save", save}, {"layout", layout_digest}},
      &offsets);

  RankFileResult res;
  const std::string path = io::join(dir, rank_file_name(rank));
  io::File f = io::File::create(path);
  // Window-aligned writes (io::WindowedWriter): a warm load maps the file in 2 MiB folios.
  io::WindowedWriter out(f);
  out.append(header.data(), header.size());
  for (size_t k = 0; k < mine.size(); ++k) {
    const int b = mine[k];
    const Buffer& buf = L.buffers[b];
    const uint64_t bytes = offsets[k].second - offsets[k].first;
    const char* src = static_cast<const char*>(ptr(b));
    if (bytes > 0 && !src)
      fail(ErrorCode::kInvalidArgument, "buffer ", buf.name, " of rank ", rank, " has no data (null pointer)");
    RESHARD_CHECK(out.position() == header.size() + offsets[k].first, "tensors are written in file order");
    out.append(src, bytes);
    const size_t es = dtype_size(buf.dtype);
    for (int p : by_buffer[b]) {
      const Piece& pc = L.pieces[p];
      res.checksums.push_back({p, xxh3_hex(src + uint64_t(pc.base) * es, uint64_t(piece_span(pc)) * es)});
    }
  }
  out.finish();
  res.bytes = header.size() + (offsets.empty() ? 0 : offsets.back().second);
  f.fsync();
  f.close();
  return res;
}

namespace {

std::string build_metadata(const std::string& step, const std::string& save, const Layout& L, const NonTensorState& state,
                           const std::vector<std::string>& checksums, const std::vector<uint64_t>& file_bytes) {
  std::vector<std::string> buffer_files;
  for (const auto& b : L.buffers) buffer_files.push_back(rank_file_name(b.rank));
  json meta = {{"format", kFormatName}, {"format_version", kNativeFormatVersion}, {"writer", "reshard native writer"},
               {"step", step}, {"save", save}};
  json lj = layout_to_json(L, buffer_files, checksums);
  for (auto it = lj.begin(); it != lj.end(); ++it) meta[it.key()] = it.value();
  meta["checksum"] = "xxh3-64";
  meta["state"] = state_to_json(state);
  json files = json::array();
  for (size_t r = 0; r < file_bytes.size(); ++r) files.push_back({{"name", rank_file_name(int(r))}, {"bytes", file_bytes[r]}});
  meta["files"] = files;
  return meta.dump(1) + "\n";
}

// How long a save waits for another writer of the same root (RESHARD_LOCK_TIMEOUT_S, seconds;
// default 600).
double lock_timeout_s() {
  const char* v = std::getenv("RESHARD_LOCK_TIMEOUT_S");
  if (!v || !*v) return 600.0;
  char* end = nullptr;
  const double t = std::strtod(v, &end);
  if (end == v || *end != '\0' || !(t >= 0) || t > 1e7)
    fail(ErrorCode::kInvalidArgument, "RESHARD_LOCK_TIMEOUT_S='", v, "' must be a number of seconds in [0, 1e7]");
  return t;
}

// A save told not to replace a step finds it there once it holds the root's lock: another
// writer saved it after the caller's own check (convert without --overwrite).
void refuse_existing_step(const std::string& root, const std::string& step, const std::string& what) {
  const std::string dir = io::join(root, step);
  if (io::exists(dir))
    fail(ErrorCode::kFailedPrecondition, what, ": ", dir, " was saved by another writer while this one ran, and this "
         "save does not replace a step (convert: pass --overwrite, or choose another --step). Nothing was written");
}

// ".tmp-<step>-<16 hex>", ".old-<step>-<16 hex>" or ".latest-<16 hex>" of any save, or the
// ".reshard-fscheck-<16 hex>-<rank>" token of a collective save killed before it removed it.
bool is_any_leftover(const std::string& name) {
  const std::string token = ".reshard-fscheck-";
  if (name.rfind(token, 0) == 0) {
    const size_t dash = token.size() + 16;
    if (name.size() <= dash + 1 || name[dash] != '-') return false;
    for (size_t i = token.size(); i < dash; ++i)
      if (!std::isxdigit(static_cast<unsigned char>(name[i]))) return false;
    for (size_t i = dash + 1; i < name.size(); ++i)
      if (!std::isdigit(static_cast<unsigned char>(name[i]))) return false;
    return true;
  }
  const bool kind = name.rfind(".tmp-", 0) == 0 || name.rfind(".old-", 0) == 0 || name.rfind(".latest-", 0) == 0;
  if (!kind || name.size() < 17 + 5 || name[name.size() - 17] != '-') return false;
  for (size_t i = name.size() - 16; i < name.size(); ++i)
    if (!std::isxdigit(static_cast<unsigned char>(name[i]))) return false;
  return true;
}

/// Rank 0's part after every data file is written and fsynced: metadata, the step folder
/// renamed (or exchanged) in, then `latest`. Anything that can fail without changing ROOT runs
/// before the step goes in: the new `latest` is written to its temporary name first (a full disk
/// fails there), and a `latest` that is a folder is refused. When replacing `latest` still fails
/// (a file made immutable, a filesystem gone read-only), the step rename is undone, so a failed
/// save leaves ROOT as it was: the old step and the old `latest`.
void commit_step(const std::string& root, const std::string& step, const std::string& tmpdir,
                 const std::string& nonce, const std::string& metadata) {
  io::write_text(io::join(tmpdir, kMetadataFile), metadata);
  io::fsync_dir(tmpdir);
  const std::string final_dir = io::join(root, step);
  const std::string latest = io::join(root, kLatestFile);
  if (io::is_dir(latest))
    fail(ErrorCode::kFailedPrecondition, "save: ", latest, " is a folder; the save replaces `latest` with a file naming "
         "the new step. Nothing was saved: remove it or save elsewhere");
  const std::string tmp_latest = io::join(root, ".latest-" + nonce);
  io::write_text(tmp_latest, step + "\n");
  enum class How { kFresh, kExchanged, kAside } how = How::kFresh;
  const std::string aside = io::join(root, ".old-" + step + "-" + nonce);
  try {
    if (io::exists(final_dir)) {
      // Swap the new folder in atomically; the old one ends up at tmpdir and is removed once
      // `latest` is in.
      if (io::exchange_paths(tmpdir, final_dir)) {
        how = How::kExchanged;
      } else {  // no RENAME_EXCHANGE on this filesystem: a short window without ROOT/<step>
        io::rename_path(final_dir, aside);
        how = How::kAside;
        io::rename_path(tmpdir, final_dir);
      }
    } else {
      io::rename_path(tmpdir, final_dir);
    }
    io::fsync_dir(root);
    io::rename_path(tmp_latest, latest);
  } catch (...) {
    // Undo what went in; the caller removes tmpdir (the new data again, after the undo).
    try {
      switch (how) {
        case How::kFresh:
          if (!io::exists(tmpdir)) io::rename_path(final_dir, tmpdir);
          break;
        case How::kExchanged:
          io::exchange_paths(tmpdir, final_dir);
          break;
        case How::kAside:
          if (!io::exists(tmpdir)) io::rename_path(final_dir, tmpdir);
          io::rename_path(aside, final_dir);
          break;
      }
      io::fsync_dir(root);
    } catch (...) {
    }
    try {
      io::remove_all(tmp_latest);
    } catch (...) {
    }
    throw;
  }
  io::fsync_dir(root);
  if (how == How::kExchanged) io::remove_all(tmpdir);
  if (how == How::kAside) io::remove_all(aside);
  // Leftovers of earlier crashed saves (any step): each can be as large as a checkpoint. Saves
  // into one root hold its lock (FolderLock), so whatever is left now is dead.
  for (const auto& n : io::list_dir(root)) {
    if (is_any_leftover(n)) {
      try {
        io::remove_all(io::join(root, n));
      } catch (const Error&) {
      }
    }
  }
}

/// Collective: raises on every rank when any rank reports an error ("" = fine).
void agree(Communicator& comm, const std::string& err, const std::string& what) {
  agree_on_errors(comm, err, what, /*keep_code=*/false);
}

std::string ranges_text(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(ranks[i]);
    if (j > i) out += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

}  // namespace

void save_all_ranks_with(const std::string& root, const std::string& step, const Layout& L, const NonTensorState& state,
                         const std::function<std::vector<const void*>(int rank)>& provide, bool replace_step) {
  check_step_name(step);
  io::make_dirs(root);
  const std::string what = "saving step " + step + " to " + root;
  io::FolderLock lock(root, what, lock_timeout_s());
  if (!replace_step) refuse_existing_step(root, step, what);
  const std::string nonce = make_nonce();
  const std::string digest = layout_digest(L);
  const std::string tmpdir = io::join(root, ".tmp-" + step + "-" + nonce);
  io::make_dirs(tmpdir);
  try {
    const auto by_buffer = pieces_by_buffer(L);
    const int world = L.topo.world_size();
    std::vector<std::string> checksums(L.pieces.size());
    std::vector<uint64_t> bytes(world);
    for (int r = 0; r < world; ++r) {
      std::vector<const void*> ptrs = provide(r);
      if (ptrs.size() != L.buffers.size())
        fail(ErrorCode::kInvalidArgument, "save: ", ptrs.size(), " buffer pointers for a layout of ", L.buffers.size(),
             " buffers");
      RankFileResult res = write_rank_file(tmpdir, L, r, nonce, digest, by_buffer, [&](int b) { return ptrs[b]; });
      bytes[r] = res.bytes;
      for (auto& [p, h] : res.checksums) checksums[p] = std::move(h);
    }
    commit_step(root, step, tmpdir, nonce, build_metadata(step, nonce, L, state, checksums, bytes));
  } catch (...) {
    try {
      io::remove_all(tmpdir);
    } catch (...) {
    }
    throw;
  }
}

}  // namespace native

std::string fs_check_failures(const std::vector<std::vector<bool>>& seen, const std::string& root) {
  const int n = int(seen.size());
  // Group observers by the set of ranks they cannot see.
  std::vector<std::pair<std::vector<int>, std::vector<int>>> groups;  // (missing, observers)
  for (int r = 0; r < n; ++r) {
    std::vector<int> missing;
    for (int q = 0; q < n; ++q)
      if (q >= int(seen[r].size()) || !seen[r][q]) missing.push_back(q);
    if (missing.empty()) continue;
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == missing; });
    if (it == groups.end()) groups.push_back({missing, {r}});
    else it->second.push_back(r);
  }
  if (groups.empty()) return {};
  std::string msg = "ranks see different filesystems at " + root + ": ";
  for (size_t i = 0; i < groups.size(); ++i) {
    if (i == 8) {
      msg += "; and " + std::to_string(groups.size() - 8) + " more";
      break;
    }
    const auto& [missing, obs] = groups[i];
    msg += (i ? "; " : "") + std::string(obs.size() == 1 ? "rank " : "ranks ") + native::ranges_text(obs) +
           " cannot see the files of " + (missing.size() == 1 ? "rank " : "ranks ") + native::ranges_text(missing);
  }
  msg += "; a multi-node save onto node-local disks would lose shards";
  return msg;
}

void save_native(const std::string& root, const std::string& step, const Layout& L,
                 const std::vector<const void*>& buffers, const NonTensorState& state, Communicator& comm,
                 bool replace_step) {
  using namespace native;
  check_step_name(step);
  const int rank = comm.rank(), world = comm.size();
  if (world != L.topo.world_size())
    fail(ErrorCode::kInvalidArgument, "save_native: the communicator has ", world, " ranks but the layout (",
         L.topo.to_string(), ") has ", L.topo.world_size());
  if (buffers.size() != L.buffers.size())
    fail(ErrorCode::kInvalidArgument, "save_native: ", buffers.size(), " buffer pointers for a layout of ",
         L.buffers.size(), " buffers");
  const std::string what = "saving step " + step + " to " + root;

  std::optional<io::FolderLock> lock;
  agree(comm, try_local([&] {
          for (size_t b = 0; b < L.buffers.size(); ++b)
            if (L.buffers[b].rank == rank && L.buffers[b].numel > 0 && !buffers[b])
              fail(ErrorCode::kInvalidArgument, "buffer ", L.buffers[b].name, " of rank ", rank, " is null");
          io::make_dirs(root);
          // Rank 0 holds the root's lock from here to the commit: another save or convert into
          // the same root waits (its leftovers sweep would delete this save's temporaries).
          if (rank == 0) {
            lock.emplace(root, what, lock_timeout_s());
            if (!replace_step) refuse_existing_step(root, step, what);
          }
        }),
        what);
  const std::string nonce = comm.all_gather_strings(rank == 0 ? make_nonce() : std::string()).at(0);
  // Every rank saves the same layout: rank 0 writes metadata.json from its own, and each rank
  // records its layout's digest in its file, so ranks that disagree would write a step that no
  // open accepts. Refused here, on every rank, while the job can still save again.
  std::string digest;
  agree(comm, try_local([&] { digest = layout_digest(L); }), what);
  {
    const std::vector<std::string> all = comm.all_gather_strings(digest);
    std::string differ;
    int n = 0;
    for (int r = 1; r < world; ++r)
      if (all[size_t(r)] != all[0] && n++ < 4) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
    if (n > 0)
      fail(ErrorCode::kInvalidArgument, what, ": the ranks were given different layouts to save (rank(s) ", differ,
           n > 4 ? ", ..." : "", " differ from rank 0: layout digest ", all[0], " on rank 0); every rank must pass the "
           "same layout (derive_layout / build_layout with the same model, topology and options)");
  }

  // (1) Same filesystem: every rank must see every rank's token.
  auto token = [&](int r) { return io::join(root, ".reshard-fscheck-" + nonce + "-" + std::to_string(r)); };
  agree(comm, try_local([&] { io::write_text(token(rank), std::to_string(rank) + "\n"); }), what);
  std::string row(size_t(world), '0');
  for (int q = 0; q < world; ++q) row[q] = io::exists(token(q)) ? '1' : '0';
  std::vector<std::string> rows = comm.all_gather_strings(row);  // every rank has checked now
  try {
    io::remove_all(token(rank));
  } catch (const Error&) {
  }
  std::vector<std::vector<bool>> seen(world, std::vector<bool>(world, false));
  for (int r = 0; r < world; ++r)
    for (int q = 0; q < world && q < int(rows[r].size()); ++q) seen[r][q] = rows[r][q] == '1';
  std::string fs_err = fs_check_failures(seen, root);
  if (!fs_err.empty()) fail(ErrorCode::kFailedPrecondition, fs_err);

  // (2) Data files into the temporary folder.
  const std::string tmpdir = io::join(root, ".tmp-" + step + "-" + nonce);
  auto cleanup = [&] {
    if (rank == 0) {
      try {
        io::remove_all(tmpdir);
      } catch (...) {
      }
    }
  };
  agree(comm, rank == 0 ? try_local([&] { io::make_dirs(tmpdir); }) : std::string(), what);
  const auto by_buffer = pieces_by_buffer(L);
  RankFileResult mine;
  std::string err = try_local([&] {
    mine = write_rank_file(tmpdir, L, rank, nonce, digest, by_buffer, [&](int b) { return buffers[b]; });
  });
  std::ostringstream report;
  if (err.empty()) {
    report << "ok " << mine.bytes;
    for (const auto& [p, h] : mine.checksums) report << ' ' << p << ':' << h;
  }
  std::vector<std::string> reports = comm.all_gather_strings(err.empty() ? report.str() : "err " + err);
  std::string errors;
  for (int r = 0; r < world; ++r) {
    if (reports[r].compare(0, 4, "err ") == 0) {
      std::string e = reports[r].substr(4);
      errors += (errors.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + ": " + e.substr(e.find('|') + 1);
    }
  }
  if (!errors.empty()) {
    cleanup();
    comm.barrier();
    fail(ErrorCode::kFailedPrecondition, what, ": ", errors);
  }

  // (3) Rank 0 commits.
  std::string commit_err;
  if (rank == 0) {
    commit_err = try_local([&] {
      std::vector<std::string> checksums(L.pieces.size());
      std::vector<uint64_t> bytes(world);
      for (int r = 0; r < world; ++r) {
        std::istringstream in(reports[r]);
        std::string ok, item;
        in >> ok >> bytes[r];
        while (in >> item) {
          auto colon = item.find(':');
          size_t p = std::stoul(item.substr(0, colon));
          RESHARD_CHECK(p < checksums.size(), "piece index from rank ", r);
          checksums[p] = item.substr(colon + 1);
        }
      }
      commit_step(root, step, tmpdir, nonce, build_metadata(step, nonce, L, state, checksums, bytes));
    });
    if (!commit_err.empty()) cleanup();
  }
  agree(comm, commit_err, what);
}

void save_native_all_ranks(const std::string& root, const std::string& step, const Layout& layout,
                           const std::vector<const void*>& buffers, const NonTensorState& state, bool replace_step) {
  if (buffers.size() != layout.buffers.size())
    fail(ErrorCode::kInvalidArgument, "save_native_all_ranks: ", buffers.size(), " buffer pointers for a layout of ",
         layout.buffers.size(), " buffers");
  native::save_all_ranks_with(root, step, layout, state, [&](int) { return buffers; }, replace_step);
}

}  // namespace reshard
