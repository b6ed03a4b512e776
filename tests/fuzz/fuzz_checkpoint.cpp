// libFuzzer target for reading a checkpoint database (store/): the bytes of a
// database file come from outside the process. How to build and run it:
// tests/fuzz/README.md.
//
// An input that starts with SQLite's magic ("SQLite format 3\0") is used as
// the database file itself. Any other input is a list of 4-byte patches
// (3 bytes of offset, 1 byte to XOR in) applied to a small, valid template
// store built at start-up (1 KiB pages, two rounds, a pending update, peers),
// so the fuzzer reaches the checksum and record checks behind SQLite's own.
//
// For every input, besides "no crash, no sanitizer report, no unbounded
// allocation": every refusal carries a message, and whatever load_latest()
// returns as intact is byte for byte a round that was committed to the
// template. A violation prints what was wrong and traps.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "store/checkpoint_store.h"
#include "store/schema.h"
#include "store/sqlite.h"

namespace {

namespace fs = std::filesystem;
namespace store = fedmesh::store;
using fedmesh::Tensor;

[[noreturn]] void violated(const std::string& what) {
  std::fprintf(stderr, "fuzz_checkpoint: invariant violated: %s\n", what.c_str());
  __builtin_trap();
}

Tensor round_weights(int64_t round) {
  Tensor t = Tensor::empty({300});
  for (int64_t i = 0; i < 300; ++i) t.data<float>()[i] = static_cast<float>(round * 1000 + i);
  return t;
}

std::string read_bytes(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& file, const std::string& bytes) {
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

fs::path work_directory() {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("fedmesh-fuzz-checkpoint-" + std::to_string(::getpid()));
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

void remove_database(const fs::path& db) {
  std::error_code ignored;
  for (const char* suffix : {"", "-wal", "-shm", "-journal"}) fs::remove(db.string() + suffix, ignored);
}

const std::string& template_bytes() {
  static const std::string bytes = [] {
    const fs::path db = work_directory() / "template.db";
    remove_database(db);
    {
      auto database = store::Database::open(db.string(), store::Database::Mode::kReadWriteCreate);
      if (!database.is_ok() || !database->execute("PRAGMA page_size = 1024").is_ok() ||
          !store::migrate(*database).is_ok()) {
        violated("cannot build the template database");
      }
    }
    store::StoreOptions options;
    options.background_maintenance = false;
    auto checkpoints = store::CheckpointStore::open(db.string(), options);
    if (!checkpoints.is_ok()) violated("cannot open the template: " + checkpoints.status().message());
    for (int64_t round = 1; round <= 2; ++round) {
      const Tensor weights = round_weights(round);
      store::RoundToCommit commit;
      commit.round = round;
      commit.model_version = round;
      commit.metrics_json = R"({"test_accuracy":0.5})";
      commit.state_json = R"({"step":)" + std::to_string(round) + "}";
      commit.tensors = {{"model", "w", &weights}};
      commit.peers = std::vector<store::PeerRecord>{{"site-a", "tcp://a:1", "alive", 1, round}};
      commit.replay_counters = {{"site-a", static_cast<uint64_t>(round)}};
      if (!checkpoints->commit_round(commit).is_ok()) violated("cannot commit to the template");
    }
    if (!checkpoints->add_pending_update({{1, 2}, "site-a", 2, 5, "", 0}, std::vector<uint8_t>(600, 7)).is_ok() ||
        !checkpoints->settle().is_ok()) {
      violated("cannot finish the template");
    }
    checkpoints = fedmesh::Status(fedmesh::StatusCode::kInternal, "closed");
    std::string result = read_bytes(db);
    remove_database(db);
    return result;
  }();
  return bytes;
}

void check_refusal(const fedmesh::Status& status, const char* call) {
  if (!status.is_ok() && status.message().empty()) violated(std::string(call) + " refused without a message");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static constexpr char kMagic[] = "SQLite format 3";  // 16 bytes with its NUL
  std::string bytes;
  const bool raw_database = size >= sizeof kMagic && std::memcmp(data, kMagic, sizeof kMagic) == 0;
  if (raw_database) {
    bytes.assign(reinterpret_cast<const char*>(data), size);
  } else {
    bytes = template_bytes();
    for (size_t i = 0; i + 4 <= size; i += 4) {
      const size_t offset = (static_cast<size_t>(data[i]) << 16 | static_cast<size_t>(data[i + 1]) << 8 | data[i + 2]) %
                            bytes.size();
      bytes[offset] = static_cast<char>(bytes[offset] ^ static_cast<char>(data[i + 3]));
    }
  }
  const fs::path db = work_directory() / "input.db";
  remove_database(db);
  write_bytes(db, bytes);

  store::StoreOptions options;
  options.background_maintenance = false;
  auto checkpoints = store::CheckpointStore::open_existing(db.string(), options);
  if (!checkpoints.is_ok()) {
    check_refusal(checkpoints.status(), "open");
    return 0;
  }
  check_refusal(checkpoints->integrity_check(), "integrity_check");
  check_refusal(checkpoints->pending_updates().status(), "pending_updates");
  check_refusal(checkpoints->read_pending_update(std::vector<uint8_t>{1, 2}).status(), "read_pending_update");
  check_refusal(checkpoints->peers().status(), "peers");
  check_refusal(checkpoints->replay_counters().status(), "replay_counters");
  if (auto rounds = checkpoints->rounds(); rounds.is_ok()) {
    for (const store::RoundInfo& round : *rounds) {
      check_refusal(checkpoints->verify_round(round.round), "verify_round");
      if (auto tensors = checkpoints->tensors(round.round); tensors.is_ok()) {
        for (const store::TensorInfo& tensor : *tensors) {
          check_refusal(checkpoints->read_tensor(tensor, [](std::span<const uint8_t>) { return fedmesh::Status::ok(); }),
                        "read_tensor");
        }
      }
    }
  }
  auto loaded = checkpoints->load_latest();
  check_refusal(loaded.status(), "load_latest");
  // A raw database from the corpus may hold anything that verifies; only the
  // template's rounds are known.
  if (loaded.is_ok() && !raw_database) {
    const int64_t round = loaded->round.round;
    if (round != 1 && round != 2) violated("a patched template loaded as round " + std::to_string(round));
    const store::StoredTensor* weights = loaded->find("model", "w");
    const Tensor expected = round_weights(round);
    if (weights == nullptr || weights->value.nbytes() != expected.nbytes() ||
        std::memcmp(weights->value.raw(), expected.raw(), expected.nbytes()) != 0) {
      violated("round " + std::to_string(round) + " loaded as intact with other weights");
    }
  }
  return 0;
}
