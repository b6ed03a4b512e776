#include "train/data/arrays.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <numeric>

#include <nlohmann/json.hpp>

#include "base/random.h"

namespace fedmesh::train::data {

namespace {

// ---- Bytes -----------------------------------------------------------------

template <class T>
T load_le(const uint8_t* p) {
  T value;
  std::memcpy(&value, p, sizeof value);
  return value;  // the build is little-endian (static_assert below)
}
static_assert(std::endian::native == std::endian::little, "array files are read as little-endian");

int64_t dtype_bytes(const std::string& dtype) {
  if (dtype.size() != 2) return 0;
  const char kind = dtype[0], size = dtype[1];
  if (kind != 'f' && kind != 'i' && kind != 'u') return 0;
  if (size != '1' && size != '2' && size != '4' && size != '8') return 0;
  if (kind == 'f' && (size == '1' || size == '2')) return 0;  // no float8/float16 here
  return size - '0';
}

// The element of `view` at flat position `i`, as a double (ArrayView::value).
double element(const ArrayView& view, int64_t i) {
  const uint8_t* p = view.bytes.data() + i * dtype_bytes(view.dtype);
  switch (view.dtype[0] * 16 + view.dtype[1]) {
    case 'f' * 16 + '4': return load_le<float>(p);
    case 'f' * 16 + '8': return load_le<double>(p);
    case 'i' * 16 + '1': return load_le<int8_t>(p);
    case 'i' * 16 + '2': return load_le<int16_t>(p);
    case 'i' * 16 + '4': return load_le<int32_t>(p);
    case 'i' * 16 + '8': return static_cast<double>(load_le<int64_t>(p));
    case 'u' * 16 + '1': return load_le<uint8_t>(p);
    case 'u' * 16 + '2': return load_le<uint16_t>(p);
    case 'u' * 16 + '4': return load_le<uint32_t>(p);
    case 'u' * 16 + '8': return static_cast<double>(load_le<uint64_t>(p));
    default: return std::numeric_limits<double>::quiet_NaN();
  }
}

// Multiplies the dims, or -1 past 2^62 or for a negative dim.
int64_t product(const std::vector<int64_t>& dims, size_t from = 0) {
  int64_t n = 1;
  for (size_t i = from; i < dims.size(); ++i) {
    if (dims[i] < 0 || (dims[i] > 0 && n > (int64_t{1} << 62) / dims[i])) return -1;
    n *= dims[i];
  }
  return n;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "(";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + ")";
}

// ---- .npy --------------------------------------------------------------------

// The value after 'key': in a .npy header dict, up to the next ',' or '}'
// outside parentheses.
std::string dict_value(const std::string& header, const std::string& key) {
  const std::string quoted = "'" + key + "'";
  size_t at = header.find(quoted);
  if (at == std::string::npos) return "";
  at = header.find(':', at + quoted.size());
  if (at == std::string::npos) return "";
  int depth = 0;
  size_t end = at + 1;
  for (; end < header.size(); ++end) {
    const char c = header[end];
    if (c == '(') ++depth;
    if (c == ')') --depth;
    if (depth == 0 && (c == ',' || c == '}')) break;
  }
  std::string value = header.substr(at + 1, end - at - 1);
  const auto space = [](char c) { return c == ' ' || c == '\t'; };
  while (!value.empty() && space(value.front())) value.erase(value.begin());
  while (!value.empty() && space(value.back())) value.pop_back();
  return value;
}

Result<ArrayView> parse_npy(std::span<const uint8_t> bytes, const std::string& name) {
  const auto bad = [&](const std::string& what) { return corrupt(name + ": not a NumPy array (" + what + ")"); };
  if (bytes.size() < 10 || std::memcmp(bytes.data(), "\x93NUMPY", 6) != 0) return bad("no \\x93NUMPY magic");
  const uint8_t major = bytes[6];
  size_t header_bytes = 0, start = 0;
  if (major == 1) {
    header_bytes = load_le<uint16_t>(bytes.data() + 8);
    start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) return bad("header cut short");
    header_bytes = load_le<uint32_t>(bytes.data() + 8);
    start = 12;
  } else {
    return bad("format version " + std::to_string(major));
  }
  if (header_bytes > bytes.size() - start || header_bytes > (size_t{1} << 20)) return bad("header longer than the file");
  const std::string header(reinterpret_cast<const char*>(bytes.data() + start), header_bytes);
  ArrayView view;
  std::string descr = dict_value(header, "descr");
  if (descr.size() < 5 || (descr.front() != '\'' && descr.front() != '"') || descr.back() != descr.front()) {
    return bad("no 'descr'");
  }
  descr = descr.substr(1, descr.size() - 2);
  if (descr.size() != 3 || (descr[0] != '<' && descr[0] != '|')) {
    return corrupt(name + ": element type '" + descr.substr(0, 16) +
                   "' is not one this reader takes (little-endian integers and float32/float64)");
  }
  view.dtype = descr.substr(1);
  if (dtype_bytes(view.dtype) == 0) {
    return corrupt(name + ": element type '" + descr + "' is not one this reader takes (integers, float32, float64)");
  }
  if (dict_value(header, "fortran_order") != "False") {
    return corrupt(name + ": the array is in Fortran order: save np.ascontiguousarray(a) instead");
  }
  const std::string shape = dict_value(header, "shape");
  if (shape.size() < 2 || shape.front() != '(' || shape.back() != ')') return bad("no 'shape'");
  size_t at = 1;
  while (at < shape.size() - 1) {
    while (at < shape.size() - 1 && (shape[at] == ' ' || shape[at] == ',')) ++at;
    if (at >= shape.size() - 1) break;
    int64_t dim = 0;
    size_t digits = 0;
    while (at < shape.size() - 1 && shape[at] >= '0' && shape[at] <= '9') {
      if (dim > (int64_t{1} << 50)) return bad("a dimension too large");
      dim = dim * 10 + (shape[at++] - '0');
      ++digits;
    }
    if (digits == 0) return bad("shape " + shape.substr(0, 64));
    view.shape.push_back(dim);
    if (static_cast<int64_t>(view.shape.size()) > kMaxArrayDims) return bad("more than 8 dimensions");
  }
  const int64_t elements = product(view.shape);
  const size_t data = start + header_bytes;
  const int64_t width = dtype_bytes(view.dtype);
  if (elements < 0 || elements > static_cast<int64_t>((bytes.size() - data) / static_cast<size_t>(width))) {
    return corrupt(name + ": shape " + shape_text(view.shape) + " of " + view.dtype + " needs more bytes than the " +
                   std::to_string(bytes.size() - data) + " that follow its header");
  }
  view.bytes = bytes.subspan(data, static_cast<size_t>(elements * width));
  return view;
}

// ---- .npz (a zip of .npy members) --------------------------------------------

Result<std::map<std::string, ArrayView>> parse_npz(std::span<const uint8_t> bytes, const std::string& name,
                                                   std::vector<std::vector<uint8_t>>& inflated) {
  std::map<std::string, ArrayView> arrays;
  size_t at = 0;
  const auto bad = [&](const std::string& what) {
    return corrupt(name + ": not a readable .npz (" + what + " at byte " + std::to_string(at) + ")");
  };
  while (at + 4 <= bytes.size() && load_le<uint32_t>(bytes.data() + at) == 0x04034b50) {
    if (at + 30 > bytes.size()) return bad("a member header cut short");
    const uint8_t* h = bytes.data() + at;
    const uint16_t flags = load_le<uint16_t>(h + 6), method = load_le<uint16_t>(h + 8);
    uint64_t packed = load_le<uint32_t>(h + 18), size = load_le<uint32_t>(h + 22);
    const size_t name_bytes = load_le<uint16_t>(h + 26), extra_bytes = load_le<uint16_t>(h + 28);
    if (at + 30 + name_bytes + extra_bytes > bytes.size()) return bad("a member name cut short");
    const std::string member(reinterpret_cast<const char*>(h + 30), name_bytes);
    if (flags & 1) return bad("encrypted member '" + member.substr(0, 64) + "'");
    // Zip64: the real sizes in the extra field (id 1), as NumPy writes them.
    const uint8_t* extra = h + 30 + name_bytes;
    for (size_t e = 0; e + 4 <= extra_bytes;) {
      const uint16_t id = load_le<uint16_t>(extra + e), length = load_le<uint16_t>(extra + e + 2);
      if (e + 4 + length > extra_bytes) break;
      if (id == 1) {
        size_t field = e + 4;
        const size_t end = e + 4 + length;
        if (size == 0xFFFFFFFFu && field + 8 <= end) {
          size = load_le<uint64_t>(extra + field);
          field += 8;
        }
        if (packed == 0xFFFFFFFFu && field + 8 <= end) packed = load_le<uint64_t>(extra + field);
      }
      e += 4 + length;
    }
    if (flags & 8 && packed == 0) return bad("member '" + member.substr(0, 64) + "' without sizes (a streamed zip)");
    const size_t data = at + 30 + name_bytes + extra_bytes;
    if (packed > bytes.size() - data) return bad("member '" + member.substr(0, 64) + "' longer than the file");
    std::span<const uint8_t> body = bytes.subspan(data, static_cast<size_t>(packed));
    if (method == 8) {
      if (size > (uint64_t{1} << 36)) return bad("member '" + member.substr(0, 64) + "' inflating past 64 GiB");
      // Deflate expands at most 1032:1, so a size beyond that is a lie: refuse it before allocating.
      if (size > packed * 1032 + 1024) {
        return bad("member '" + member.substr(0, 64) + "' claims " + std::to_string(size) + " bytes from " +
                   std::to_string(packed) + " deflated");
      }
      std::vector<uint8_t> out(static_cast<size_t>(size));
      z_stream z{};
      if (inflateInit2(&z, -MAX_WBITS) != Z_OK) return bad("zlib");
      z.next_in = const_cast<Bytef*>(body.data());
      z.next_out = out.data();
      size_t in_left = body.size(), out_left = out.size();
      int result = Z_OK;
      while (result == Z_OK) {  // zlib counts in 32-bit pieces: feed members past 4 GiB in turns
        if (z.avail_in == 0) {
          z.avail_in = static_cast<uInt>(std::min<size_t>(in_left, std::numeric_limits<uInt>::max()));
          in_left -= z.avail_in;
        }
        if (z.avail_out == 0) {
          z.avail_out = static_cast<uInt>(std::min<size_t>(out_left, std::numeric_limits<uInt>::max()));
          out_left -= z.avail_out;
        }
        result = inflate(&z, in_left == 0 && out_left == 0 ? Z_FINISH : Z_NO_FLUSH);
        if (result == Z_OK && z.avail_in == 0 && in_left == 0) break;  // input spent before the stream ended
        if (result == Z_OK && z.avail_out == 0 && out_left == 0) break;  // output full before the stream ended
      }
      const uint64_t produced = z.total_out;
      inflateEnd(&z);
      if (result != Z_STREAM_END || produced != size) return bad("member '" + member.substr(0, 64) + "' does not inflate");
      inflated.push_back(std::move(out));
      body = inflated.back();
    } else if (method != 0) {
      return bad("member '" + member.substr(0, 64) + "' compressed with method " + std::to_string(method));
    }
    if (member.size() > 4 && member.ends_with(".npy")) {
      Result<ArrayView> view = parse_npy(body, name + ":" + member);
      if (!view.is_ok()) return view.status();
      arrays[member.substr(0, member.size() - 4)] = *view;
    }
    at = data + static_cast<size_t>(packed);
  }
  if (arrays.empty()) return bad("no .npy member");
  return arrays;
}

// ---- safetensors --------------------------------------------------------------

Result<std::map<std::string, ArrayView>> parse_safetensors(std::span<const uint8_t> bytes, const std::string& name) {
  const auto bad = [&](const std::string& what) { return corrupt(name + ": not a readable safetensors file (" + what + ")"); };
  if (bytes.size() < 10) return bad("shorter than its header");
  const uint64_t header_bytes = load_le<uint64_t>(bytes.data());
  if (header_bytes > bytes.size() - 8 || header_bytes > (uint64_t{100} << 20)) return bad("header longer than the file");
  const nlohmann::json header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<long>(header_bytes),
                                                      nullptr, false);
  if (!header.is_object()) return bad("its header is not a JSON object");
  const std::span<const uint8_t> data = bytes.subspan(8 + header_bytes);
  static const std::map<std::string, std::string> kTypes = {{"F32", "f4"}, {"F64", "f8"}, {"U8", "u1"}, {"I8", "i1"},
                                                           {"I16", "i2"}, {"I32", "i4"}, {"I64", "i8"}, {"U16", "u2"},
                                                           {"U32", "u4"}, {"U64", "u8"}};
  std::map<std::string, ArrayView> arrays;
  for (const auto& [key, tensor] : header.items()) {
    if (key == "__metadata__") continue;
    const std::string shown = "tensor '" + key.substr(0, 64) + "'";
    if (!tensor.is_object() || !tensor.contains("dtype") || !tensor["dtype"].is_string() || !tensor.contains("shape") ||
        !tensor["shape"].is_array() || !tensor.contains("data_offsets") || !tensor["data_offsets"].is_array() ||
        tensor["data_offsets"].size() != 2) {
      return bad(shown + " lacks dtype, shape or data_offsets");
    }
    const auto type = kTypes.find(tensor["dtype"].get<std::string>());
    if (type == kTypes.end()) {
      return corrupt(name + ": " + shown + " is of " + tensor["dtype"].get<std::string>().substr(0, 16) +
                     ", not one this reader takes (integers, F32, F64): convert it first");
    }
    ArrayView view;
    view.dtype = type->second;
    if (tensor["shape"].size() > static_cast<size_t>(kMaxArrayDims)) return bad(shown + " has more than 8 dimensions");
    for (const nlohmann::json& d : tensor["shape"]) {
      if (!d.is_number_unsigned()) return bad(shown + ": a dimension is not a non-negative integer");
      view.shape.push_back(static_cast<int64_t>(std::min<uint64_t>(d.get<uint64_t>(), uint64_t{1} << 62)));
    }
    const nlohmann::json& offsets = tensor["data_offsets"];
    if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) return bad(shown + ": bad data_offsets");
    const uint64_t begin = offsets[0], end = offsets[1];
    const int64_t elements = product(view.shape);
    if (begin > end || end > data.size() || elements < 0 ||
        static_cast<uint64_t>(elements) * static_cast<uint64_t>(dtype_bytes(view.dtype)) != end - begin) {
      return bad(shown + ": data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                 ") do not hold shape " + shape_text(view.shape) + " inside the file");
    }
    view.bytes = data.subspan(static_cast<size_t>(begin), static_cast<size_t>(end - begin));
    arrays[key] = view;
  }
  return arrays;
}

