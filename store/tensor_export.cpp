#include "store/tensor_export.h"

#include <fcntl.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include <nlohmann/json.hpp>

#include "base/file_io.h"
#include "kernels/half.h"

namespace fedmesh::store {

namespace {

// A file written under a temporary name in the same directory and renamed
// into place only by commit(); dropped uncommitted, the temporary is removed.
class StagedFile {
 public:
  static Result<StagedFile> create(const std::filesystem::path& file) {
    StagedFile staged;
    staged.file_ = file;
    staged.temporary_ = file;
    staged.temporary_ += ".partial-" + std::to_string(::getpid());
    staged.fd_ = ::open(staged.temporary_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (staged.fd_ < 0) return io_error(staged.temporary_.string() + ": cannot create: " + errno_text(errno));
    return staged;
  }
  StagedFile(StagedFile&& other) noexcept
      : file_(std::move(other.file_)), temporary_(std::move(other.temporary_)), fd_(std::exchange(other.fd_, -1)) {}
  StagedFile& operator=(StagedFile&&) = delete;
  ~StagedFile() {
    if (fd_ >= 0) {
      ::close(fd_);
      std::error_code ignored;
      std::filesystem::remove(temporary_, ignored);
    }
  }

  Status write(std::span<const uint8_t> bytes) {
    while (!bytes.empty()) {
      const ssize_t written = ::write(fd_, bytes.data(), bytes.size());
      if (written < 0) {
        if (errno == EINTR) continue;
        return io_error(temporary_.string() + ": write failed: " + errno_text(errno));
      }
      bytes = bytes.subspan(static_cast<size_t>(written));
    }
    return Status::ok();
  }
  Status write(std::string_view text) { return write({reinterpret_cast<const uint8_t*>(text.data()), text.size()}); }

  Status commit() {
    if (::fsync(fd_) != 0) return io_error(temporary_.string() + ": fsync failed: " + errno_text(errno));
    if (::close(std::exchange(fd_, -1)) != 0) {
      std::error_code ignored;
      std::filesystem::remove(temporary_, ignored);
      return io_error(temporary_.string() + ": close failed: " + errno_text(errno));
    }
    std::error_code error;
    std::filesystem::rename(temporary_, file_, error);
    if (error) {
      std::filesystem::remove(temporary_, error);
      return io_error(file_.string() + ": cannot rename into place: " + error.message());
    }
    return Status::ok();
  }

 private:
  StagedFile() = default;
  std::filesystem::path file_, temporary_;
  int fd_ = -1;
};

const char* safetensors_dtype(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kF32: break;
  }
  return "F32";
}

std::string exported_name(const TensorInfo& tensor, std::string_view role) {
  return role.empty() ? tensor.role + "/" + tensor.name : tensor.name;
}

// A file name from a tensor name: letters, digits, '.', '-' and '_' kept,
// anything else (a '/' in particular) replaced by '_'.
std::string file_stem(std::string_view name) {
  std::string stem(name);
  for (char& c : stem) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '_') c = '_';
  }
  if (stem.empty() || stem[0] == '.') stem.insert(stem.begin(), '_');
  return stem;
}

std::string npy_header(const TensorInfo& tensor) {
  std::string shape = "(";
  for (size_t i = 0; i < tensor.shape.size(); ++i) {
    shape += std::to_string(tensor.shape[i]);
    shape += (tensor.shape.size() == 1 || i + 1 < tensor.shape.size()) ? "," : "";
    if (i + 1 < tensor.shape.size()) shape += ' ';
  }
  shape += ")";
  const char* descr = tensor.dtype == DType::kF16 ? "<f2" : "<f4";
  std::string dict = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  // magic (6) + version (2) + length (2) + dict + padding + '\n' is a multiple of 64.
  const size_t unpadded = 10 + dict.size() + 1;
  dict.append((64 - unpadded % 64) % 64, ' ');
  dict += '\n';
  std::string header = "\x93NUMPY";
  header += static_cast<char>(1);
  header += static_cast<char>(0);
  header += static_cast<char>(dict.size() & 0xff);
  header += static_cast<char>((dict.size() >> 8) & 0xff);
  return header + dict;
}

