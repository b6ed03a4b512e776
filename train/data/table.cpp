#include "train/data/table.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <unordered_map>
#include <utility>

#include "base/file_io.h"
#include "base/random.h"
#include "base/text.h"

namespace fedmesh::train::data {
namespace {

// How much of a value or a header a message shows.
constexpr size_t kShownValueBytes = 40;
constexpr size_t kShownNames = 20;

// A value for a message: quoted, control and non-ASCII bytes escaped, cut
// after kShownValueBytes.
std::string show(std::string_view value) {
  std::string out = "'";
  for (size_t i = 0; i < value.size() && i < kShownValueBytes; ++i) {
    const unsigned char c = static_cast<unsigned char>(value[i]);
    if (c < 0x20 || c >= 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (value.size() > kShownValueBytes) out += "...";
  return out + "'";
}

// Names for a message: "a, b, c, ... (120 in all)".
std::string show_list(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < kShownNames; ++i) {
    if (i > 0) out += ", ";
    out += show(names[i]);
  }
  if (names.size() > kShownNames) out += ", ... (" + std::to_string(names.size()) + " in all)";
  return out;
}

// A name or value in the canonical text: the whole of it, quoted, with '"',
// '\' and every byte outside printable ASCII escaped, so that the text stays
// one line and two different lists never print the same.
std::string canonical_quote(std::string_view value) {
  std::string out = "\"";
  for (const char ch : value) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20 || c >= 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

std::string canonical_list(const std::vector<std::string>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out += ",";
    out += canonical_quote(values[i]);
  }
  return out + "]";
}

bool is_blank(char c) { return c == ' ' || c == '\t'; }

std::string_view trim(std::string_view text) {
  while (!text.empty() && is_blank(text.front())) text.remove_prefix(1);
  while (!text.empty() && is_blank(text.back())) text.remove_suffix(1);
  return text;
}

bool equals_ignoring_case(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; };
    if (lower(a[i]) != lower(b[i])) return false;
  }
  return true;
}

bool is_missing(std::string_view value) {
  return value.empty() || equals_ignoring_case(value, "na") || equals_ignoring_case(value, "n/a") ||
         equals_ignoring_case(value, "nan") || equals_ignoring_case(value, "null");
}

// A finite number in plain or scientific notation, a leading '+' allowed.
bool parse_finite(std::string_view text, double& out) {
  if (text.size() > 1 && text.front() == '+' && text[1] != '-') text.remove_prefix(1);
  return parse_number(text, out) && std::isfinite(out);
}

bool has_letter(std::string_view text) {
  return std::any_of(text.begin(), text.end(), [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); });
}

// Reads records of a CSV text one at a time (the format: table.h).
class CsvReader {
 public:
  CsvReader(std::string_view text, const std::string& path) : text_(text), path_(path) {
    if (text_.starts_with("\xEF\xBB\xBF")) pos_ = 3;
  }

  // The next record's fields; `got` false at the end of the text.
  Status next(std::vector<std::string>& fields, bool& got) {
    got = false;
    // Empty lines are skipped.
    while (pos_ < text_.size() && (text_[pos_] == '\n' || text_[pos_] == '\r')) end_line();
    if (pos_ >= text_.size()) return Status::ok();
    row_ = line_;
    size_t count = 0;
    for (;;) {
      if (count == static_cast<size_t>(kMaxTableColumns)) {
        return corrupt(path_ + ": row " + std::to_string(row_) + " has more than " +
                       std::to_string(kMaxTableColumns) + " fields, the limit");
      }
      if (fields.size() <= count) fields.emplace_back();
      std::string& field = fields[count++];
      field.clear();
      size_t start = pos_;
      while (start < text_.size() && is_blank(text_[start])) ++start;
      if (start < text_.size() && text_[start] == '"') {
        pos_ = start + 1;
        FEDMESH_RETURN_IF_ERROR(read_quoted(field, count));
      } else {
        const size_t end = text_.find_first_of(",\r\n", pos_);
        const size_t stop = end == std::string_view::npos ? text_.size() : end;
        field.assign(trim(text_.substr(pos_, stop - pos_)));
        pos_ = stop;
      }
      if (pos_ < text_.size() && text_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < text_.size()) end_line();
      break;
    }
    fields.resize(count);
    got = true;
    return Status::ok();
  }