// ---- The file, mapped ------------------------------------------------------------

struct MappedArrays {
  std::string path;
  void* map = nullptr;
  size_t size = 0;
  std::vector<std::vector<uint8_t>> inflated;
  std::map<std::string, ArrayView> arrays;
  ~MappedArrays() {
    if (map != nullptr) ::munmap(map, size);
  }
};

Result<std::shared_ptr<MappedArrays>> map_arrays(const std::string& path) {
  auto mapped = std::make_shared<MappedArrays>();
  mapped->path = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return not_found(path + ": no such file");
    return io_error(path + ": cannot open: " + std::strerror(errno));
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    return invalid_argument(path + ": not a regular file");
  }
  if (info.st_size <= 0 || info.st_size > kMaxArrayFileBytes) {
    ::close(fd);
    return corrupt(path + ": " + std::to_string(info.st_size) + " bytes: empty or over 1 TiB");
  }
  mapped->size = static_cast<size_t>(info.st_size);
  mapped->map = ::mmap(nullptr, mapped->size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (mapped->map == MAP_FAILED) {
    mapped->map = nullptr;
    return io_error(path + ": cannot map: " + std::strerror(errno));
  }
  Result<std::map<std::string, ArrayView>> arrays = parse_array_file(
      {static_cast<const uint8_t*>(mapped->map), mapped->size}, path, mapped->inflated);
  if (!arrays.is_ok()) return arrays.status();
  mapped->arrays = std::move(*arrays);
  return mapped;
}

