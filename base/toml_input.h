// The one way crypto/ reads TOML (key files, the roster): toml++ throws, so
// this adapter turns its errors into a Status naming the input, line and
// column, after refusing input shaped to overflow toml++'s stack.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <toml++/toml.h>

#include "base/status.h"

namespace fedmesh {

// `what` names the input in messages ("roster", a file path).
Result<toml::table> parse_toml(std::string_view text, std::string_view what);

// Reads a config file's values by dotted key ("rounds.mode") into typed
// fields. A missing key leaves the field as it is (its default); a value of
// the wrong type, and at finish() any key that nothing read, is an error
// naming the file and the key, so a typo is never silently ignored.
class ConfigReader {
 public:
  ConfigReader(const toml::table& table, std::string what);
  void read(std::string_view key, std::string& out);
  void read(std::string_view key, int64_t& out);
  void read(std::string_view key, uint64_t& out);
  void read(std::string_view key, int& out);
  void read(std::string_view key, double& out);
  void read(std::string_view key, float& out);
  void read(std::string_view key, bool& out);
  void read(std::string_view key, std::vector<std::string>& out);  // an array of strings
  // A table of string arrays (`[data.categories]` with `sex = ["f", "m"]`).
  void read(std::string_view key, std::map<std::string, std::vector<std::string>>& out);
  // Like read(), but the key must be there.
  template <class T>
  void require(std::string_view key, T& out) {
    if (!table_.at_path(key)) fail(std::string(key) + " is required");
    read(key, out);
  }
  Status finish();

 private:
  void fail(std::string message);
  const toml::node* find(std::string_view key);
  const toml::table& table_;
  std::string what_;
  std::set<std::string, std::less<>> used_;
  std::string error_;
};

// Reads a whole config file (at most 1 MiB) and parses it.
Result<toml::table> read_toml_file(const std::string& path);

}  // namespace fedmesh