  int64_t row() const { return row_; }  // the line where the last record began
  // The header's names, for messages about the rows after it.
  void set_names(const std::vector<std::string>* names) { names_ = names; }

 private:
  // Past a line end ("\n", "\r\n" or "\r") at pos_.
  void end_line() {
    if (text_[pos_] == '\r' && pos_ + 1 < text_.size() && text_[pos_ + 1] == '\n') ++pos_;
    ++pos_;
    ++line_;
  }

  // pos_ is just past the opening quote of field `column` (1-based).
  Status read_quoted(std::string& field, size_t column) {
    for (;;) {
      const size_t quote = text_.find('"', pos_);
      if (quote == std::string_view::npos) {
        return corrupt(at(column) + ": a quoted field is not closed before the end of the file");
      }
      const std::string_view part = text_.substr(pos_, quote - pos_);
      for (size_t i = 0; i < part.size(); ++i) {
        if (part[i] == '\n' || (part[i] == '\r' && (i + 1 >= part.size() || part[i + 1] != '\n'))) ++line_;
      }
      field.append(part);
      pos_ = quote + 1;
      if (pos_ < text_.size() && text_[pos_] == '"') {
        field += '"';
        ++pos_;
        continue;
      }
      break;
    }
    while (pos_ < text_.size() && is_blank(text_[pos_])) ++pos_;
    if (pos_ < text_.size() && text_[pos_] != ',' && text_[pos_] != '\r' && text_[pos_] != '\n') {
      return corrupt(at(column) + ": text after the closing quote (a '\"' inside a quoted field is written '\"\"')");
    }
    return Status::ok();
  }

  // "row R, field K" before the header is known, "row R, column 'name'" after.
  std::string at(size_t column) const {
    std::string out = path_ + ": row " + std::to_string(row_) + ", ";
    if (names_ != nullptr && column >= 1 && column <= names_->size()) {
      return out + "column " + show((*names_)[column - 1]);
    }
    return out + "field " + std::to_string(column);
  }

  std::string_view text_;
  const std::string& path_;
  const std::vector<std::string>* names_ = nullptr;
  size_t pos_ = 0;
  int64_t line_ = 1;
  int64_t row_ = 0;
};

enum class Role { kNumeric, kCategorical, kLabel, kDropped };
enum class Missing { kRefuse, kMean, kZero };

// What the header and the spec make of each column.
struct Layout {
  std::vector<std::string> header;
  std::vector<Role> roles;                  // per column
  std::vector<int64_t> slot;                // per column: its index among the numeric or categorical columns
  std::vector<int64_t> numeric_columns;     // header indices
  std::vector<int64_t> categorical_columns;  // header indices
  std::vector<const std::vector<std::string>*> category_lists;  // per categorical column
  std::vector<std::unordered_map<std::string, int32_t>> category_ids;
  std::vector<std::string> feature_names;
  int64_t features = 0;
  int64_t label_column = 0;  // header index
  bool regression = false;   // the label column is a real-valued target
};

// The rows of one file as read: numeric values (NaN where missing), category
// ids (-1 where missing) and label ids (regression: target values).
struct RawRows {
  int64_t rows = 0;
  std::vector<float> numeric;    // (rows, numeric columns)
  std::vector<int32_t> category;  // (rows, categorical columns)
  std::vector<int32_t> label;    // (rows), classification
  std::vector<double> target;    // (rows), regression
};

// Label values to ids: the spec's classes, or (fixed = false) every distinct
// value in order of appearance, sorted into classes afterwards.
struct LabelCoder {
  bool fixed = false;
  std::unordered_map<std::string, int32_t> ids;
  std::vector<std::string> values;
};

std::string where(const std::string& path, int64_t row, const std::string& column) {
  return path + ": row " + std::to_string(row) + ", column " + show(column);
}

