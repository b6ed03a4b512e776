#include "base/toml_input.h"

#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <string>

namespace fedmesh {
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

ConfigReader::ConfigReader(const toml::table& table, std::string what) : table_(table), what_(std::move(what)) {}

void ConfigReader::fail(std::string message) {
  if (error_.empty()) error_ = what_ + ": " + std::move(message);
}

const toml::node* ConfigReader::find(std::string_view key) {
  used_.emplace(key);
  const toml::node_view<const toml::node> node = table_.at_path(key);
  return node.node();
}

namespace {

template <class T>
bool read_integer(const toml::node* node, T& out) {
  const auto value = node->value<int64_t>();
  if (!value || *value < static_cast<int64_t>(std::numeric_limits<T>::min()) ||
      (*value > 0 && static_cast<uint64_t>(*value) > static_cast<uint64_t>(std::numeric_limits<T>::max()))) {
    return false;
  }
  out = static_cast<T>(*value);
  return true;
}

}  // namespace

void ConfigReader::read(std::string_view key, std::string& out) {
  if (const toml::node* node = find(key)) {
    if (const auto value = node->value<std::string>()) out = *value;
    else fail(std::string(key) + " must be a string");
  }
}
void ConfigReader::read(std::string_view key, int64_t& out) {
  if (const toml::node* node = find(key); node && !read_integer(node, out)) fail(std::string(key) + " must be an integer");
}
void ConfigReader::read(std::string_view key, uint64_t& out) {
  if (const toml::node* node = find(key); node && !read_integer(node, out)) {
    fail(std::string(key) + " must be a non-negative integer");
  }
}
void ConfigReader::read(std::string_view key, int& out) {
  if (const toml::node* node = find(key); node && !read_integer(node, out)) fail(std::string(key) + " must be an integer");
}
void ConfigReader::read(std::string_view key, double& out) {
  if (const toml::node* node = find(key)) {
    if (const auto value = node->value<double>()) out = *value;  // integers convert
    else fail(std::string(key) + " must be a number");
  }
}
void ConfigReader::read(std::string_view key, float& out) {
  double value = out;
  read(key, value);
  out = static_cast<float>(value);
}
void ConfigReader::read(std::string_view key, bool& out) {
  if (const toml::node* node = find(key)) {
    if (const auto value = node->value<bool>()) out = *value;
    else fail(std::string(key) + " must be true or false");
  }
}

void ConfigReader::read(std::string_view key, std::vector<std::string>& out) {
  if (const toml::node* node = find(key)) {
    const toml::array* array = node->as_array();
    std::vector<std::string> values;
    if (array != nullptr) {
      for (const toml::node& element : *array) {
        if (const auto text = element.value<std::string>()) values.push_back(*text);
        else array = nullptr;
      }
    }
    if (array == nullptr) fail(std::string(key) + " must be an array of strings");
    else out = std::move(values);
  }
}

void ConfigReader::read(std::string_view key, std::map<std::string, std::vector<std::string>>& out) {
  const toml::node* node = find(key);
  if (node == nullptr) return;
  const toml::table* table = node->as_table();
  if (table == nullptr) {
    fail(std::string(key) + " must be a table of string arrays");
    return;
  }
  std::map<std::string, std::vector<std::string>> values;
  for (const auto& [name, element] : *table) {
    const std::string inner = std::string(key) + "." + std::string(name.str());
    std::vector<std::string> list;
    read(inner, list);
    values[std::string(name.str())] = std::move(list);
  }
  out = std::move(values);
}

Status ConfigReader::finish() {
  if (!error_.empty()) return invalid_argument(error_);
  std::string unknown;
  std::function<void(const toml::table&, const std::string&)> walk = [&](const toml::table& table,
                                                                       const std::string& prefix) {
    for (const auto& [k, node] : table) {
      const std::string key = prefix + std::string(k.str());
      if (const toml::table* inner = node.as_table()) {
        walk(*inner, key + ".");
      } else if (!used_.contains(key) && unknown.empty()) {
        unknown = key;
      }
    }
  };
  walk(table_, "");
  if (!unknown.empty()) return invalid_argument(what_ + ": unknown key '" + unknown + "'");
  return Status::ok();
}

Result<toml::table> read_toml_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("cannot open config " + path);
  std::string text;
  char buffer[65536];
  while (in.read(buffer, sizeof buffer) || in.gcount() > 0) {
    text.append(buffer, static_cast<size_t>(in.gcount()));
    if (text.size() > (size_t{1} << 20)) return invalid_argument("config " + path + " is over 1 MiB");
  }
  return parse_toml(text, path);
}

}  // namespace fedmesh
