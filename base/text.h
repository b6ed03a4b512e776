// Small text helpers shared by the parsers of flags and config values
// (staleness functions, compression specs, fault plans): whole-string number
// parsing that never reads past its input or depends on the locale, splitting
// on a separator, and printing numbers so that they parse back.
#pragma once

#include <charconv>
#include <cstdio>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace fedmesh {

// "a:b::c" -> {"a", "b", "", "c"}; "" -> {""}.
inline std::vector<std::string_view> split(std::string_view text, char separator) {
  std::vector<std::string_view> parts;
  size_t begin = 0;
  for (;;) {
    const size_t end = text.find(separator, begin);
    parts.push_back(text.substr(begin, end == std::string_view::npos ? std::string_view::npos : end - begin));
    if (end == std::string_view::npos) return parts;
    begin = end + 1;
  }
}

// The whole of `text` as a number of type T (integers, or floating point in
// plain or scientific notation; no sign '+', no spaces). Floating point also
// accepts "inf" and "nan": callers range-check what they read.
template <class T>
bool parse_number(std::string_view text, T& out) {
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), out);
  return !text.empty() && error == std::errc() && end == text.data() + text.size();
}

// %.*g with `significant` digits: 17 always parses back to the same double.
inline std::string format_number(double value, int significant = 17) {
  char text[40];
  std::snprintf(text, sizeof text, "%.*g", significant, value);
  return text;
}

// The shortest text that parses back to exactly `value` (std::to_chars):
// "0.1", not 17 digits' "0.10000000000000001"; for specs that are written
// out and read again (a checkpoint's, a log's) and must mean the same.
inline std::string format_shortest(double value) {
  char text[40];
  const auto [end, error] = std::to_chars(text, text + sizeof text, value);
  return error == std::errc() ? std::string(text, end) : format_number(value);
}

}  // namespace fedmesh
