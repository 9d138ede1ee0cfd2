// Native checkpoint reader and verify_all.
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <atomic>
#include <map>
#include <mutex>
#include <thread>

#include "formats/native/layout_json.h"
#include "formats/native/native_internal.h"
#include "formats/safetensors/safetensors.h"
#include "io/file.h"
#include "io/parallel.h"
#include "reshard/checkpoint.h"
#include "reshard/error.h"
#include "reshard/native.h"

namespace reshard {
namespace native {
namespace {

std::string byte_range(uint64_t off, uint64_t len) {
  return "bytes [" + std::to_string(off) + ", " + std::to_string(off + len) + ")";
}

class NativeReader final : public CheckpointReader {
 public:
  NativeReader(const std::string& step_dir, std::vector<std::string> notes) : dir_(step_dir), notes_(std::move(notes)) {
    load();
    // Mapped through the handle reads use, which was checked against the header seen at open.
    maps_ = std::make_unique<io::MappedFileSet>(src_.files, [this](size_t i) { return handle(int32_t(i)).fd(); });
  }

  std::string writer() const override { return "native"; }
  std::string path() const override { return dir_; }
  std::string fingerprint() const override { return fingerprint_; }
  const SourceLayout& source() const override { return src_; }
  const NonTensorState& state() const override { return state_; }
  std::vector<std::string> notes() const override { return notes_; }

  void read(int32_t file, uint64_t offset, uint64_t length, void* dst) const override {
    if (file < 0 || size_t(file) >= src_.files.size())
      fail(ErrorCode::kInvalidArgument, "read: file index ", file, " out of range (", src_.files.size(), " files) in ", dir_);
    if (missing_[file]) fail(ErrorCode::kNotFound, "data file ", src_.files[file], " is missing");
    handle(file).pread(offset, length, dst);
  }

  const uint8_t* mapped(int32_t file) const override {
    if (file < 0 || size_t(file) >= src_.files.size() || missing_[file]) return nullptr;
    const io::MappedFile* m = maps_->get(size_t(file));
    return m ? m->data() : nullptr;
  }
  void drop_mapped_pages() const override { maps_->drop_all(); }

  uint64_t file_size(int32_t file) const override {
    if (file < 0 || size_t(file) >= src_.files.size())
      fail(ErrorCode::kInvalidArgument, "file_size: file index ", file, " out of range (", src_.files.size(),
           " files) in ", dir_);
    if (missing_[file]) fail(ErrorCode::kNotFound, "data file ", src_.files[file], " is missing");
    return handle(file).size();  // the pre-flight: opens (and checks) the handle reads use
  }

  bool has_checksum(int32_t file, uint64_t offset, uint64_t length) const override {
    auto it = by_range_.find({file, offset, length});
    return it != by_range_.end() && !checksums_[it->second].empty();
  }

  std::unique_ptr<RangeCheck> begin_check(int32_t file, uint64_t offset, uint64_t length) const override {
    auto it = by_range_.find({file, offset, length});
    if (it == by_range_.end() || checksums_[it->second].empty()) return nullptr;
    struct Check : RangeCheck {
      const NativeReader* r;
      int piece;
      Xxh3Stream h;
      void update(const void* data, size_t n) override { h.update(data, n); }
      std::string finish() override { return verdict(h.hex()); }
      bool is_xxh3_64() const override { return true; }  // writer.cc: XXH3 streaming state, seed 0
      std::string finish_xxh3_64(uint64_t digest) override {
        char hex[17];
        std::snprintf(hex, sizeof hex, "%016llx", (unsigned long long)digest);
        return verdict(hex);
      }
      std::string verdict(const std::string& got) const {
        const std::string& want = r->checksums_[piece];
        return got == want ? std::string() : r->describe_piece(piece) + ": xxh3 mismatch (stored " + want + ", computed " + got + ")";
      }
    };
    auto c = std::make_unique<Check>();
    c->r = this;
    c->piece = it->second;
    return c;
  }

  std::vector<ChecksumUnit> checksum_units() const override {
    std::vector<ChecksumUnit> out;
    out.reserve(by_range_.size());
    for (const auto& [key, p] : by_range_) out.push_back({std::get<0>(key), std::get<1>(key), std::get<2>(key)});
    return out;
  }

