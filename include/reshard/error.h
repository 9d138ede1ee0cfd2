// reshard: one error type for the whole library.
//
// Every failure that comes from bad input (a path, a file, a topology, a model description) is an
// `Error` with a code from a closed set and a message that names the path, tensor, region, rank or
// field involved. Broken internal invariants are `kInternal`. The CLI maps codes to exit status 2
// (invalid input) and the Python module maps each code to a `reshard.Error` subclass, both keeping
// the message unchanged.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace reshard {

enum class ErrorCode {
  kInvalidArgument,   // a value given by the user or read from a file breaks a rule
  kNotFound,          // a path, step, tensor or file that must exist does not
  kDataLoss,          // bytes are missing, truncated, corrupted or fail a checksum
  kUnsupported,       // a valid input that this version cannot handle (e.g. an unknown variant)
  kFailedPrecondition,// the state does not allow the operation (e.g. live tensors partly written)
  kInternal,          // a broken invariant inside reshard: a bug
};

/// Name of a code as used in messages and in the Python class names ("InvalidArgument", ...).
const char* error_code_name(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, std::string message)
      : std::runtime_error(std::move(message)), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

namespace detail {
template <typename... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
/// `s` as one line of text: ASCII control characters and DEL as \xNN, the Unicode line breaks
/// U+0085, U+2028 and U+2029 (which Python's str.splitlines() splits on) as \uNNNN; everything
/// else as is. Names read from files (tensor, key, path) may hold any of them.
std::string one_line(std::string s);
}  // namespace detail

/// Throws Error(code, concatenation of args) as one line (detail::one_line): the CLI prints it as
/// `reshard: error: <message>`, Python raises it as the exception's text. Use for bad input,
/// never for bugs.
template <typename... Args>
[[noreturn]] void fail(ErrorCode code, Args&&... args) {
  throw Error(code, detail::one_line(detail::cat(std::forward<Args>(args)...)));
}

}  // namespace reshard

/// Internal invariant: throws kInternal with file and line. For bugs only, not for bad input.
#define RESHARD_CHECK(cond, ...)                                                               \
  do {                                                                                         \
    if (!(cond))                                                                               \
      ::reshard::fail(::reshard::ErrorCode::kInternal, "internal error at ", __FILE__, ":",    \
                      __LINE__, ": check '" #cond "' failed. " __VA_OPT__(, ) __VA_ARGS__);   \
  } while (0)