// One split: rows of x (converted per batch) and their class ids.
class ArraySet final : public Dataset {
 public:
  ArraySet(std::shared_ptr<const MappedArrays> source, ArrayView x, std::vector<int64_t> rows,
           std::vector<int32_t> labels, std::vector<float> mean, std::vector<float> std)
      : source_(std::move(source)), x_(std::move(x)), rows_(std::move(rows)), labels_(std::move(labels)),
        mean_(std::move(mean)), std_(std::move(std)), features_(product(x_.shape, 1)) {}
  // Regression: one standardized target per row in `values`, its unit `scale`.
  ArraySet(std::shared_ptr<const MappedArrays> source, ArrayView x, std::vector<int64_t> rows,
           std::vector<float> values, double scale, std::vector<float> mean, std::vector<float> std)
      : ArraySet(std::move(source), std::move(x), std::move(rows), {}, std::move(mean), std::move(std)) {
    values_ = std::move(values);
    scale_ = scale;
    regression_ = true;
  }
  bool regression() const override { return regression_; }
  double target_scale() const override { return scale_; }
  void batch_values(std::span<const int64_t> indices, std::vector<float>& values) const override {
    values.clear();
    if (!regression_) return;
    for (const int64_t i : indices) {
      FEDMESH_CHECK(i >= 0 && i < size(), "sample index out of range");
      values.push_back(values_[static_cast<size_t>(i)]);
    }
  }
  int64_t size() const override { return static_cast<int64_t>(rows_.size()); }
  void make_batch(std::span<const int64_t> indices, DType dtype, Tensor& inputs,
                  std::vector<int32_t>& targets) const override {
    Shape shape(x_.shape.begin(), x_.shape.end());
    shape[0] = static_cast<int64_t>(indices.size());
    Tensor::reuse(inputs, shape, dtype);
    targets.resize(regression_ ? 0 : indices.size());
    visit_dtype(dtype, [&]<class T>() {
      T* out = inputs.data<T>();
      for (size_t i = 0; i < indices.size(); ++i) {
        FEDMESH_CHECK(indices[i] >= 0 && indices[i] < size(), "sample index out of range");
        const int64_t row = rows_[static_cast<size_t>(indices[i])];
        for (int64_t j = 0; j < features_; ++j) {
          double v = element(x_, row * features_ + j);
          if (!mean_.empty()) v = (v - mean_[static_cast<size_t>(j)]) / std_[static_cast<size_t>(j)];
          out[static_cast<int64_t>(i) * features_ + j] = from_float<T>(static_cast<float>(v));
        }
        if (!regression_) targets[i] = labels_[static_cast<size_t>(indices[i])];
      }
    });
  }

