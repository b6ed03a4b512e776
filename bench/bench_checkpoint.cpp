// How long does committing one checkpoint take, and how large is the store,
// next to writing the same bytes to a plain file with fsync?  The
// target: a commit within 1.5x of the plain file write, for 10M and 100M fp32
// parameters.  Both are measured in the same run, in the same directory.
//
//   plain file   write() in 1 MiB pieces to a new file, fsync, close; and an
//                overwrite of an existing file of that size (as a store that
//                reuses its pages would do)
//   blake2bp     the checksum alone (crypto::tree_hash, BLAKE2bp-256, what the
//                store computes on a second thread) over the same bytes
//   commit       CheckpointStore::commit_round of the tensors (one transaction,
//                WAL, synchronous=FULL), --rounds times in a row so that
//                retention and page reuse are in steady state
//   wal copy     settle() after each commit: SQLite copying the log
//                into the database file, which the store's background thread
//                does while training goes on (here it is waited for, so the
//                next commit starts from a quiet disk)
//
// Columns: medians over the rounds (min s: the fastest commit); commit/f and
// +wal/f are the median commit (and commit plus copy) over the median plain
// file write; db/bytes is the store's size (database + log) over one round's
// tensor bytes, with keep_last 3 rounds kept.
//
// A plain program: prints a table, one line per size.  See --help.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "base/random.h"
#include "crypto/tree_hash.h"
#include "crypto/update_signature.h"
#include "store/checkpoint_store.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

double minimum(const std::vector<double>& values) { return *std::min_element(values.begin(), values.end()); }

// A model of about `parameters` fp32 values split as real models are: a few
// large matrices (embeddings, MLP weights) and many small vectors (biases, norms).
std::vector<fedmesh::Tensor> make_model(int64_t parameters, uint64_t seed) {
  fedmesh::Rng rng(seed);
  std::vector<fedmesh::Tensor> tensors;
  int64_t left = parameters;
  const int64_t width = 1024;
  while (left > 0) {
    const int64_t rows = std::min<int64_t>(std::max<int64_t>(left / width, 1), 4096);
    const int64_t count = std::min(left, rows * width);
    fedmesh::Tensor matrix = fedmesh::Tensor::empty({count});
    float* values = matrix.data<float>();
    for (int64_t i = 0; i < count; ++i) values[i] = static_cast<float>(rng.normal() * 0.02);
    tensors.push_back(std::move(matrix));
    left -= count;
    if (left > width) {
      fedmesh::Tensor bias = fedmesh::Tensor::empty({width});
      for (int64_t i = 0; i < width; ++i) bias.data<float>()[i] = static_cast<float>(rng.normal() * 0.01);
      tensors.push_back(std::move(bias));
      left -= width;
    }
  }
  return tensors;
}

void die(const std::string& message) {
  std::fprintf(stderr, "bench_checkpoint: %s\n", message.c_str());
  std::exit(1);
}

double write_plain_file(const fs::path& file, const std::vector<fedmesh::Tensor>& tensors, bool overwrite) {
  const auto start = Clock::now();
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | (overwrite ? 0 : O_TRUNC), 0644);
  if (fd < 0) die("cannot create " + file.string());
  constexpr size_t kPiece = size_t{1} << 20;
  for (const fedmesh::Tensor& tensor : tensors) {
    const auto* bytes = static_cast<const uint8_t*>(tensor.raw());
    for (size_t offset = 0; offset < tensor.nbytes(); offset += kPiece) {
      const size_t size = std::min(kPiece, tensor.nbytes() - offset);
      if (::write(fd, bytes + offset, size) != static_cast<ssize_t>(size)) die("write failed");
    }
  }
  if (::fsync(fd) != 0) die("fsync failed");
  ::close(fd);
  return seconds_since(start);
}