  /// "rank_00001.safetensors, buffer fp32/group0 (rank 1), piece of layers.0.x/fp32 [0:4, 0:8], bytes [a, b)".
  std::string describe_piece(int p) const {
    const Piece& pc = src_.layout.pieces[p];
    const Buffer& b = src_.layout.buffers[pc.buffer];
    const auto& loc = src_.locations[pc.buffer];
    const size_t es = dtype_size(b.dtype);
    uint64_t off = loc.byte_offset + uint64_t(pc.base) * es;
    uint64_t len = uint64_t(piece_span(pc)) * es;
    return io::join(dir_, file_names_[pc.buffer]) + ": buffer " + b.name + " (rank " + std::to_string(b.rank) + "), tensor " +
           src_.layout.arrays[pc.array].key() + " " + pc.box.to_string() + ", " + byte_range(off, len);
  }

  const std::vector<std::string>& checksums() const { return checksums_; }
  /// (file name, size metadata records, actual size or -1 when missing)
  struct FileCheck {
    std::string name;
    uint64_t expected = 0;
    int64_t actual = -1;
  };
  const std::vector<FileCheck>& file_checks() const { return file_checks_; }

 private:
  const io::File& handle(int32_t file) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto& h = handles_[file];
    if (!h) {
      // Data files are opened by path when first read, after the open checked their headers. A
      // file renamed or swapped since then (another rank's file, another save's) is refused here,
      // in the load's pre-flight (file_size), before any write; later reads and the mapping use
      // this handle, so the file checked is the file read.
      auto f = std::make_unique<io::File>(io::File::open_read(src_.files[file]));
      const uint64_t n = header_len_[size_t(file)];
      std::string head(size_t(n), '\0');
      bool same = f->size() >= n;
      if (same) {
        f->pread(0, n, head.data());
        same = xxh3_hex(head.data(), head.size()) == header_hash_[size_t(file)];
      }
      if (!same)
        fail(ErrorCode::kDataLoss, src_.files[file], " is not the file this checkpoint was opened with: its safetensors "
             "header changed since the open (the file was replaced, renamed or swapped); open the checkpoint again");
      h = std::move(f);
    }
    return *h;
  }

  // N of rank_N.safetensors (parse_metadata allows only such names); -1 past 9 digits.
  static int rank_in_file_name(const std::string& name) {
    const std::string digits = name.substr(5, name.size() - 5 - 12);
    return digits.size() > 9 ? -1 : std::stoi(digits);
  }
  // The writer records each file's rank and the save's id in the file's __metadata__ and the id in
  // metadata.json (format.md §2-§3). Two rank files swapped, or one copied in from another save,
  // keep their own checksums and shapes: pieces a load cuts between ranks are not checked by
  // verify="free", and would load another rank's or another save's values. `rank` and `save` go
  // together: files written before they existed (neither, and no `save` in metadata.json) are not
  // compared; one of them present makes both required.
  void check_identity(const std::string& path, const std::map<std::string, std::string>& meta, const std::string& save,
                      int file_rank) const {
    auto rank_it = meta.find("rank"), save_it = meta.find("save");
    if (rank_it == meta.end() && save_it == meta.end() && save.empty()) return;
    if (rank_it == meta.end() || save_it == meta.end())
      fail(ErrorCode::kDataLoss, path, ": the file's safetensors header records ",
           rank_it == meta.end() ? "no rank" : "rank " + quoted_cut(rank_it->second), " and ",
           save_it == meta.end() ? "no save id" : "save id " + quoted_cut(save_it->second), " (", kMetadataFile,
           save.empty() ? " has no save id" : " has save id " + quoted_cut(save),
           "); reshard's writer records both in every file of a save: the file was edited, or comes from another save");
    if (rank_it->second != std::to_string(file_rank))
      fail(ErrorCode::kDataLoss, path, ": the file holds the buffers of rank ", quoted_cut(rank_it->second),
           " (its safetensors header's __metadata__ says so), but ", kMetadataFile, " puts rank ", file_rank,
           "'s buffers in it: rank files were renamed, swapped or copied over one another after the save");
    if (save_it->second != save)
      fail(ErrorCode::kDataLoss, path, ": the file was written by another save than ", kMetadataFile, " (save id ",
           quoted_cut(save_it->second), " in the file's header, ", save.empty() ? "none" : quoted_cut(save), " in ", kMetadataFile,
           "): a rank file was copied in from another checkpoint, or the folder mixes two saves");
  }
  // The record's `layout`: the digest of the layout the writer saved (layout_digest). An edit of
  // metadata.json after the save (a piece's strides or offsets, labels swapped consistently) keeps
  // every checksum valid and loads values into the wrong places. Files of earlier writers that
  // recorded rank and save but no digest: not compared. Checked after the header-vs-metadata
  // checks of the file's buffers, which name a single edited field more precisely.
  void check_layout(const std::string& path, const std::map<std::string, std::string>& meta,
                    const std::string& layout) const {
    auto layout_it = meta.find("layout");
    if (layout_it != meta.end() && layout_it->second != layout)
      fail(ErrorCode::kDataLoss, kMetadataFile, " of ", dir_, " does not describe the layout its data files were saved "
           "with (layout digest ", quoted_cut(layout_it->second), " in ", path, ", ", quoted_cut(layout), " computed from ",
           kMetadataFile, "): ", kMetadataFile, " was edited or damaged after the save (its pieces, buffers, arrays, "
           "tensors, model or topology), so its offsets and labels cannot be trusted");
  }