Status check_spec(const TableSpec& spec, Missing& missing) {
  const std::string& path = spec.path;
  if (spec.missing == "refuse") {
    missing = Missing::kRefuse;
  } else if (spec.missing == "mean") {
    missing = Missing::kMean;
  } else if (spec.missing == "zero") {
    missing = Missing::kZero;
  } else {
    return invalid_argument(path + ": data.missing is " + show(spec.missing) +
                            "; use \"refuse\", \"mean\" or \"zero\"");
  }
  if (spec.normalize != "standard" && spec.normalize != "none" && spec.normalize != "shared") {
    return invalid_argument(path + ": data.normalize is " + show(spec.normalize) +
                            "; use \"standard\", \"none\" or \"stats:FILE\"");
  }
  if (spec.test_path.empty() && !(spec.test_fraction > 0.0 && spec.test_fraction < 1.0)) {
    return invalid_argument(path + ": data.test_fraction is " + format_shortest(spec.test_fraction) +
                            "; it must be above 0 and below 1 (or name a test file)");
  }
  if (spec.train_limit < 0 || spec.test_limit < 0) {
    return invalid_argument(path + ": a row limit is negative (0 means all rows)");
  }
  if (spec.regression && !spec.classes.empty()) {
    return invalid_argument(path + ": data.classes is for classification; a regression target has no classes");
  }
  if (static_cast<int64_t>(spec.classes.size()) > kMaxTableClasses) {
    return invalid_argument(path + ": data.classes lists " + std::to_string(spec.classes.size()) +
                            " classes, more than the limit of " + std::to_string(kMaxTableClasses));
  }
  std::vector<std::string> sorted = spec.classes;
  std::sort(sorted.begin(), sorted.end());
  if (const auto twice = std::adjacent_find(sorted.begin(), sorted.end()); twice != sorted.end()) {
    return invalid_argument(path + ": data.classes lists " + show(*twice) + " twice");
  }
  for (const auto& [column, list] : spec.categories) {
    if (column == spec.label) {
      return invalid_argument(path + ": the label column " + show(column) + " is also in data.categories");
    }
    if (std::find(spec.drop.begin(), spec.drop.end(), column) != spec.drop.end()) {
      return invalid_argument(path + ": column " + show(column) + " is both in data.categories and in data.drop");
    }
    if (list.empty()) return invalid_argument(path + ": data.categories lists no values for column " + show(column));
    if (static_cast<int64_t>(list.size()) > kMaxTableCategories) {
      return invalid_argument(path + ": data.categories lists " + std::to_string(list.size()) + " values for column " +
                              show(column) + ", more than the limit of " + std::to_string(kMaxTableCategories));
    }
    sorted = list;
    std::sort(sorted.begin(), sorted.end());
    if (const auto twice = std::adjacent_find(sorted.begin(), sorted.end()); twice != sorted.end()) {
      return invalid_argument(path + ": data.categories lists " + show(*twice) + " twice for column " + show(column));
    }
  }
  if (!spec.label.empty() && std::find(spec.drop.begin(), spec.drop.end(), spec.label) != spec.drop.end()) {
    return invalid_argument(path + ": the label column " + show(spec.label) + " is in data.drop");
  }
  return Status::ok();
}

Result<Layout> make_layout(std::vector<std::string> header, const TableSpec& spec) {
  const std::string& path = spec.path;
  Layout layout;
  layout.header = std::move(header);
  const std::vector<std::string>& names = layout.header;
  std::unordered_map<std::string_view, int64_t> index;
  for (size_t i = 0; i < names.size(); ++i) {
    const auto [it, added] = index.emplace(names[i], static_cast<int64_t>(i));
    if (!added) {
      return corrupt(path + ": the header names column " + show(names[i]) + " twice (columns " +
                     std::to_string(it->second + 1) + " and " + std::to_string(i + 1) + ")");
    }
  }
  const auto in_header = [&](const std::string& name, const std::string& what) -> Status {
    if (index.count(name) != 0) return Status::ok();
    return invalid_argument(path + ": " + what + " " + show(name) + " is not in the header (columns: " +
                            show_list(names) + ")");
  };
  if (spec.label.empty()) {
    return invalid_argument(path + ": no label column given: set data.label to one of the header's columns (" +
                            show_list(names) + ")");
  }
  FEDMESH_RETURN_IF_ERROR(in_header(spec.label, "the label column"));
  for (const std::string& name : spec.drop) FEDMESH_RETURN_IF_ERROR(in_header(name, "the dropped column"));
  for (const auto& [name, list] : spec.categories) FEDMESH_RETURN_IF_ERROR(in_header(name, "the categorical column"));

  layout.roles.assign(names.size(), Role::kNumeric);
  layout.slot.assign(names.size(), -1);
  for (const std::string& name : spec.drop) layout.roles[static_cast<size_t>(index[name])] = Role::kDropped;
  layout.roles[static_cast<size_t>(index[spec.label])] = Role::kLabel;
  layout.label_column = index[spec.label];
  for (const auto& [name, list] : spec.categories) layout.roles[static_cast<size_t>(index[name])] = Role::kCategorical;
  for (size_t i = 0; i < names.size(); ++i) {
    const Role role = layout.roles[i];
    if (role == Role::kDropped || role == Role::kLabel) continue;
    if (names[i].empty()) {
      return corrupt(path + ": column " + std::to_string(i + 1) +
                     " of the header has no name (a pandas index? write the file with index=False, or add \"\" to "
                     "data.drop)");
    }
    if (role == Role::kNumeric) {
      layout.slot[i] = static_cast<int64_t>(layout.numeric_columns.size());
      layout.numeric_columns.push_back(static_cast<int64_t>(i));
      layout.feature_names.push_back(names[i]);
    } else {
      const std::vector<std::string>& list = spec.categories.at(names[i]);
      layout.slot[i] = static_cast<int64_t>(layout.categorical_columns.size());
      layout.categorical_columns.push_back(static_cast<int64_t>(i));
      layout.category_lists.push_back(&list);
      auto& ids = layout.category_ids.emplace_back();
      for (size_t c = 0; c < list.size(); ++c) {
        ids.emplace(list[c], static_cast<int32_t>(c));
        layout.feature_names.push_back(names[i] + "=" + list[c]);
      }
    }
    if (static_cast<int64_t>(layout.feature_names.size()) > kMaxTableFeatures) {
      return invalid_argument(path + ": more than " + std::to_string(kMaxTableFeatures) +
                              " features (numeric columns plus the categories' one-hot values), the limit");
    }
  }
  layout.features = static_cast<int64_t>(layout.feature_names.size());
  layout.regression = spec.regression;
  if (layout.features == 0) {
    return invalid_argument(path + ": no feature columns: every column is the label or dropped");
  }
  return layout;
}