Status write_npy(CheckpointStore& store, const TensorInfo& tensor, const std::filesystem::path& file) {
  Result<StagedFile> staged = StagedFile::create(file);
  if (!staged.is_ok()) return staged.status();
  FEDMESH_RETURN_IF_ERROR(staged->write(npy_header(tensor)));
  std::vector<float> widened;
  FEDMESH_RETURN_IF_ERROR(store.read_tensor(tensor, [&](std::span<const uint8_t> bytes) -> Status {
    if (tensor.dtype != DType::kBF16) return staged->write(bytes);
    widened.resize(bytes.size() / sizeof(bf16));
    for (size_t i = 0; i < widened.size(); ++i) {
      bf16 value;
      std::memcpy(&value, bytes.data() + i * sizeof(bf16), sizeof(bf16));
      widened[i] = to_float(value);
    }
    return staged->write({reinterpret_cast<const uint8_t*>(widened.data()), widened.size() * sizeof(float)});
  }));
  return staged->commit();
}

}  // namespace

Result<ExportFormat> parse_export_format(std::string_view text) {
  if (text == "safetensors") return ExportFormat::kSafetensors;
  if (text == "npy") return ExportFormat::kNpy;
  return invalid_argument("unknown export format '" + std::string(text) + "' (expected safetensors or npy)");
}

Result<ExportSummary> export_round(CheckpointStore& store, int64_t round, std::string_view role, ExportFormat format,
                                   const std::filesystem::path& out, const ExportLayout& layout,
                                   const std::map<std::string, std::string>& metadata) {
  Result<RoundInfo> info = store.round_info(round);
  if (!info.is_ok()) return info.status();
  Result<std::vector<TensorInfo>> all = store.tensors(round);
  if (!all.is_ok()) return all.status();
  std::vector<TensorInfo> chosen;
  for (TensorInfo& tensor : *all) {
    if (role.empty() || tensor.role == role) chosen.push_back(std::move(tensor));
  }
  if (chosen.empty()) {
    return not_found("round " + std::to_string(round) + " holds no tensors" +
                     (role.empty() ? std::string() : " with role '" + std::string(role) + "'"));
  }
  ExportSummary summary;
  summary.tensors = static_cast<int64_t>(chosen.size());

  if (format == ExportFormat::kNpy) {
    if (layout) return invalid_argument("an export layout is written as safetensors only");
    std::error_code error;
    std::filesystem::create_directories(out, error);
    if (error) return io_error(out.string() + ": cannot create the export directory: " + error.message());
    std::set<std::string> stems;
    for (const TensorInfo& tensor : chosen) {
      const std::string stem = file_stem(exported_name(tensor, role));
      if (!stems.insert(stem).second) {
        return invalid_argument("two tensors map to the same file name " + stem + ".npy; export them with safetensors");
      }
      const std::filesystem::path file = out / (stem + ".npy");
      Status s = write_npy(store, tensor, file);
      if (!s.is_ok()) return Status(s.code(), "round " + std::to_string(round) + ": " + s.message());
      summary.files.push_back(file);
      summary.bytes += tensor.byte_size;
    }
    FEDMESH_RETURN_IF_ERROR(fsync_directory(out));
    return summary;
  }

  std::map<std::string, std::string> file_metadata = {{"round", std::to_string(info->round)},
                                                       {"model_version", std::to_string(info->model_version)},
                                                       {"metrics", info->metrics_json}};
  for (const auto& [key, value] : metadata) file_metadata[key] = value;
  std::vector<SafetensorsEntry> entries;
  for (const TensorInfo& tensor : chosen) {
    const std::string name = exported_name(tensor, role);
    for (ExportedArray& as : layout ? layout(name) : std::vector<ExportedArray>{{name, false}}) {
      entries.push_back({std::move(as.name), tensor.dtype, tensor.shape, as.transposed,
                         [&store, &tensor](const std::function<Status(std::span<const uint8_t>)>& consume) {
                           return store.read_tensor(tensor, consume);
                         }});
    }
  }
  if (entries.empty()) return not_found("round " + std::to_string(round) + ": the layout leaves no tensor to write");
  Result<ExportSummary> written = write_safetensors(out, entries, file_metadata);
  if (!written.is_ok()) {
    return Status(written.status().code(), "round " + std::to_string(round) + ": " + written.status().message());
  }
  return written;
}