  void load() {
    const std::string meta_path = io::join(dir_, kMetadataFile);
    if (!io::is_file(meta_path)) fail(ErrorCode::kNotFound, "no ", kMetadataFile, " in ", dir_, " (not a native step folder)");
    std::string text = io::read_text(meta_path);
    {
      char hex[17];
      std::snprintf(hex, sizeof hex, "%016llx", (unsigned long long)XXH3_64bits(text.data(), text.size()));
      fingerprint_ = hex;
    }
    Metadata md = parse_metadata(text, meta_path);
    const std::string digest = layout_digest(md.layout);
    src_.layout = std::move(md.layout);
    state_ = std::move(md.state);
    checksums_ = std::move(md.checksums);
    file_names_ = std::move(md.buffer_files);
    for (const auto& [name, bytes] : md.files) {
      src_.files.push_back(io::join(dir_, name));
      file_checks_.push_back({name, uint64_t(bytes), -1});
    }
    const size_t nfiles = src_.files.size();
    missing_.assign(nfiles, false);
    header_len_.assign(nfiles, 0);
    header_hash_.assign(nfiles, std::string());
    handles_.resize(nfiles);
    std::vector<std::vector<int>> buffers_of_file(nfiles);
    for (size_t b = 0; b < md.buffer_file.size(); ++b) buffers_of_file[size_t(md.buffer_file[b])].push_back(int(b));

    src_.locations.assign(src_.layout.buffers.size(), BufferLocation{});
    for (size_t f = 0; f < nfiles; ++f) {
      const std::string& path = src_.files[f];
      if (!io::is_file(path)) {
        missing_[f] = true;
        src_.missing_files.push_back(path);
        std::string what;
        for (size_t k = 0; k < buffers_of_file[f].size() && k < 4; ++k)
          what += (k ? ", " : "") + src_.layout.buffers[buffers_of_file[f][k]].name;
        if (buffers_of_file[f].size() > 4) what += ", ...";
        notes_.push_back("missing data file " + path + " (" + std::to_string(buffers_of_file[f].size()) +
                         " buffers" + (what.empty() ? "" : ": " + what) + "); what only it holds cannot be loaded");
        continue;  // locations stay file = -1
      }
      io::File fh = io::File::open_read(path);  // reads open their own handle lazily
      const uint64_t size = fh.size();
      file_checks_[f].actual = int64_t(size);
      const std::string size_text = size < file_checks_[f].expected
                                        ? " (the file is truncated: " + std::to_string(size) +
                                              " bytes, metadata records " + std::to_string(file_checks_[f].expected) + ")"
                                        : " (" + std::to_string(size) + " bytes)";
      if (size > file_checks_[f].expected)
        notes_.push_back(path + " is " + std::to_string(size) + " bytes, metadata records " +
                         std::to_string(file_checks_[f].expected) + " (trailing bytes; `verify` reports it)");
      uint8_t prefix[8];
      if (size < 8) fail(ErrorCode::kDataLoss, path, " is too short for a safetensors file", size_text);
      fh.pread(0, 8, prefix);
      const uint64_t n = safetensors::parse_header_size(prefix, size, path);
      std::string htext(size_t(n), '\0');
      fh.pread(8, n, htext.data());
      {
        Xxh3Stream head;
        head.update(prefix, 8);
        head.update(htext.data(), htext.size());
        header_len_[f] = 8 + n;
        header_hash_[f] = head.hex();
      }
      safetensors::Header h = safetensors::parse_header(htext, path);
      check_identity(path, h.metadata, md.save, rank_in_file_name(md.files[f].first));
      for (int b : buffers_of_file[f]) {
        const Buffer& buf = src_.layout.buffers[b];
        auto it = h.tensors.find(buf.name);
        if (it == h.tensors.end())
          fail(ErrorCode::kDataLoss, path, ": buffer ", buf.name, " (rank ", buf.rank, ") named by ", kMetadataFile,
               " is not in the file");
        const auto& t = it->second;
        if (!t.rtype || *t.rtype != buf.dtype)
          fail(ErrorCode::kDataLoss, path, ": buffer ", buf.name, " is ", t.dtype, " in the file but ",
               dtype_name(buf.dtype), " in ", kMetadataFile);
        if (t.numel() != buf.numel)
          fail(ErrorCode::kDataLoss, path, ": buffer ", buf.name, " has ", t.numel(), " elements in the file but ",
               buf.numel, " in ", kMetadataFile);
        const uint64_t begin = h.data_start + t.begin, end = h.data_start + t.end;
        if (end > size)
          fail(ErrorCode::kDataLoss, path, ": buffer ", buf.name, " (rank ", buf.rank, ") ",
               byte_range(begin, end - begin), " lies outside the file", size_text);
        src_.locations[b] = {int32_t(f), begin};
      }
      if (h.data_start + h.buffer_size > size)
        fail(ErrorCode::kDataLoss, path, ": the safetensors header describes ", h.buffer_size,
             " data bytes from byte ", h.data_start, " but the file ends before that", size_text);
      if (size < file_checks_[f].expected) fail(ErrorCode::kDataLoss, path, size_text);
      check_layout(path, h.metadata, digest);
    }
    // Checksummed ranges, for has_checksum and begin_check.
    for (size_t p = 0; p < src_.layout.pieces.size(); ++p) {
      const Piece& pc = src_.layout.pieces[p];
      const auto& loc = src_.locations[pc.buffer];
      if (loc.file < 0 || checksums_[p].empty()) continue;
      const size_t es = dtype_size(src_.layout.buffers[pc.buffer].dtype);
      by_range_.emplace(std::make_tuple(loc.file, loc.byte_offset + uint64_t(pc.base) * es,
                                        uint64_t(piece_span(pc)) * es),
                        int(p));
    }
  }