Status code_label(const std::string& path, int64_t row, const std::string& column, const std::string& value,
                  const std::vector<std::string>& classes_for_message, LabelCoder& labels, int32_t& id) {
  if (value.empty()) return corrupt(where(path, row, column) + ": the label is empty");
  if (const auto it = labels.ids.find(value); it != labels.ids.end()) {
    id = it->second;
    return Status::ok();
  }
  if (labels.fixed) {
    return corrupt(where(path, row, column) + ": label " + show(value) + " is not one of the classes (" +
                   show_list(classes_for_message) + ")");
  }
  if (static_cast<int64_t>(labels.values.size()) >= kMaxTableClasses) {
    return corrupt(where(path, row, column) + ": more than " + std::to_string(kMaxTableClasses) +
                   " distinct labels (a numeric target? regression is not supported)");
  }
  id = static_cast<int32_t>(labels.values.size());
  labels.ids.emplace(value, id);
  labels.values.push_back(value);
  return Status::ok();
}

// Reads the rows after the header. `classes` is for messages when the coder is fixed.
Status read_rows(CsvReader& reader, const std::string& path, const Layout& layout, Missing missing,
                 const std::vector<std::string>& classes, LabelCoder& labels, RawRows& out) {
  const size_t columns = layout.header.size();
  const size_t numeric = layout.numeric_columns.size();
  const size_t categorical = layout.categorical_columns.size();
  std::vector<std::string> fields;
  for (;;) {
    bool got = false;
    FEDMESH_RETURN_IF_ERROR(reader.next(fields, got));
    if (!got) break;
    const int64_t row = reader.row();
    if (fields.size() != columns) {
      return corrupt(path + ": row " + std::to_string(row) + " has " + std::to_string(fields.size()) +
                     " fields, the header has " + std::to_string(columns));
    }
    if ((out.rows + 1) * layout.features > kMaxTableValues) {
      return corrupt(path + ": row " + std::to_string(row) + ": more than " + std::to_string(kMaxTableValues) +
                     " feature values (rows x features), the limit");
    }
    for (size_t c = 0; c < columns; ++c) {
      const std::string& name = layout.header[c];
      const std::string& value = fields[c];
      switch (layout.roles[c]) {
        case Role::kDropped: break;
        case Role::kLabel: {
          if (layout.regression) {
            double number = 0.0;
            if (is_missing(value)) return corrupt(where(path, row, name) + ": the target is missing " + show(value));
            if (!parse_finite(value, number) || std::fabs(number) > FLT_MAX) {
              return corrupt(where(path, row, name) + ": the target " + show(value) +
                             " is not a finite number (data.task = \"regression\" takes numbers)");
            }
            out.target.push_back(number);
            break;
          }
          int32_t id = 0;
          FEDMESH_RETURN_IF_ERROR(code_label(path, row, name, value, classes, labels, id));
          out.label.push_back(id);
          break;
        }
        case Role::kNumeric: {
          double number = 0.0;
          if (is_missing(value)) {
            if (missing == Missing::kRefuse) {
              return corrupt(where(path, row, name) + ": missing value " + show(value) +
                             " (set data.missing to \"mean\" or \"zero\" to fill it in)");
            }
            number = std::nan("");
          } else if (!parse_finite(value, number)) {
            std::string message = where(path, row, name) + ": " + show(value) + " is not a finite number";
            if (has_letter(value)) {
              message += "; if " + show(name) + " is categorical, list its values in data.categories";
            }
            return corrupt(std::move(message));
          } else if (std::fabs(number) > FLT_MAX) {
            return corrupt(where(path, row, name) + ": " + show(value) + " is beyond the range of a 32-bit float");
          }
          out.numeric.push_back(static_cast<float>(number));
          break;
        }
        case Role::kCategorical: {
          const size_t slot = static_cast<size_t>(layout.slot[c]);
          int32_t id = -1;
          if (is_missing(value) && layout.category_ids[slot].count(value) == 0) {
            if (missing == Missing::kRefuse) {
              return corrupt(where(path, row, name) + ": missing value " + show(value) +
                             " (set data.missing to \"mean\" or \"zero\" for an all-zero one-hot block)");
            }
          } else if (const auto it = layout.category_ids[slot].find(value); it != layout.category_ids[slot].end()) {
            id = it->second;
          } else {
            return corrupt(where(path, row, name) + ": " + show(value) + " is not one of its categories (" +
                           show_list(*layout.category_lists[slot]) + ")");
          }
          out.category.push_back(id);
          break;
        }
      }
    }
    ++out.rows;
  }
  FEDMESH_CHECK(out.numeric.size() == static_cast<size_t>(out.rows) * numeric &&
                out.category.size() == static_cast<size_t>(out.rows) * categorical &&
                (layout.regression ? out.target.size() : out.label.size()) == static_cast<size_t>(out.rows));
  if (out.rows == 0) return corrupt(path + ": no data rows after the header");
  return Status::ok();
}

