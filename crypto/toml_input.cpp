#include "crypto/toml_input.h"

#include <string>

namespace fedmesh::crypto {
namespace {

// toml++ 3.3 recurses once per component of a dotted key (`a.a.a = 1`,
// `[a.a.a]`) without the depth limit it applies to nested arrays and inline
// tables: about 60,000 components overflow an 8 MiB stack. A key lives on
// one line, so bounding the dots per line bounds that depth; no real file
// comes near the bound (an address has a handful, a name at most 32).
constexpr size_t kMaxDotsPerLine = 256;

Status check_dots_per_line(std::string_view text, std::string_view what) {
  size_t line = 1, dots = 0;
  for (const char c : text) {
    if (c == '\n') {
      ++line;
      dots = 0;
    } else if (c == '.' && ++dots > kMaxDotsPerLine) {
      return corrupt(std::string(what) + ": line " + std::to_string(line) + " has more than " +
                     std::to_string(kMaxDotsPerLine) + " '.' characters; no valid file has that many");
    }
  }
  return Status::ok();
}

}  // namespace

Result<toml::table> parse_toml(std::string_view text, std::string_view what) {
  FEDMESH_RETURN_IF_ERROR(check_dots_per_line(text, what));
  try {
    return toml::parse(text);
  } catch (const toml::parse_error& error) {
    const toml::source_position& at = error.source().begin;
    return corrupt(std::string(what) + ": not valid TOML at line " + std::to_string(at.line) + ", column " +
                   std::to_string(at.column) + ": " + std::string(error.description()));
  }
}

}  // namespace fedmesh::crypto
