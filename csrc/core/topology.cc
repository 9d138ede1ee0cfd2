#include "reshard/topology.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "reshard/error.h"

namespace reshard {

std::string Topology::to_string() const {
  std::ostringstream os;
  os << "tp=" << tp << ",pp=" << pp << ",vpp=" << vpp << ",dp=" << dp << ",zero=" << zero;
  return os.str();
}

Topology Topology::parse(const std::string& text) {
  Topology t;
  std::string s;
  for (char c : text)
    if (!std::isspace(static_cast<unsigned char>(c))) s += c;
  if (s.empty()) fail(ErrorCode::kInvalidArgument, "layout '", text, "' is empty (expected e.g. tp=2,pp=2,dp=4,zero=1)");
  size_t pos = 0;
  std::vector<std::string> seen;
  while (pos <= s.size()) {
    size_t comma = s.find(',', pos);
    if (comma == std::string::npos) comma = s.size();
    std::string item = s.substr(pos, comma - pos);
    pos = comma + 1;
    if (item.empty()) {
      if (comma >= s.size() && pos > 1) break;  // one trailing comma is fine
      fail(ErrorCode::kInvalidArgument, "layout '", text, "' has an empty item (two commas in a row, or a leading one)");
    }
    size_t eq = item.find('=');
    if (eq == std::string::npos)
      fail(ErrorCode::kInvalidArgument, "layout '", text, "': item '", item, "' is not key=value");
    std::string key = item.substr(0, eq), val = item.substr(eq + 1);
    if (std::find(seen.begin(), seen.end(), key) != seen.end())
      fail(ErrorCode::kInvalidArgument, "layout '", text, "': ", key, " is given twice");
    seen.push_back(key);
    // Plain decimal digits only (strtol alone takes a sign).
    if (val.empty() || !std::all_of(val.begin(), val.end(), [](char c) { return c >= '0' && c <= '9'; }))
      fail(ErrorCode::kInvalidArgument, "layout '", text, "': ", key, "='", val, "' is not an integer");
    errno = 0;
    long v = std::strtol(val.c_str(), nullptr, 10);
    if (errno == ERANGE) fail(ErrorCode::kInvalidArgument, "layout '", text, "': ", key, "=", val, " is out of range");
    int* field = nullptr;
    if (key == "tp") field = &t.tp;
    else if (key == "pp") field = &t.pp;
    else if (key == "vpp") field = &t.vpp;
    else if (key == "dp") field = &t.dp;
    else if (key == "zero") field = &t.zero;
    else if (key == "cp") field = &t.cp;
    else if (key == "ep") field = &t.ep;
    else
      fail(ErrorCode::kInvalidArgument, "layout '", text, "': unknown key '", key,
           "' (known: tp, pp, vpp, dp, zero, cp, ep)");
    if (v < 0 || v > 1000000)
      fail(ErrorCode::kInvalidArgument, "layout '", text, "': ", key, "=", v, " is out of range");
    *field = int(v);
    if (comma >= s.size()) break;
  }
  t.validate();
  return t;
}

void Topology::validate() const {
  auto positive = [](const char* name, int v) {
    if (v < 1) fail(ErrorCode::kInvalidArgument, "layout field ", name, "=", v, " must be >= 1");
  };
  positive("tp", tp);
  positive("pp", pp);
  positive("vpp", vpp);
  positive("dp", dp);
  if (zero < 0 || zero > 3)
    fail(ErrorCode::kInvalidArgument, "layout field zero=", zero, " must be 0, 1, 2 or 3");
  if (cp != 1) fail(ErrorCode::kUnsupported, "layout field cp=", cp, ": context parallel is not supported yet (must be 1)");
  if (ep != 1) fail(ErrorCode::kUnsupported, "layout field ep=", ep, ": expert parallel is not supported yet (must be 1)");
  if (zero >= 2 && pp > 1)
    fail(ErrorCode::kInvalidArgument, "layout zero=", zero, " with pp=", pp,
         ": DeepSpeed does not combine ZeRO stage 2 or 3 with pipeline parallelism (use zero<=1 or pp=1)");
  // The planner holds the whole job's plan on every rank (about 0.1 MB per rank for a 4-layer
  // model, more for larger ones): a typo like dp=1000000 would be killed for memory, not refused.
  const int64_t world = int64_t(tp) * pp * dp;
  if (world > kMaxWorldSize)
    fail(ErrorCode::kInvalidArgument, "layout tp=", tp, ",pp=", pp, ",dp=", dp, " has ", world, " ranks; at most ",
         kMaxWorldSize, " are supported (every rank plans the whole job)");
  if (vpp > 1 && pp == 1)
    fail(ErrorCode::kInvalidArgument, "layout vpp=", vpp, " needs pp > 1 (virtual stages interleave pipeline ranks)");
}

std::string describe_change(const Topology& a, const Topology& b) {
  std::vector<std::string> parts;
  auto axis = [&](const char* name, int x, int y) {
    if (x != y) parts.push_back(std::string(name) + " " + std::to_string(x) + "->" + std::to_string(y));
  };
  axis("tp", a.tp, b.tp);
  axis("pp", a.pp, b.pp);
  axis("vpp", a.vpp, b.vpp);
  axis("dp", a.dp, b.dp);
  if (a.zero != b.zero) {
    parts.push_back("ZeRO " + std::to_string(a.zero) + "->" + std::to_string(b.zero));
  } else if (a.zero > 0 && (a.dp != b.dp || a.tp != b.tp || a.pp != b.pp || a.vpp != b.vpp)) {
    parts.push_back("ZeRO-" + std::to_string(a.zero) + " partitions re-cut");
  }
  if (parts.empty()) return "no change";
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i ? ", " : "") + parts[i];
  return out;
}

}  // namespace reshard