Result<std::vector<std::string>> read_header(CsvReader& reader, const std::string& path) {
  std::vector<std::string> header;
  bool got = false;
  FEDMESH_RETURN_IF_ERROR(reader.next(header, got));
  if (!got) return corrupt(path + ": empty, expected a header row");
  return header;
}

// The auto class list: the distinct labels sorted, numerically when all are numbers.
std::vector<std::string> sorted_classes(const std::vector<std::string>& values) {
  std::vector<std::string> classes = values;
  std::vector<double> numbers(values.size());
  bool all_numbers = true;
  for (size_t i = 0; i < values.size() && all_numbers; ++i) all_numbers = parse_finite(trim(values[i]), numbers[i]);
  if (!all_numbers) {
    std::sort(classes.begin(), classes.end());
    return classes;
  }
  std::vector<size_t> order(values.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return numbers[a] != numbers[b] ? numbers[a] < numbers[b] : values[a] < values[b];
  });
  for (size_t i = 0; i < order.size(); ++i) classes[i] = values[order[i]];
  return classes;
}

// Present values' count, mean and population std of each numeric column over `rows`.
TableStats compute_stats(const Layout& layout, const RawRows& raw, const std::vector<int64_t>& rows) {
  const size_t numeric = layout.numeric_columns.size();
  TableStats stats;
  stats.mean.assign(numeric, 0.0);
  stats.std.assign(numeric, 0.0);
  stats.count.assign(numeric, 0);
  for (size_t j = 0; j < numeric; ++j) {
    stats.names.push_back(layout.header[static_cast<size_t>(layout.numeric_columns[j])]);
    double sum = 0.0;
    int64_t count = 0;
    for (const int64_t r : rows) {
      const float v = raw.numeric[static_cast<size_t>(r) * numeric + j];
      if (std::isnan(v)) continue;
      sum += v;
      ++count;
    }
    if (count == 0) continue;
    const double mean = sum / static_cast<double>(count);
    double squares = 0.0;
    for (const int64_t r : rows) {
      const float v = raw.numeric[static_cast<size_t>(r) * numeric + j];
      if (!std::isnan(v)) squares += (v - mean) * (v - mean);
    }
    stats.mean[j] = mean;
    stats.std[j] = std::sqrt(squares / static_cast<double>(count));
    stats.count[j] = count;
  }
  if (layout.regression) {  // the target's, last, under the label column's name
    double sum = 0.0, squares = 0.0;
    for (const int64_t r : rows) sum += raw.target[static_cast<size_t>(r)];
    const double count = static_cast<double>(rows.size());
    const double mean = rows.empty() ? 0.0 : sum / count;
    for (const int64_t r : rows) {
      const double d = raw.target[static_cast<size_t>(r)] - mean;
      squares += d * d;
    }
    stats.names.push_back(layout.header[static_cast<size_t>(layout.label_column)]);
    stats.mean.push_back(mean);
    stats.std.push_back(rows.empty() ? 0.0 : std::sqrt(squares / count));
    stats.count.push_back(static_cast<int64_t>(rows.size()));
  }
  return stats;
}