void usage() {
  std::printf(
      "usage: bench_checkpoint [--params 10M,100M] [--rounds 5] [--dir DIR]\n"
      "Commits checkpoints of N fp32 parameters and writes the same bytes to a plain file with fsync,\n"
      "in DIR (default: a fresh directory under /var/tmp; use a disk, not tmpfs), and prints median times,\n"
      "the ratio commit / plain file (target <= 1.5) and the store's size.\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> sizes = {10'000'000, 100'000'000};
  int rounds = 5;
  fs::path dir = fs::path("/var/tmp") / ("fedmesh-bench-checkpoint-" + std::to_string(::getpid()));
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      usage();
      return 0;
    } else if (arg == "--params" && i + 1 < argc) {
      sizes.clear();
      std::string list = argv[++i];
      size_t begin = 0;
      while (begin <= list.size()) {
        const size_t end = std::min(list.find(',', begin), list.size());
        std::string item = list.substr(begin, end - begin);
        int64_t scale = 1;
        if (!item.empty() && (item.back() == 'M' || item.back() == 'm')) scale = 1'000'000, item.pop_back();
        const int64_t value = std::atoll(item.c_str()) * scale;
        if (value <= 0) die("--params: '" + list + "' is not a list like 10M,100M");
        sizes.push_back(value);
        begin = end + 1;
      }
    } else if (arg == "--rounds" && i + 1 < argc) {
      rounds = std::atoi(argv[++i]);
      if (rounds < 2) die("--rounds must be at least 2");
    } else if (arg == "--dir" && i + 1 < argc) {
      dir = argv[++i];
    } else {
      usage();
      return 2;
    }
  }
  fs::create_directories(dir);
  std::printf("directory %s, %d rounds per size, keep_last 3\n", dir.c_str(), rounds);
  std::printf("%10s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s\n", "params", "file s", "file GB/s", "rewrite s",
              "blake2bp s", "commit s", "min s", "wal cp s", "commit/f", "+wal/f", "db/bytes");
  bool all_met = true;
  for (const int64_t parameters : sizes) {
    const std::vector<fedmesh::Tensor> tensors = make_model(parameters, 42);
    int64_t bytes = 0;
    for (const auto& t : tensors) bytes += static_cast<int64_t>(t.nbytes());

    std::vector<double> file_seconds, rewrite_seconds, hash_seconds, commit_seconds, wal_seconds;
    const fs::path plain = dir / "plain.bin";
    for (int r = 0; r < rounds; ++r) {
      fs::remove(plain);
      file_seconds.push_back(write_plain_file(plain, tensors, /*overwrite=*/false));
      rewrite_seconds.push_back(write_plain_file(plain, tensors, /*overwrite=*/true));
      const auto start = Clock::now();
      for (const auto& t : tensors) {
        volatile uint8_t sink = fedmesh::crypto::tree_hash({static_cast<const uint8_t*>(t.raw()), t.nbytes()})[0];
        (void)sink;
      }
      hash_seconds.push_back(seconds_since(start));
    }
    fs::remove(plain);

    const fs::path db = dir / ("store-" + std::to_string(parameters) + ".db");
    fs::remove(db);
    fs::remove(db.string() + "-wal");
    fs::remove(db.string() + "-shm");
    auto store = fedmesh::store::CheckpointStore::open(db.string());
    if (!store.is_ok()) die(store.status().to_string());
    for (int r = 1; r <= rounds; ++r) {
      fedmesh::store::RoundToCommit round;
      round.round = r;
      round.model_version = r;
      for (size_t i = 0; i < tensors.size(); ++i) {
        round.tensors.push_back({"model", "tensor" + std::to_string(i), &tensors[i]});
      }
      auto start = Clock::now();
      const fedmesh::Status committed = store->commit_round(round);
      if (!committed.is_ok()) die(committed.to_string());
      commit_seconds.push_back(seconds_since(start));
      start = Clock::now();
      const fedmesh::Status copied = store->settle();
      if (!copied.is_ok()) die(copied.to_string());
      wal_seconds.push_back(seconds_since(start));
    }
    const double file = median(file_seconds);
    const double commit = median(commit_seconds);
    const double wal = median(wal_seconds);
    const double ratio = commit / file;
    all_met &= ratio <= 1.5;
    std::printf("%9.0fM %9.3f %9.2f %9.3f %9.3f %9.3f %9.3f %9.3f %9.2f %9.2f %9.2f\n",
                static_cast<double>(parameters) / 1e6, file, static_cast<double>(bytes) / file / 1e9,
                median(rewrite_seconds), median(hash_seconds), commit, minimum(commit_seconds), wal, ratio,
                (commit + wal) / file,
                static_cast<double>(store->disk_bytes()) / static_cast<double>(bytes));
    std::fflush(stdout);
    store = fedmesh::Status(fedmesh::StatusCode::kInternal, "closed");
    fs::remove(db);
    fs::remove(db.string() + "-wal");
    fs::remove(db.string() + "-shm");
  }
  std::printf("target (commit within 1.5x of the plain file write): %s\n", all_met ? "met" : "NOT met");
  std::error_code ignored;
  fs::remove_all(dir, ignored);
  return 0;
}
