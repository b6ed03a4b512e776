// Exports a committed round's tensors in formats other tools read without
// fedmesh and without pickle: safetensors (one file; PyTorch loads it with
// safetensors.torch.load_file, NumPy by reading the JSON header) and NumPy
// .npy (one file per tensor in a directory; numpy.load(..., allow_pickle=False)).
//
// safetensors layout: u64 little-endian N, then an N-byte JSON header
// {"__metadata__": {...strings...}, NAME: {"dtype": "F32"|"BF16"|"F16",
// "shape": [...], "data_offsets": [BEGIN, END]}, ...} padded with spaces to a
// multiple of 8, then the tensors' bytes back to back (offsets count from the
// end of the header).
//
// .npy (format version 1.0): "\x93NUMPY", 1, 0, u16 little-endian header
// length, then a Python dict literal {'descr': '<f4', 'fortran_order': False,
// 'shape': (784, 512), } padded with spaces and ending in '\n' so that the data
// starts at a multiple of 64 bytes. NumPy has no bfloat16, so bf16 tensors
// are widened to float32 (exactly) in .npy files.
//
// Tensor bytes are streamed chunk by chunk from the store and verified
// against their checksums; files are written under a temporary name, fsynced
// and renamed, so a failed or interrupted export leaves no partial file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "store/checkpoint_store.h"

namespace fedmesh::store {

enum class ExportFormat { kSafetensors, kNpy };

// "safetensors" | "npy"
Result<ExportFormat> parse_export_format(std::string_view text);

struct ExportSummary {
  std::vector<std::filesystem::path> files;
  int64_t tensors = 0;
  int64_t bytes = 0;  // tensor bytes written
};

// How a safetensors export names and lays out what it writes: each tensor
// (by its exported name) becomes the arrays returned, each renamed and, for
// a 2-D tensor, maybe transposed; none leaves it out. Another framework's
// layout (train/hf_gpt2.h) is one. Unset: every tensor as it is stored.
struct ExportedArray {
  std::string name;
  bool transposed = false;
};
using ExportLayout = std::function<std::vector<ExportedArray>(const std::string& name)>;

// Writes the tensors of `round` whose role is `role` ("model" for the
// weights; "" for every role, names then prefixed "ROLE/") to `out`: a file
// for safetensors, a directory (created if missing) for npy. `layout` only
// with safetensors; `metadata` entries join the file's __metadata__.
Result<ExportSummary> export_round(CheckpointStore& store, int64_t round, std::string_view role, ExportFormat format,
                                   const std::filesystem::path& out, const ExportLayout& layout = {},
                                   const std::map<std::string, std::string>& metadata = {});

// One tensor of a safetensors file: its name and dtype as written, its
// shape as read (a transposed 2-D entry is written (cols, rows)), and how
// to read its row-major bytes (in pieces, handed to the consumer).
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  bool transposed = false;
  std::function<Status(const std::function<Status(std::span<const uint8_t>)>& consume)> read;
};

// Writes `entries` in order as one safetensors file (staged, fsynced and
// renamed as above), `metadata` in its __metadata__ beside format "pt" and
// producer "fedmesh". export_round writes through it; so does a merged
// LoRA export (train/lora_export.h), whose tensors are in memory.
Result<ExportSummary> write_safetensors(const std::filesystem::path& out, const std::vector<SafetensorsEntry>& entries,
                                        const std::map<std::string, std::string>& metadata = {});

}  // namespace fedmesh::store