std::unique_ptr<TableSet> encode(const Layout& layout, const RawRows& raw, const std::vector<int64_t>& rows,
                                 const TableStats& stats, Missing missing, bool standardize) {
  const size_t numeric = layout.numeric_columns.size();
  const size_t categorical = layout.categorical_columns.size();
  const size_t features = static_cast<size_t>(layout.features);
  std::vector<float> values(rows.size() * features, 0.0f);
  std::vector<int32_t> targets(layout.regression ? 0 : rows.size());
  std::vector<float> target_values(layout.regression ? rows.size() : 0);
  // Regression: the target standardized by its entry after the numeric features'.
  const double target_mean = layout.regression && standardize ? stats.mean[numeric] : 0.0;
  const double target_scale = layout.regression && standardize && stats.std[numeric] > 0.0 ? stats.std[numeric] : 1.0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const size_t r = static_cast<size_t>(rows[i]);
    float* out = values.data() + i * features;
    size_t f = 0;
    for (size_t c = 0; c < layout.header.size(); ++c) {
      const Role role = layout.roles[c];
      if (role == Role::kNumeric) {
        const size_t j = static_cast<size_t>(layout.slot[c]);
        double v = raw.numeric[r * numeric + j];
        if (std::isnan(v)) v = missing == Missing::kMean ? stats.mean[j] : 0.0;
        if (standardize) v = (v - stats.mean[j]) / (stats.std[j] > 0.0 ? stats.std[j] : 1.0);
        out[f++] = static_cast<float>(v);
      } else if (role == Role::kCategorical) {
        const size_t j = static_cast<size_t>(layout.slot[c]);
        const int32_t id = raw.category[r * categorical + j];
        if (id >= 0) out[f + static_cast<size_t>(id)] = 1.0f;
        f += layout.category_lists[j]->size();
      }
    }
    FEDMESH_CHECK(f == features);
    if (layout.regression) {
      target_values[i] = static_cast<float>((raw.target[r] - target_mean) / target_scale);
    } else {
      targets[i] = raw.label[r];
    }
  }
  if (layout.regression) {
    return std::make_unique<TableSet>(layout.features, std::move(values), std::move(target_values), target_scale,
                                      stats);
  }
  return std::make_unique<TableSet>(layout.features, std::move(values), std::move(targets), stats);
}

std::string file_name(const std::string& path) {
  const std::string name = std::filesystem::path(path).filename().string();
  return name.empty() ? path : name;
}

}  // namespace

void TableSet::make_batch(std::span<const int64_t> indices, DType dtype, Tensor& inputs,
                          std::vector<int32_t>& targets) const {
  const int64_t batch = static_cast<int64_t>(indices.size());
  Tensor::reuse(inputs, {batch, features_}, dtype);
  targets.resize(regression_ ? 0 : indices.size());
  visit_dtype(dtype, [&]<class T>() {
    T* out = inputs.data<T>();
    for (int64_t i = 0; i < batch; ++i) {
      const int64_t index = indices[static_cast<size_t>(i)];
      FEDMESH_CHECK(index >= 0 && index < size(), "sample index out of range");
      const float* src = values_.data() + index * features_;
      for (int64_t j = 0; j < features_; ++j) out[i * features_ + j] = from_float<T>(src[j]);
      if (!regression_) targets[static_cast<size_t>(i)] = targets_[static_cast<size_t>(index)];
    }
  });
}

