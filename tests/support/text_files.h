// Small text files for tests that write and edit configs: read a file whole,
// write one, and set one `key = value` line of a TOML file.
#pragma once

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace fedmesh::testing {

inline std::string slurp(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void spit(const std::filesystem::path& file, const std::string& text) {
  std::ofstream(file, std::ios::binary) << text;
}

// Replaces the top-level line `key = ...` of a TOML file, or appends one.
inline void set_toml_option(const std::filesystem::path& config, const std::string& key, const std::string& value) {
  std::string text = "\n" + slurp(config);  // every line, the first too, starts after a newline
  const size_t at = text.find("\n" + key + " = ");
  if (at == std::string::npos) {
    if (text.back() != '\n') text += '\n';
    text += key + " = " + value + "\n";
  } else {
    const size_t end = text.find('\n', at + 1);
    text.replace(at + 1, (end == std::string::npos ? text.size() : end) - (at + 1), key + " = " + value);
  }
  spit(config, text.substr(1));
}

}  // namespace fedmesh::testing