 private:
  std::shared_ptr<const MappedArrays> source_;  // keeps the mapping x_ points into
  ArrayView x_;
  std::vector<int64_t> rows_;
  std::vector<int32_t> labels_;
  std::vector<float> mean_, std_;
  int64_t features_;
  std::vector<float> values_;  // regression
  double scale_ = 1.0;
  bool regression_ = false;
};

// x and y of a file, checked: x (N, ...) numeric, y (N) integers (or, for
// regression, any numbers).
Status check_pair(const MappedArrays& file, bool regression, const ArrayView*& x, const ArrayView*& y) {
  const auto found_x = file.arrays.find("x"), found_y = file.arrays.find("y");
  if (found_x == file.arrays.end() || found_y == file.arrays.end()) {
    std::string names;
    for (const auto& [name, view] : file.arrays) names += (names.empty() ? "'" : ", '") + name.substr(0, 32) + "'";
    return invalid_argument(file.path + ": needs arrays 'x' (samples) and 'y' (class ids); it holds " + names +
                            " (np.savez(FILE, x=samples, y=labels))");
  }
  x = &found_x->second;
  y = &found_y->second;
  if (x->shape.size() < 2 || x->shape[0] < 1 || product(x->shape, 1) < 1) {
    return invalid_argument(file.path + ": x has shape " + shape_text(x->shape) + "; samples need (N, ...) with N >= 1");
  }
  if (product(x->shape, 1) > (int64_t{1} << 24)) {
    return invalid_argument(file.path + ": a sample of x has " + std::to_string(product(x->shape, 1)) +
                            " values, more than 2^24");
  }
  if (y->shape.size() != 1 || y->shape[0] != x->shape[0]) {
    return invalid_argument(file.path + ": y has shape " + shape_text(y->shape) + "; it needs (" +
                            std::to_string(x->shape[0]) + "), one class id per row of x");
  }
  if (y->dtype[0] == 'f' && !regression) {
    return invalid_argument(file.path + ": y holds floats; class ids are integers (a real-valued target: data.task = "
                            "\"regression\")");
  }
  return Status::ok();
}