void TableSet::batch_values(std::span<const int64_t> indices, std::vector<float>& values) const {
  values.clear();
  if (!regression_) return;
  for (const int64_t index : indices) {
    FEDMESH_CHECK(index >= 0 && index < size(), "sample index out of range");
    values.push_back(target_values_[static_cast<size_t>(index)]);
  }
}

Result<LoadedData> parse_table(std::string_view text, const TableSpec& spec, std::string_view test_text) {
  Missing missing = Missing::kRefuse;
  FEDMESH_RETURN_IF_ERROR(check_spec(spec, missing));
  const bool has_test_file = !spec.test_path.empty();
  if (static_cast<int64_t>(text.size()) > kMaxTableBytes) {
    return corrupt(spec.path + ": " + std::to_string(text.size()) + " bytes, more than the limit of " +
                   std::to_string(kMaxTableBytes));
  }
  if (has_test_file && static_cast<int64_t>(test_text.size()) > kMaxTableBytes) {
    return corrupt(spec.test_path + ": " + std::to_string(test_text.size()) + " bytes, more than the limit of " +
                   std::to_string(kMaxTableBytes));
  }

  CsvReader reader(text, spec.path);
  Result<std::vector<std::string>> header = read_header(reader, spec.path);
  if (!header.is_ok()) return header.status();
  Result<Layout> made = make_layout(std::move(header).value(), spec);
  if (!made.is_ok()) return made.status();
  const Layout& layout = made.value();
  reader.set_names(&layout.header);

  LabelCoder labels;
  labels.fixed = !spec.classes.empty();
  for (size_t i = 0; i < spec.classes.size(); ++i) labels.ids.emplace(spec.classes[i], static_cast<int32_t>(i));
  RawRows train_raw;
  FEDMESH_RETURN_IF_ERROR(read_rows(reader, spec.path, layout, missing, spec.classes, labels, train_raw));

  std::vector<std::string> classes = spec.classes;
  if (!labels.fixed) {
    // Ids so far are in order of appearance: renumber them in class order.
    classes = sorted_classes(labels.values);
    std::vector<int32_t> renumber(labels.values.size());
    labels.ids.clear();
    for (size_t i = 0; i < classes.size(); ++i) labels.ids.emplace(classes[i], static_cast<int32_t>(i));
    for (size_t i = 0; i < labels.values.size(); ++i) renumber[i] = labels.ids.at(labels.values[i]);
    for (int32_t& id : train_raw.label) id = renumber[static_cast<size_t>(id)];
    labels.values = classes;
    labels.fixed = true;
  }

  // The rows of each split, in file order.
  RawRows test_raw;
  const RawRows* test_source = &train_raw;
  std::vector<int64_t> train_rows, test_rows;
  if (has_test_file) {
    CsvReader test_reader(test_text, spec.test_path);
    Result<std::vector<std::string>> test_header = read_header(test_reader, spec.test_path);
    if (!test_header.is_ok()) return test_header.status();
    if (test_header.value() != layout.header) {
      const std::vector<std::string>& got = test_header.value();
      std::string what;
      if (got.size() != layout.header.size()) {
        what = std::to_string(got.size()) + " columns, " + spec.path + " has " + std::to_string(layout.header.size());
      } else {
        size_t i = 0;
        while (got[i] == layout.header[i]) ++i;
        what = "column " + std::to_string(i + 1) + " is " + show(got[i]) + ", in " + spec.path + " " +
               show(layout.header[i]);
      }
      return corrupt(spec.test_path + ": the header differs from the training table's: " + what);
    }
    test_reader.set_names(&layout.header);
    FEDMESH_RETURN_IF_ERROR(read_rows(test_reader, spec.test_path, layout, missing, classes, labels, test_raw));
    test_source = &test_raw;
    for (int64_t r = 0; r < train_raw.rows; ++r) train_rows.push_back(r);
    for (int64_t r = 0; r < test_raw.rows; ++r) test_rows.push_back(r);
  } else {
    const int64_t n = train_raw.rows;
    if (n < 2) {
      return corrupt(spec.path + ": 1 data row: too few to split off a test set (or name a test file)");
    }
    const int64_t test_count =
        std::clamp<int64_t>(std::llround(static_cast<double>(n) * spec.test_fraction), 1, n - 1);
    std::vector<int64_t> order(static_cast<size_t>(n));
    for (int64_t r = 0; r < n; ++r) order[static_cast<size_t>(r)] = r;
    Rng rng(spec.seed);
    for (int64_t i = n - 1; i > 0; --i) {
      std::swap(order[static_cast<size_t>(i)], order[rng.below(static_cast<uint64_t>(i) + 1)]);
    }
    test_rows.assign(order.begin(), order.begin() + test_count);
    train_rows.assign(order.begin() + test_count, order.end());
    std::sort(test_rows.begin(), test_rows.end());
    std::sort(train_rows.begin(), train_rows.end());
  }
  if (spec.train_limit > 0 && static_cast<int64_t>(train_rows.size()) > spec.train_limit) {
    train_rows.resize(static_cast<size_t>(spec.train_limit));
  }
  if (spec.test_limit > 0 && static_cast<int64_t>(test_rows.size()) > spec.test_limit) {
    test_rows.resize(static_cast<size_t>(spec.test_limit));
  }

  TableStats stats = compute_stats(layout, train_raw, train_rows);
  if (spec.normalize == "shared") {
    // The federation's statistics replace this node's own, feature by feature.
    if (spec.shared_names != stats.names || spec.shared_mean.size() != stats.names.size() ||
        spec.shared_std.size() != stats.names.size()) {
      std::string want, have;
      for (const std::string& n : stats.names) want += (want.empty() ? "" : ", ") + show(n);
      for (const std::string& n : spec.shared_names) have += (have.empty() ? "" : ", ") + show(n);
      return invalid_argument(spec.path + ": the shared statistics are for the numeric features [" + have.substr(0, 400) +
                              "], this table's are [" + want.substr(0, 400) + "]");
    }
    stats.mean = spec.shared_mean;
    stats.std = spec.shared_std;
  }
  const bool standardize = spec.normalize != "none";
  LoadedData data;
  data.train = encode(layout, train_raw, train_rows, stats, missing, standardize);
  data.test = encode(layout, *test_source, test_rows, stats, missing, standardize);

  data.schema.sample_shape = {layout.features};
  data.schema.classes = spec.regression ? 1 : static_cast<int64_t>(classes.size());
  data.schema.regression = spec.regression;
  std::string canonical = "table v1 features=[";
  bool first = true;
  for (size_t c = 0; c < layout.header.size(); ++c) {
    const Role role = layout.roles[c];
    if (role != Role::kNumeric && role != Role::kCategorical) continue;
    if (!first) canonical += ",";
    first = false;
    canonical += canonical_quote(layout.header[c]);
    canonical += role == Role::kNumeric
                     ? std::string(":num")
                     : ":cat" + canonical_list(*layout.category_lists[static_cast<size_t>(layout.slot[c])]);
  }
  canonical += "] label=" + canonical_quote(spec.label) +
               (spec.regression ? std::string(" task=regression") : " classes=" + canonical_list(classes)) +
               " normalize=" + (spec.normalize == "shared" ? "shared:" + spec.shared_digest : spec.normalize) +
               " missing=" + spec.missing;
  data.schema.canonical = std::move(canonical);

  data.description = std::to_string(train_rows.size()) + " rows of " + file_name(spec.path) + " (" +
                     std::to_string(test_rows.size()) + " test" +
                     (has_test_file ? " rows of " + file_name(spec.test_path) : std::string()) + "), " +
                     std::to_string(layout.features) + " features, " +
                     (spec.regression ? "regression on " + show(spec.label)
                                      : std::to_string(classes.size()) + " classes");
  return data;
}

Result<LoadedData> load_table(const TableSpec& spec) {
  if (spec.path.empty()) return invalid_argument("csv: no table file named");
  Result<std::string> text = read_file_bounded(spec.path, static_cast<size_t>(kMaxTableBytes));
  if (!text.is_ok()) return text.status();
  std::string test_text;
  if (!spec.test_path.empty()) {
    Result<std::string> read = read_file_bounded(spec.test_path, static_cast<size_t>(kMaxTableBytes));
    if (!read.is_ok()) return read.status();
    test_text = std::move(read).value();
  }
  return parse_table(text.value(), spec, test_text);
}

Result<TableStats> table_statistics(const TableSpec& spec) {
  Result<LoadedData> data = load_table(spec);
  if (!data.is_ok()) return data.status();
  return static_cast<const TableSet&>(*data.value().train).stats();
}

}  // namespace fedmesh::train::data