Result<ExportSummary> write_safetensors(const std::filesystem::path& out, const std::vector<SafetensorsEntry>& entries,
                                        const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  header["__metadata__"] = {{"format", "pt"}, {"producer", "fedmesh"}};
  for (const auto& [key, value] : metadata) header["__metadata__"][key] = value;
  int64_t offset = 0;
  for (const SafetensorsEntry& entry : entries) {
    if (entry.transposed && entry.shape.size() != 2) {
      return invalid_argument(entry.name + " is " + std::to_string(entry.shape.size()) + "-D: only a 2-D tensor transposes");
    }
    if (header.contains(entry.name)) return invalid_argument("tensor name " + entry.name + " appears twice");
    Shape shape = entry.shape;
    if (entry.transposed) std::swap(shape[0], shape[1]);
    const int64_t bytes = shape_numel(entry.shape) * static_cast<int64_t>(dtype_size(entry.dtype));
    header[entry.name] = {{"dtype", safetensors_dtype(entry.dtype)}, {"shape", shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  Result<StagedFile> staged = StagedFile::create(out);
  if (!staged.is_ok()) return staged.status();
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(static_cast<uint64_t>(header_text.size()) >> (8 * i));
  FEDMESH_RETURN_IF_ERROR(staged->write(length));
  FEDMESH_RETURN_IF_ERROR(staged->write(header_text));
  ExportSummary summary;
  for (const SafetensorsEntry& entry : entries) {
    const size_t size = dtype_size(entry.dtype);
    const auto expected = static_cast<size_t>(shape_numel(entry.shape)) * size;
    size_t seen = 0;
    Status s;
    if (!entry.transposed) {
      s = entry.read([&](std::span<const uint8_t> bytes) {
        seen += bytes.size();
        return staged->write(bytes);
      });
    } else {  // the whole tensor in memory, then its transpose
      std::vector<uint8_t> stored;
      stored.reserve(expected);
      s = entry.read([&](std::span<const uint8_t> bytes) {
        stored.insert(stored.end(), bytes.begin(), bytes.end());
        return Status::ok();
      });
      seen = stored.size();
      if (s.is_ok() && seen == expected) {
        const int64_t rows = entry.shape[0], cols = entry.shape[1];
        std::vector<uint8_t> transposed(stored.size());
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c) {
            std::memcpy(transposed.data() + static_cast<size_t>(c * rows + r) * size,
                        stored.data() + static_cast<size_t>(r * cols + c) * size, size);
          }
        }
        s = staged->write(std::span<const uint8_t>(transposed));
      }
    }
    if (!s.is_ok()) return s;
    if (seen != expected) {
      return corrupt(entry.name + ": " + std::to_string(seen) + " bytes for its shape's " + std::to_string(expected));
    }
    summary.bytes += static_cast<int64_t>(expected);
  }
  summary.tensors = static_cast<int64_t>(entries.size());
  FEDMESH_RETURN_IF_ERROR(staged->commit());
  const std::filesystem::path directory = out.has_parent_path() ? out.parent_path() : std::filesystem::path(".");
  FEDMESH_RETURN_IF_ERROR(fsync_directory(directory));
  summary.files.push_back(out);
  return summary;
}

}  // namespace fedmesh::store