  std::string dir_;
  std::string fingerprint_;  // xxh3-64 of metadata.json, hex
  // Per data file: bytes of its 8-byte length and safetensors header at open, and their xxh3-64.
  std::vector<uint64_t> header_len_;
  std::vector<std::string> header_hash_;
  std::vector<std::string> notes_;
  SourceLayout src_;
  NonTensorState state_;
  std::vector<std::string> checksums_;   // per piece
  std::vector<std::string> file_names_;  // per buffer
  std::vector<FileCheck> file_checks_;   // per file
  std::vector<bool> missing_;
  std::map<std::tuple<int32_t, uint64_t, uint64_t>, int> by_range_;
  mutable std::mutex mu_;
  mutable std::vector<std::unique_ptr<io::File>> handles_;
  // Made once the file list is final; each file is mapped on its first use (MappedFileSet::get).
  std::unique_ptr<io::MappedFileSet> maps_;
};

}  // namespace
}  // namespace native

std::unique_ptr<CheckpointReader> open_native(const std::string& step_dir, std::vector<std::string> notes) {
  return std::make_unique<native::NativeReader>(step_dir, std::move(notes));
}

std::vector<std::string> verify_all(const CheckpointReader& reader) {
  using native::NativeReader;
  const auto* nat = dynamic_cast<const NativeReader*>(&reader);
  const SourceLayout& src = reader.source();
  std::vector<std::string> problems;
  std::mutex mu;
  auto report = [&](std::string s) {
    std::lock_guard<std::mutex> lock(mu);
    problems.push_back(std::move(s));
  };
  if (nat) {
    for (const auto& fc : nat->file_checks()) {
      const std::string path = io::join(reader.path(), fc.name);
      if (fc.actual < 0) report(path + ": missing (metadata records " + std::to_string(fc.expected) + " bytes)");
      else if (uint64_t(fc.actual) != fc.expected)
        report(path + ": " + std::to_string(fc.actual) + " bytes, metadata records " + std::to_string(fc.expected));
    }
  } else {
    for (size_t b = 0; b < src.layout.buffers.size(); ++b)
      if (src.locations[b].file < 0)
        report("buffer " + src.layout.buffers[b].name + " (rank " + std::to_string(src.layout.buffers[b].rank) +
               "): its data file is missing");
  }
  const int n = default_threads();
  // Formats other than native store checksums per storage unit, not per piece (DeepSpeed: the zip
  // CRC-32 of each record; a ZeRO flat partition is one record holding many pieces), so a piece
  // read does not check them: every unit is read whole and checked, and only pieces outside every
  // unit are read on their own (for presence and size).
  std::map<int32_t, std::vector<std::pair<uint64_t, uint64_t>>> units;  // file -> sorted [begin, end)
  if (!nat) {
    std::vector<ChecksumUnit> all = reader.checksum_units();
    for (const std::string& s : check_checksum_units(reader, all, int(n))) report(s);
    for (const ChecksumUnit& u : all) units[u.file].push_back({u.offset, u.offset + u.length});
    for (auto& [f, v] : units) std::sort(v.begin(), v.end());
  }
  auto inside_a_unit = [&](int32_t file, uint64_t begin, uint64_t end) {
    auto it = units.find(file);
    if (it == units.end()) return false;
    const auto& v = it->second;
    auto u = std::upper_bound(v.begin(), v.end(), std::make_pair(begin, UINT64_MAX));
    if (u == v.begin()) return false;
    --u;
    return u->first <= begin && end <= u->second;
  };
  // Every piece: read its byte range and check it (in parallel; reads are thread-safe).
  std::vector<int> todo;
  for (size_t p = 0; p < src.layout.pieces.size(); ++p) {
    const Piece& pc = src.layout.pieces[p];
    const auto& loc = src.locations[pc.buffer];
    if (loc.file < 0) continue;
    const size_t es = dtype_size(src.layout.buffers[pc.buffer].dtype);
    const uint64_t off = loc.byte_offset + uint64_t(pc.base) * es;
    if (inside_a_unit(loc.file, off, off + uint64_t(native::piece_span(pc)) * es)) continue;
    todo.push_back(int(p));
  }
  std::vector<std::vector<char>> bufs(static_cast<size_t>(n));  // per thread
  parallel_for(todo.size(), n, [&](size_t k, int w) {
    std::vector<char>& buf = bufs[size_t(w)];
    const int p = todo[k];
    const Piece& pc = src.layout.pieces[p];
    const Buffer& b = src.layout.buffers[pc.buffer];
    const auto& loc = src.locations[pc.buffer];
    const size_t es = dtype_size(b.dtype);
    const uint64_t off = loc.byte_offset + uint64_t(pc.base) * es;
    const uint64_t len = uint64_t(native::piece_span(pc)) * es;
    try {
      // A chunk at a time through one small buffer per thread: a piece can be a GB (a 70B
      // model's fused SwiGLU master at tp 1), and a whole-piece buffer per thread made
      // `reshard verify` hold threads x the largest piece.
      std::unique_ptr<RangeCheck> check = reader.begin_check(loc.file, off, len);
      constexpr uint64_t kChunk = uint64_t(8) << 20;
      buf.resize(size_t(std::min(len, kChunk)));
      for (uint64_t at = 0; at < len; at += kChunk) {
        const uint64_t n = std::min(kChunk, len - at);
        reader.read(loc.file, off + at, n, buf.data());
        if (check) check->update(buf.data(), size_t(n));
      }
      const std::string why = check ? check->finish() : std::string();
      if (!why.empty()) report(why);
      else if (nat && nat->checksums()[p].empty()) report(nat->describe_piece(p) + ": no stored checksum");
    } catch (const Error& e) {
      report((nat ? nat->describe_piece(p) : "buffer " + b.name) + ": " + e.what());
    }
  });
  std::sort(problems.begin(), problems.end());
  return problems;
}

}  // namespace reshard