// Regression: y's values of the rows, finite, standardized by the training
// rows' mean and std under normalize "standard"; schema classes 1.
Result<LoadedData> regression_arrays(const ArraysSpec& spec, std::shared_ptr<MappedArrays> train_file, const ArrayView& x,
                                     const ArrayView& y, std::shared_ptr<MappedArrays> test_file,
                                     const ArrayView& test_x, const ArrayView& test_y,
                                     const std::vector<int64_t>& train_rows, const std::vector<int64_t>& test_rows,
                                     std::vector<float> mean, std::vector<float> std) {
  const auto values_of = [](const ArrayView& target, const std::string& path, const std::vector<int64_t>& rows,
                            std::vector<double>& out) -> Status {
    for (const int64_t r : rows) {
      const double v = element(target, r);
      if (!std::isfinite(v) || std::fabs(v) > 3.0e38) {
        return invalid_argument(path + ": y[" + std::to_string(r) + "] is not a finite 32-bit number");
      }
      out.push_back(v);
    }
    return Status::ok();
  };
  std::vector<double> train_values, test_values;
  FEDMESH_RETURN_IF_ERROR(values_of(y, spec.path, train_rows, train_values));
  FEDMESH_RETURN_IF_ERROR(values_of(test_y, spec.test_path.empty() ? spec.path : spec.test_path, test_rows, test_values));
  double center = 0.0, scale = 1.0;
  if (spec.normalize == "standard") {
    double sum = 0.0, squares = 0.0;
    for (const double v : train_values) sum += v;
    center = sum / static_cast<double>(train_values.size());
    for (const double v : train_values) squares += (v - center) * (v - center);
    const double deviation = std::sqrt(squares / static_cast<double>(train_values.size()));
    scale = deviation > 0.0 ? deviation : 1.0;
  }
  const auto standardized = [&](const std::vector<double>& values) {
    std::vector<float> out;
    for (const double v : values) out.push_back(static_cast<float>((v - center) / scale));
    return out;
  };
  LoadedData data;
  data.train = std::make_unique<ArraySet>(train_file, x, train_rows, standardized(train_values), scale, mean, std);
  data.test = std::make_unique<ArraySet>(test_file, test_x, test_rows, standardized(test_values), scale, mean, std);
  data.schema.sample_shape.assign(x.shape.begin() + 1, x.shape.end());
  data.schema.classes = 1;
  data.schema.regression = true;
  data.schema.canonical = "arrays v1 x=" + shape_text(data.schema.sample_shape) + " task=regression normalize=" +
                          spec.normalize;
  data.description = std::to_string(train_rows.size()) + " samples of " +
                     std::filesystem::path(spec.path).filename().string() + " (" + std::to_string(test_rows.size()) +
                     " test), x " + shape_text(x.shape) + " " + x.dtype + ", regression on y";
  return data;
}

}  // namespace

