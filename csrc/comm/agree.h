// Agreeing on errors across ranks: a rank whose local step failed must not raise alone, or its
// peers wait for it in their next collective. Each rank runs its step through try_local, the
// ranks gather the outcomes with agree_on_errors, and every rank raises the same error.
// Used by the native save (csrc/formats/native/writer.cc) and by load() after planning
// (csrc/api/load.cc).
#pragma once

#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "reshard/comm.h"
#include "reshard/error.h"

namespace reshard {

/// An error as it travels between ranks: "<code>|<message>".
inline std::string encode_error(const Error& e) { return std::to_string(int(e.code())) + "|" + e.what(); }

/// Runs fn(); returns "" when it returned, else its error encoded (other exceptions as kInternal).
template <typename Fn>
std::string try_local(Fn fn) {
  try {
    fn();
    return {};
  } catch (const Error& e) {
    return encode_error(e);
  } catch (const std::exception& e) {
    return std::to_string(int(ErrorCode::kInternal)) + "|" + e.what();
  }
}

/// Collective: every rank gives its outcome ("" = fine, else encode_error's form). When any rank
/// failed, every rank raises "<what>: rank r: <message>; ..." (the first 8 failing ranks). Code:
/// with `keep_code`, this rank's own error's, else the first failing rank's; without it,
/// kFailedPrecondition when the communicator has several ranks (the error's own with one).
inline void agree_on_errors(Communicator& comm, const std::string& mine, const std::string& what, bool keep_code) {
  const std::vector<std::string> all = comm.all_gather_strings(mine);
  std::string msg;
  int code = -1, nbad = 0;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    const size_t bar = all[r].find('|');
    if (code < 0 || (keep_code && int(r) == comm.rank())) code = std::atoi(all[r].c_str());
    if (nbad++ < 8) msg += (msg.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + ": " + all[r].substr(bar + 1);
  }
  if (nbad == 0) return;
  if (nbad > 8) msg += "; ... (" + std::to_string(nbad) + " ranks failed)";
  fail(keep_code || all.size() == 1 ? ErrorCode(code) : ErrorCode::kFailedPrecondition, what, ": ", msg);
}

}  // namespace reshard
