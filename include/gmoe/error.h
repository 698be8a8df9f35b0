// gmoe/error.h — the one error family of gmoe.
//
// Every argument check at the API edge throws gmoe::Error with the file, the line, the failing
// expression and a message that names the argument, what was expected and what was given.
// Library code never calls exit() and never prints instead of failing.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace gmoe {

/// The exception thrown by every gmoe check. what() holds "file:line: check `expr` failed: message".
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {

inline void append_all(std::ostringstream&) {}
template <typename T, typename... Rest>
void append_all(std::ostringstream& os, const T& value, const Rest&... rest) {
  os << value;
  append_all(os, rest...);
}

/// Builds the message and throws; kept out of line of the check so the fast path stays small.
template <typename... Args>
[[noreturn]] void throw_error(const char* file, int line, const char* expr, const Args&... args) {
  std::ostringstream os;
  os << file << ":" << line << ": check `" << expr << "` failed";
  if constexpr (sizeof...(Args) > 0) {
    os << ": ";
    append_all(os, args...);
  }
  throw Error(os.str());
}

}  // namespace detail
}  // namespace gmoe

/// GMOE_CHECK(cond, "argument x: expected ", a, ", got ", b) throws gmoe::Error when cond is false.
#define GMOE_CHECK(cond, ...)                                                  \
  do {                                                                         \
    if (!(cond)) {                                                             \
      ::gmoe::detail::throw_error(__FILE__, __LINE__, #cond, ##__VA_ARGS__);   \
    }                                                                          \
  } while (0)

/// Unconditional failure with the same message format.
#define GMOE_FAIL(...) ::gmoe::detail::throw_error(__FILE__, __LINE__, "GMOE_FAIL", ##__VA_ARGS__)