int64_t ArrayView::elements() const { return product(shape); }

double ArrayView::value(int64_t i) const { return element(*this, i); }

Result<std::map<std::string, ArrayView>> parse_array_file(std::span<const uint8_t> bytes, const std::string& name,
                                                          std::vector<std::vector<uint8_t>>& inflated) {
  if (bytes.size() >= 4 && load_le<uint32_t>(bytes.data()) == 0x04034b50) return parse_npz(bytes, name, inflated);
  if (bytes.size() >= 6 && std::memcmp(bytes.data(), "\x93NUMPY", 6) == 0) {
    Result<ArrayView> view = parse_npy(bytes, name);
    if (!view.is_ok()) return view.status();
    return std::map<std::string, ArrayView>{{"x", *view}};
  }
  if (bytes.size() >= 9 && bytes[8] == '{') return parse_safetensors(bytes, name);
  return corrupt(name + ": neither .npz, .npy nor safetensors (its first bytes say none of them)");
}

Result<LoadedData> load_arrays(const ArraysSpec& spec) {
  if (spec.normalize != "standard" && spec.normalize != "none") {
    return invalid_argument(spec.path + ": data.normalize must be standard or none for arrays, not '" + spec.normalize + "'");
  }
  Result<std::shared_ptr<MappedArrays>> train_file = map_arrays(spec.path);
  if (!train_file.is_ok()) return train_file.status();
  const ArrayView *x = nullptr, *y = nullptr;
  FEDMESH_RETURN_IF_ERROR(check_pair(**train_file, spec.regression, x, y));
  if (spec.regression && !spec.classes.empty()) {
    return invalid_argument(spec.path + ": data.classes is for classification; a regression target has no classes");
  }
  std::shared_ptr<MappedArrays> test_file = *train_file;
  const ArrayView *test_x = x, *test_y = y;
  if (!spec.test_path.empty()) {
    Result<std::shared_ptr<MappedArrays>> opened = map_arrays(spec.test_path);
    if (!opened.is_ok()) return opened.status();
    test_file = *opened;
    FEDMESH_RETURN_IF_ERROR(check_pair(*test_file, spec.regression, test_x, test_y));
    if (std::vector<int64_t>(test_x->shape.begin() + 1, test_x->shape.end()) !=
        std::vector<int64_t>(x->shape.begin() + 1, x->shape.end())) {
      return invalid_argument(spec.test_path + ": samples of shape " + shape_text(test_x->shape) + ", the training "
                              "arrays' are " + shape_text(x->shape));
    }
  }
  // Class ids: in [0, K), K from the class names or the largest id.
  int64_t classes = static_cast<int64_t>(spec.classes.size());
  const auto read_labels = [&](const ArrayView& labels, const std::string& path, std::vector<int32_t>& out) -> Status {
    out.resize(static_cast<size_t>(labels.shape[0]));
    for (int64_t i = 0; i < labels.shape[0]; ++i) {
      const double id = element(labels, i);
      if (!(id >= 0) || id > 1e6 || (!spec.classes.empty() && id >= static_cast<double>(classes))) {
        return invalid_argument(path + ": y[" + std::to_string(i) + "] is " + std::to_string(static_cast<int64_t>(id)) +
                                ", not a class id in [0, " +
                                (spec.classes.empty() ? std::string("1000000") : std::to_string(classes)) + ")");
      }
      out[static_cast<size_t>(i)] = static_cast<int32_t>(id);
    }
    return Status::ok();
  };
  std::vector<int32_t> train_labels, test_labels;
  if (!spec.regression) {
    FEDMESH_RETURN_IF_ERROR(read_labels(*y, spec.path, train_labels));
    if (!spec.test_path.empty()) FEDMESH_RETURN_IF_ERROR(read_labels(*test_y, spec.test_path, test_labels));
  }
  if (spec.classes.empty() && !spec.regression) {
    for (int32_t id : train_labels) classes = std::max<int64_t>(classes, id + 1);
    for (int32_t id : test_labels) {
      if (id >= classes) {
        return invalid_argument(spec.test_path + ": class id " + std::to_string(id) + " is not among the training "
                                "ids [0, " + std::to_string(classes) + "): name the classes (data.classes)");
      }
    }
  }
  // The split.
  const int64_t n = x->shape[0];
  std::vector<int64_t> train_rows, test_rows;
  if (spec.test_path.empty()) {
    if (!(spec.test_fraction > 0.0 && spec.test_fraction < 1.0) || n < 2) {
      return invalid_argument(spec.path + ": " + std::to_string(n) + " rows cannot be split with test fraction " +
                              std::to_string(spec.test_fraction));
    }
    std::vector<int64_t> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    Rng rng(spec.seed);
    rng.shuffle(std::span<int64_t>(order));
    const int64_t tests = std::clamp<int64_t>(std::llround(static_cast<double>(n) * spec.test_fraction), 1, n - 1);
    test_rows.assign(order.begin(), order.begin() + tests);
    train_rows.assign(order.begin() + tests, order.end());
    std::sort(test_rows.begin(), test_rows.end());
    std::sort(train_rows.begin(), train_rows.end());
  } else {
    train_rows.resize(static_cast<size_t>(n));
    std::iota(train_rows.begin(), train_rows.end(), 0);
    test_rows.resize(static_cast<size_t>(test_x->shape[0]));
    std::iota(test_rows.begin(), test_rows.end(), 0);
  }
  if (spec.train_limit > 0 && static_cast<int64_t>(train_rows.size()) > spec.train_limit) train_rows.resize(static_cast<size_t>(spec.train_limit));
  if (spec.test_limit > 0 && static_cast<int64_t>(test_rows.size()) > spec.test_limit) test_rows.resize(static_cast<size_t>(spec.test_limit));
  const auto labels_of = [](const std::vector<int32_t>& all, const std::vector<int64_t>& rows) {
    std::vector<int32_t> out;
    for (int64_t r : rows) out.push_back(all[static_cast<size_t>(r)]);
    return out;
  };
  // Standardization per feature from the training rows (one pass, in double).
  const int64_t features = product(x->shape, 1);
  std::vector<float> mean, std;
  if (spec.normalize == "standard") {
    std::vector<double> sum(static_cast<size_t>(features), 0.0), squares(static_cast<size_t>(features), 0.0);
    for (int64_t r : train_rows) {
      for (int64_t j = 0; j < features; ++j) {
        const double v = element(*x, r * features + j);
        if (!std::isfinite(v)) {
          return invalid_argument(spec.path + ": x[" + std::to_string(r) + "] holds a value that is not finite");
        }
        sum[static_cast<size_t>(j)] += v;
        squares[static_cast<size_t>(j)] += v * v;
      }
    }
    const double count = static_cast<double>(train_rows.size());
    for (int64_t j = 0; j < features; ++j) {
      const double m = sum[static_cast<size_t>(j)] / count;
      const double s = std::sqrt(std::max(0.0, squares[static_cast<size_t>(j)] / count - m * m));
      mean.push_back(static_cast<float>(m));
      std.push_back(static_cast<float>(s > 0.0 ? s : 1.0));
    }
  }
  LoadedData data;
  if (spec.regression) return regression_arrays(spec, *train_file, *x, *y, test_file, *test_x, *test_y, train_rows,
                                                test_rows, std::move(mean), std::move(std));
  const std::vector<int32_t> train_targets = labels_of(train_labels, train_rows);
  const std::vector<int32_t> test_targets =
      labels_of(spec.test_path.empty() ? train_labels : test_labels, test_rows);
  data.train = std::make_unique<ArraySet>(*train_file, *x, train_rows, train_targets, mean, std);
  data.test = std::make_unique<ArraySet>(test_file, *test_x, test_rows, test_targets, mean, std);
  data.schema.sample_shape.assign(x->shape.begin() + 1, x->shape.end());
  data.schema.classes = classes;
  std::string names;
  for (int64_t c = 0; c < classes; ++c) {
    const std::string shown = spec.classes.empty() ? std::to_string(c) : spec.classes[static_cast<size_t>(c)];
    names += (c ? "," : "") + nlohmann::json(shown).dump();
  }
  data.schema.canonical = "arrays v1 x=" + shape_text(data.schema.sample_shape) + " classes=[" + names +
                          "] normalize=" + spec.normalize;
  data.description = std::to_string(train_rows.size()) + " samples of " +
                     std::filesystem::path(spec.path).filename().string() + " (" + std::to_string(test_rows.size()) +
                     " test), x " + shape_text(x->shape) + " " + x->dtype + ", " + std::to_string(classes) + " classes";
  return data;
}

}  // namespace fedmesh::train::data
