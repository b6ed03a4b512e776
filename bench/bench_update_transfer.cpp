// How fast can one model update (default: 100M fp32 parameters = 400 MB) move
// from one node to another on this machine?  Prints the ceilings that bound
// fedmesh's own path -- memcpy, BLAKE2b hashing, Ed25519 signing, raw ZeroMQ
// over loopback TCP with and without CurveZMQ -- measured in the same run, so
// that the end-to-end number (measure_end_to_end) can be read against them.
//
// A plain program, not Google Benchmark: every measurement moves the whole
// payload once per repetition and reports the best and the median GB/s
// (1 GB = 1e9 bytes) of --repeat repetitions.  See --help.
#include <sodium.h>
#include <zmq.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include "crypto/keys.h"
#include "crypto/replay_guard.h"
#include "crypto/roster.h"
#include "crypto/tree_hash.h"
#include "kernels/parallel.h"
#include "protocol/transport.h"
#include "protocol/update_service.h"
#include "protocol/sealed_update.h"
#include "protocol/update_transfer.h"
#include "protocol/update_upload.h"

namespace {

using Clock = std::chrono::steady_clock;

// ---- options -------------------------------------------------------------------

constexpr const char* kProgram = "bench_update_transfer";

// Names accepted by --only, in the order they run.
const std::vector<std::string> kSections = {"memcpy", "blake2b", "ed25519", "xsalsa20", "zmq-plain", "zmq-curve",
                                            "e2e"};

struct Options {
  uint64_t bytes = 100'000'000ull * 4;  // 100M fp32 parameters
  uint64_t chunk_bytes = 4ull << 20;    // one ZeroMQ message / one hashed piece
  int repeat = 3;
  int hash_threads = 2;  // the multi-threaded BLAKE2b variant
  int io_threads = 1;    // ZMQ_IO_THREADS of each of the two contexts
  int hwm = 16;          // ZMQ_SNDHWM / ZMQ_RCVHWM, in messages
  bool json = false;
  std::set<std::string> only;  // empty: every section

  bool runs(const std::string& section) const { return only.empty() || only.count(section) != 0; }
};

void print_usage(std::FILE* out) {
  std::fprintf(out,
               "Usage: %s [options]\n"
               "\n"
               "Measures the ceilings for moving one model update between two nodes on this\n"
               "machine: memcpy, BLAKE2b-256 (libsodium crypto_generichash) on 1 and N threads,\n"
               "Ed25519 sign/verify of a 32-byte message, XSalsa20-Poly1305 (CurveZMQ's cipher)\n"
               "seal/open, and ZeroMQ PUSH->PULL over loopback\n"
               "TCP, plaintext and CurveZMQ (sender and receiver threads in one process, one\n"
               "context each).  Each is repeated and reported as best and median GB/s\n"
               "(1 GB = 1e9 bytes of payload).\n"
               "\n"
               "Options:\n"
               "  --bytes N          payload per update (default: 400000000 = 100M fp32 params)\n"
               "  --chunk-bytes N    bytes per message / hashed piece (default: 4MiB)\n"
               "  --repeat R         repetitions per measurement, 1..1000 (default: 3)\n"
               "  --hash-threads T   threads for the parallel BLAKE2b run, 1..256 (default: 2)\n"
               "  --io-threads T     ZMQ_IO_THREADS per context, 1..64 (default: 1)\n"
               "  --hwm H            ZMQ_SNDHWM/ZMQ_RCVHWM in messages, 1..1000000 (default: 16)\n"
               "  --only LIST        comma-separated subset of: memcpy,blake2b,ed25519,\n"
               "                     xsalsa20,zmq-plain,zmq-curve,e2e (default: all)\n"
               "  --json             print one JSON object per line (machine info first)\n"
               "  -h, --help         show this help\n"
               "\n"
               "Sizes take an optional suffix: k/M/G (x1e3, 1e6, 1e9; also kB/MB/GB) or\n"
               "Ki/Mi/Gi (x1024, 1024^2, 1024^3; also KiB/MiB/GiB).  Progress goes to stderr.\n",
               kProgram);
}

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "%s: %s (see --help)\n", kProgram, message.c_str());
  std::exit(2);
}

uint64_t parse_size(const std::string& flag, std::string_view text) {
  uint64_t value = 0;
  const char* begin = text.data();
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(begin, end, value);
  if (ec != std::errc() || ptr == begin) usage_error("bad value for " + flag + ": '" + std::string(text) + "'");
  const std::string_view suffix(ptr, static_cast<size_t>(end - ptr));
  uint64_t multiplier = 1;
  if (suffix.empty() || suffix == "B") multiplier = 1;
  else if (suffix == "k" || suffix == "K" || suffix == "kB" || suffix == "KB") multiplier = 1000ull;
  else if (suffix == "M" || suffix == "MB") multiplier = 1000'000ull;
  else if (suffix == "G" || suffix == "GB") multiplier = 1000'000'000ull;
  else if (suffix == "Ki" || suffix == "KiB") multiplier = 1ull << 10;
  else if (suffix == "Mi" || suffix == "MiB") multiplier = 1ull << 20;
  else if (suffix == "Gi" || suffix == "GiB") multiplier = 1ull << 30;
  else usage_error("bad size suffix for " + flag + ": '" + std::string(text) + "'");
  if (value > UINT64_MAX / multiplier) usage_error("value for " + flag + " too large: '" + std::string(text) + "'");
  return value * multiplier;
}

int parse_int(const std::string& flag, std::string_view text, int lo, int hi) {
  int value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size() || text.empty())
    usage_error("bad value for " + flag + ": '" + std::string(text) + "'");
  if (value < lo || value > hi)
    usage_error(flag + " must be in " + std::to_string(lo) + ".." + std::to_string(hi) + ", got " +
                std::to_string(value));
  return value;
}

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      print_usage(stdout);
      std::exit(0);
    }
    if (arg == "--json") {
      o.json = true;
      continue;
    }
    std::string value;
    bool has_value = false;
    if (const size_t eq = arg.find('='); arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    auto need_value = [&]() -> std::string {
      if (has_value) return value;
      if (i + 1 >= argc) usage_error(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--bytes") {
      o.bytes = parse_size(arg, need_value());
    } else if (arg == "--chunk-bytes") {
      o.chunk_bytes = parse_size(arg, need_value());
    } else if (arg == "--repeat") {
      o.repeat = parse_int(arg, need_value(), 1, 1000);
    } else if (arg == "--hash-threads") {
      o.hash_threads = parse_int(arg, need_value(), 1, 256);
    } else if (arg == "--io-threads") {
      o.io_threads = parse_int(arg, need_value(), 1, 64);
    } else if (arg == "--hwm") {
      o.hwm = parse_int(arg, need_value(), 1, 1'000'000);
    } else if (arg == "--only") {
      std::stringstream list(need_value());
      std::string name;
      while (std::getline(list, name, ',')) {
        if (std::find(kSections.begin(), kSections.end(), name) == kSections.end())
          usage_error("unknown section in --only: '" + name + "'");
        o.only.insert(name);
      }
      if (o.only.empty()) usage_error("--only needs at least one section");
    } else {
      usage_error("unknown option '" + arg + "'");
    }
  }
  if (o.bytes == 0) usage_error("--bytes must be positive");
  if (o.chunk_bytes == 0) usage_error("--chunk-bytes must be positive");
  if (o.chunk_bytes > o.bytes) usage_error("--chunk-bytes must not exceed --bytes");
  // memcpy needs two payload buffers; stay well inside a 64-bit size_t and sane memory.
  if (o.bytes > (64ull << 30)) usage_error("--bytes must be at most 64GiB");
  if (o.chunk_bytes > (1ull << 31)) usage_error("--chunk-bytes must be at most 2GiB");
  return o;
}

// ---- results -------------------------------------------------------------------

struct Measurement {
  std::string name;
  double gigabytes_per_second;  // best of the runs (1 GB = 1e9 bytes of payload)
  std::string note;
  std::vector<double> runs_gigabytes_per_second = {};  // every repetition, in run order
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double median_of(const Measurement& m) {
  return m.runs_gigabytes_per_second.empty() ? m.gigabytes_per_second : median(m.runs_gigabytes_per_second);
}

Measurement from_runs(std::string name, std::vector<double> runs, std::string note) {
  const double best = runs.empty() ? 0 : *std::max_element(runs.begin(), runs.end());
  return Measurement{std::move(name), best, std::move(note), std::move(runs)};
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  return buf;
}

std::string human_bytes(uint64_t n) {
  if (n >= (1ull << 20) && n % (1ull << 20) == 0) return std::to_string(n >> 20) + " MiB";
  if (n >= (1ull << 10) && n % (1ull << 10) == 0) return std::to_string(n >> 10) + " KiB";
  if (n >= 1000'000) return format("%.1f MB", static_cast<double>(n) / 1e6);
  return std::to_string(n) + " B";
}

void progress(const Options&, const std::string& what) { std::fprintf(stderr, "[%s] %s\n", kProgram, what.c_str()); }

// ---- machine info --------------------------------------------------------------

struct MachineInfo {
  int nproc = 0;  // CPUs this process may run on
  std::string cpu_model;
  std::string libzmq_version;
  std::string libsodium_version;
  bool zmq_has_curve = false;
  std::string loadavg;
};

MachineInfo machine_info() {
  MachineInfo m;
  cpu_set_t set;
  CPU_ZERO(&set);
  m.nproc = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set)
                                                        : static_cast<int>(std::thread::hardware_concurrency());
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) m.cpu_model = line.substr(line.find_first_not_of(" \t", colon + 1));
      break;
    }
  }
  if (m.cpu_model.empty()) m.cpu_model = "unknown";
  int major = 0, minor = 0, patch = 0;
  zmq_version(&major, &minor, &patch);
  m.libzmq_version = format("%d.%d.%d", major, minor, patch);
  m.libsodium_version = sodium_version_string();
  m.zmq_has_curve = zmq_has("curve") != 0;
  std::ifstream load("/proc/loadavg");
  std::getline(load, m.loadavg);
  return m;
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (const char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) out += format("\\u%04x", c);
        else out += c;
    }
  }
  return out;
}

std::string json_number(double x) { return format("%.6g", x); }

void print_machine(const Options& o, const MachineInfo& m) {
  if (o.json) {
    std::printf(
        "{\"kind\":\"machine\",\"nproc\":%d,\"cpu_model\":\"%s\",\"libzmq\":\"%s\",\"libsodium\":\"%s\","
        "\"zmq_curve\":%s,\"loadavg\":\"%s\",\"bytes\":%llu,\"chunk_bytes\":%llu,\"repeat\":%d,"
        "\"hash_threads\":%d,\"io_threads\":%d,\"hwm\":%d}\n",
        m.nproc, json_escape(m.cpu_model).c_str(), m.libzmq_version.c_str(), m.libsodium_version.c_str(),
        m.zmq_has_curve ? "true" : "false", json_escape(m.loadavg).c_str(), static_cast<unsigned long long>(o.bytes),
        static_cast<unsigned long long>(o.chunk_bytes), o.repeat, o.hash_threads, o.io_threads, o.hwm);
    return;
  }
  std::printf("machine: %d CPUs (%s), libzmq %s (curve: %s), libsodium %s, loadavg %s\n", m.nproc,
              m.cpu_model.c_str(), m.libzmq_version.c_str(), m.zmq_has_curve ? "yes" : "NO",
              m.libsodium_version.c_str(), m.loadavg.c_str());
  std::printf("payload: %llu bytes (%.1f MB) in %s pieces, best and median of %d runs, "
              "ZMQ_IO_THREADS=%d per context, HWM=%d\n\n",
              static_cast<unsigned long long>(o.bytes), static_cast<double>(o.bytes) / 1e6,
              human_bytes(o.chunk_bytes).c_str(), o.repeat, o.io_threads, o.hwm);
}

// One Markdown table (pastes into bench/RESULTS.md), or one JSON object per line.
void print_measurements(const Options& o, const std::vector<Measurement>& ms, const std::string& kind) {
  if (o.json) {
    for (const auto& m : ms) {
      std::string runs;
      for (const double r : m.runs_gigabytes_per_second) {
        if (!runs.empty()) runs += ',';
        runs += json_number(r);
      }
      std::printf(
          "{\"kind\":\"%s\",\"name\":\"%s\",\"gigabytes_per_second\":%s,\"median_gigabytes_per_second\":%s,"
          "\"runs_gigabytes_per_second\":[%s],\"note\":\"%s\"}\n",
          kind.c_str(), json_escape(m.name).c_str(), json_number(m.gigabytes_per_second).c_str(),
          json_number(median_of(m)).c_str(), runs.c_str(), json_escape(m.note).c_str());
    }
    std::fflush(stdout);
    return;
  }
  if (ms.empty()) return;
  std::printf("| %s | best GB/s | median GB/s | runs | note |\n| --- | --- | --- | --- | --- |\n", kind.c_str());
  for (const auto& m : ms) {
    std::string runs;
    for (const double r : m.runs_gigabytes_per_second) {
      if (!runs.empty()) runs += " / ";
      runs += format("%.3g", r);
    }
    std::printf("| %s | %.3f | %.3f | %s | %s |\n", m.name.c_str(), m.gigabytes_per_second, median_of(m),
                runs.c_str(), m.note.c_str());
  }
  std::printf("\n");
  std::fflush(stdout);
}

// ---- other work on the machine ----------------------------------------------------

// CPUs kept busy by other processes while a section ran: user+nice+system time
// of the whole machine (/proc/stat) minus this process's own (getrusage), per
// second of wall time.  Interrupt and softirq time (loopback TCP shows up
// there) counts as neither.  Nonzero values mean the numbers are low.
class OtherLoad {
 public:
  OtherLoad() : wall_(Clock::now()), machine_(machine_busy_seconds()), own_(own_cpu_seconds()) {}
  double busy_cpus() const {
    const double wall = seconds_since(wall_);
    if (machine_ < 0 || wall <= 0) return 0;
    const double others = (machine_busy_seconds() - machine_) - (own_cpu_seconds() - own_);
    return std::max(0.0, others / wall);
  }

 private:
  static double machine_busy_seconds() {
    std::ifstream stat("/proc/stat");
    std::string cpu;
    unsigned long long user = 0, nice = 0, system = 0;
    if (!(stat >> cpu >> user >> nice >> system) || cpu != "cpu") return -1;
    return static_cast<double>(user + nice + system) / static_cast<double>(sysconf(_SC_CLK_TCK));
  }
  static double own_cpu_seconds() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    auto sec = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec); };
    return sec(u.ru_utime) + sec(u.ru_stime);
  }
  Clock::time_point wall_;
  double machine_, own_;
};

// ---- buffers -------------------------------------------------------------------

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint8_t[], FreeDeleter>;

// Page-aligned and faulted in, so no run pays for first-touch page faults.
Buffer allocate(uint64_t n) {
  const uint64_t rounded = (n + 4095) / 4096 * 4096;
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(4096, rounded));
  if (p == nullptr) throw std::runtime_error(format("cannot allocate %llu bytes", static_cast<unsigned long long>(n)));
  std::memset(p, 0, rounded);
  return Buffer(p);
}

Buffer random_payload(uint64_t n) {
  Buffer b = allocate(n);
  uint64_t s = 0x9E3779B97F4A7C15ull;
  for (uint64_t i = 0; i < n; i += 8) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    std::memcpy(b.get() + i, &s, std::min<uint64_t>(8, n - i));
  }
  return b;
}

uint64_t chunk_count(const Options& o) { return (o.bytes + o.chunk_bytes - 1) / o.chunk_bytes; }
uint64_t chunk_length(const Options& o, uint64_t i) { return std::min(o.chunk_bytes, o.bytes - i * o.chunk_bytes); }

// What the ZeroMQ receiver reads of every message: one byte per 4 KiB and the
// last byte, so no layer can skip delivering the data, and the sum checks
// that the messages came in order and intact (at that sampling).
uint64_t touch(const uint8_t* p, size_t n) {
  uint64_t sum = 0;
  for (size_t off = 0; off < n; off += 4096) sum = sum * 31 + p[off];
  if (n != 0) sum = sum * 31 + p[n - 1];
  return sum;
}

volatile uint64_t g_sink;  // keeps results observable

// ---- 1. memcpy -----------------------------------------------------------------

Measurement measure_memcpy(const Options& o, const uint8_t* payload) {
  Buffer dst = allocate(o.bytes);
  std::vector<double> runs;
  for (int r = 0; r < o.repeat; ++r) {
    const auto t0 = Clock::now();
    for (uint64_t i = 0, n = chunk_count(o); i < n; ++i)
      std::memcpy(dst.get() + i * o.chunk_bytes, payload + i * o.chunk_bytes, chunk_length(o, i));
    const double s = seconds_since(t0);
    g_sink = g_sink + dst[o.bytes / 2];
    runs.push_back(static_cast<double>(o.bytes) / s / 1e9);
  }
  return from_runs("memcpy", runs,
                   format("1 thread, %s pieces into a second buffer (GB copied/s; reads + writes = 2x that)",
                          human_bytes(o.chunk_bytes).c_str()));
}

// ---- 2. BLAKE2b-256 --------------------------------------------------------------

using Digest = std::array<uint8_t, crypto_generichash_BYTES>;  // 32 bytes: BLAKE2b-256

void hash_chunks(const Options& o, const uint8_t* payload, uint64_t first, uint64_t last, std::vector<Digest>& out) {
  for (uint64_t i = first; i < last; ++i)
    crypto_generichash(out[i].data(), out[i].size(), payload + i * o.chunk_bytes, chunk_length(o, i), nullptr, 0);
}

// fedmesh's chunk hash (crypto/tree_hash.h), one thread, the same pieces.
Measurement measure_blake2bp(const Options& o, const uint8_t* payload) {
  const uint64_t n = chunk_count(o);
  std::vector<Digest> digests(n), reference;
  std::vector<double> runs;
  for (int r = 0; r < o.repeat; ++r) {
    const auto t0 = Clock::now();
    for (uint64_t i = 0; i < n; ++i) digests[i] = fedmesh::crypto::tree_hash({payload + i * o.chunk_bytes, chunk_length(o, i)});
    const double s = seconds_since(t0);
    if (reference.empty()) reference = digests;
    else if (digests != reference) throw std::runtime_error("BLAKE2bp digests differ between runs");
    runs.push_back(static_cast<double>(o.bytes) / s / 1e9);
  }
  g_sink = g_sink + digests[0][0];
  return from_runs("BLAKE2bp-256, 1 thread", runs,
                   format("fedmesh's chunk hash (crypto/tree_hash.h%s) per %s piece",
                          fedmesh::crypto::tree_hash_uses_avx2() ? ", AVX2 lanes" : ", portable",
                          human_bytes(o.chunk_bytes).c_str()));
}

std::vector<Measurement> measure_blake2b(const Options& o, const uint8_t* payload) {
  const uint64_t n = chunk_count(o);
  std::vector<Digest> digests(n);
  std::vector<Digest> reference;
  std::vector<Measurement> out;
  for (const int threads : {1, o.hash_threads}) {
    if (threads == 1 && !out.empty()) break;  // --hash-threads 1: one row only
    std::vector<double> runs;
    for (int r = 0; r < o.repeat; ++r) {
      std::fill(digests.begin(), digests.end(), Digest{});
      const auto t0 = Clock::now();
      if (threads == 1) {
        hash_chunks(o, payload, 0, n, digests);
      } else {
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t)
          pool.emplace_back(hash_chunks, std::cref(o), payload, n * t / threads, n * (t + 1) / threads,
                            std::ref(digests));
        for (auto& th : pool) th.join();
      }
      const double s = seconds_since(t0);
      if (reference.empty()) reference = digests;
      else if (digests != reference) throw std::runtime_error("BLAKE2b digests differ between runs");
      runs.push_back(static_cast<double>(o.bytes) / s / 1e9);
    }
    g_sink = g_sink + digests[0][0];
    out.push_back(from_runs(
        format("BLAKE2b-256, %d thread%s", threads, threads == 1 ? "" : "s"), runs,
        format("libsodium crypto_generichash per %s piece%s", human_bytes(o.chunk_bytes).c_str(),
               threads == 1 ? "" : format(", each thread hashing 1/%d of the pieces", threads).c_str())));
    if (o.hash_threads == 1) break;
  }
  out.push_back(measure_blake2bp(o, payload));
  return out;
}

// ---- 3. Ed25519 ------------------------------------------------------------------

// Signatures are per update (or per piece), not per byte: the GB/s column is
// the payload one signature covers divided by the time of one signature.
std::vector<Measurement> measure_ed25519(const Options& o) {
  std::array<uint8_t, crypto_sign_PUBLICKEYBYTES> pk{};
  std::array<uint8_t, crypto_sign_SECRETKEYBYTES> sk{};
  crypto_sign_keypair(pk.data(), sk.data());
  std::array<uint8_t, 32> message{};  // e.g. the BLAKE2b-256 of an update
  randombytes_buf(message.data(), message.size());
  std::array<uint8_t, crypto_sign_BYTES> sig{};
  constexpr double kMinSeconds = 0.3;

  std::vector<double> sign_rates, verify_rates;
  for (int r = 0; r < o.repeat; ++r) {
    uint64_t count = 0;
    auto t0 = Clock::now();
    double s = 0;
    do {
      for (int k = 0; k < 64; ++k, ++count) {
        message[0] = static_cast<uint8_t>(count);
        crypto_sign_detached(sig.data(), nullptr, message.data(), message.size(), sk.data());
        g_sink = g_sink + sig[0];
      }
    } while ((s = seconds_since(t0)) < kMinSeconds);
    sign_rates.push_back(static_cast<double>(count) / s);

    crypto_sign_detached(sig.data(), nullptr, message.data(), message.size(), sk.data());
    count = 0;
    t0 = Clock::now();
    do {
      for (int k = 0; k < 64; ++k, ++count)
        if (crypto_sign_verify_detached(sig.data(), message.data(), message.size(), pk.data()) != 0)
          throw std::runtime_error("Ed25519 verification failed");
    } while ((s = seconds_since(t0)) < kMinSeconds);
    verify_rates.push_back(static_cast<double>(count) / s);
  }

  auto to_measurement = [&](const char* name, const std::vector<double>& rates) {
    std::vector<double> gbps;
    for (const double rate : rates) gbps.push_back(rate * static_cast<double>(o.bytes) / 1e9);
    const double best = *std::max_element(rates.begin(), rates.end());
    const double med = median(rates);
    return from_runs(
        name, gbps,
        format("%.0f/s best, %.0f/s median (%.1f us each), 1 thread; GB/s = one signature per %.0f MB update; "
               "one per %s piece would be %.0f GB/s",
               best, med, 1e6 / med, static_cast<double>(o.bytes) / 1e6, human_bytes(o.chunk_bytes).c_str(),
               med * static_cast<double>(o.chunk_bytes) / 1e9));
  };
  return {to_measurement("Ed25519 sign, 32-byte message", sign_rates),
          to_measurement("Ed25519 verify, 32-byte message", verify_rates)};
}

// ---- CurveZMQ's cipher alone ----------------------------------------------------

// What CurveZMQ does to every message once the handshake is done: XSalsa20-
// Poly1305 with a precomputed key (libsodium crypto_box_easy_afternm), sealed
// on the sender's I/O thread and opened on the receiver's.  Explains the
// CurveZMQ row: its ceiling is this, not the network.
std::vector<Measurement> measure_xsalsa20poly1305(const Options& o, const uint8_t* payload) {
  std::array<uint8_t, crypto_box_PUBLICKEYBYTES> pk{};
  std::array<uint8_t, crypto_box_SECRETKEYBYTES> sk{};
  std::array<uint8_t, crypto_box_BEFORENMBYTES> key{};
  crypto_box_keypair(pk.data(), sk.data());
  if (crypto_box_beforenm(key.data(), pk.data(), sk.data()) != 0) throw std::runtime_error("crypto_box_beforenm");
  std::array<uint8_t, crypto_box_NONCEBYTES> nonce{};
  const uint64_t n = chunk_count(o);
  const uint64_t stride = o.chunk_bytes + crypto_box_MACBYTES;
  Buffer sealed = allocate(n * stride), opened = allocate(o.bytes);
  std::vector<double> seal_runs, open_runs;
  for (int r = 0; r < o.repeat; ++r) {
    auto t0 = Clock::now();
    for (uint64_t i = 0; i < n; ++i) {
      std::memcpy(nonce.data(), &i, sizeof i);
      crypto_box_easy_afternm(sealed.get() + i * stride, payload + i * o.chunk_bytes, chunk_length(o, i),
                              nonce.data(), key.data());
    }
    seal_runs.push_back(static_cast<double>(o.bytes) / seconds_since(t0) / 1e9);
    t0 = Clock::now();
    for (uint64_t i = 0; i < n; ++i) {
      std::memcpy(nonce.data(), &i, sizeof i);
      if (crypto_box_open_easy_afternm(opened.get() + i * o.chunk_bytes, sealed.get() + i * stride,
                                       chunk_length(o, i) + crypto_box_MACBYTES, nonce.data(), key.data()) != 0)
        throw std::runtime_error("crypto_box_open_easy_afternm failed");
    }
    open_runs.push_back(static_cast<double>(o.bytes) / seconds_since(t0) / 1e9);
  }
  if (std::memcmp(opened.get(), payload, o.bytes) != 0) throw std::runtime_error("XSalsa20-Poly1305 round trip differs");
  const std::string note = format("libsodium crypto_box_*_afternm per %s piece, 1 thread (CurveZMQ's per-message cipher)",
                                  human_bytes(o.chunk_bytes).c_str());
  return {from_runs("XSalsa20-Poly1305 seal", seal_runs, note), from_runs("XSalsa20-Poly1305 open", open_runs, note)};
}

// ---- 4./5. ZeroMQ over loopback TCP ----------------------------------------------

[[noreturn]] void zmq_fail(const char* what) {
  throw std::runtime_error(format("%s: %s", what, zmq_strerror(zmq_errno())));
}
void zmq_check(int rc, const char* what) {
  if (rc == -1) zmq_fail(what);
}

struct Context {
  void* ctx;
  explicit Context(int io_threads) : ctx(zmq_ctx_new()) {
    if (ctx == nullptr) zmq_fail("zmq_ctx_new");
    zmq_check(zmq_ctx_set(ctx, ZMQ_IO_THREADS, io_threads), "ZMQ_IO_THREADS");
  }
  ~Context() { zmq_ctx_term(ctx); }
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
};

struct Socket {
  void* s;
  Socket(Context& c, int type) : s(zmq_socket(c.ctx, type)) {
    if (s == nullptr) zmq_fail("zmq_socket");
  }
  ~Socket() {
    int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    zmq_close(s);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  void set_int(int option, int value, const char* what) { zmq_check(zmq_setsockopt(s, option, &value, sizeof value), what); }
  void set_key(int option, const char* z85, const char* what) {
    zmq_check(zmq_setsockopt(s, option, z85, std::strlen(z85)), what);
  }
};

// One run: a fresh pair of contexts, PULL binds an ephemeral loopback port,
// PUSH connects; a one-byte hello completes the connection (and the CURVE
// handshake) before the clock starts.  Time: first send to last receive.
double zmq_run(const Options& o, bool curve, const uint8_t* payload, uint64_t expected_sum) {
  Context send_ctx(o.io_threads), recv_ctx(o.io_threads);
  Socket pull(recv_ctx, ZMQ_PULL), push(send_ctx, ZMQ_PUSH);
  pull.set_int(ZMQ_RCVHWM, o.hwm, "ZMQ_RCVHWM");
  push.set_int(ZMQ_SNDHWM, o.hwm, "ZMQ_SNDHWM");
  pull.set_int(ZMQ_RCVTIMEO, 120'000, "ZMQ_RCVTIMEO");  // fail instead of hanging
  push.set_int(ZMQ_SNDTIMEO, 120'000, "ZMQ_SNDTIMEO");
  if (curve) {
    char server_public[41], server_secret[41], client_public[41], client_secret[41];
    zmq_check(zmq_curve_keypair(server_public, server_secret), "zmq_curve_keypair");
    zmq_check(zmq_curve_keypair(client_public, client_secret), "zmq_curve_keypair");
    pull.set_int(ZMQ_CURVE_SERVER, 1, "ZMQ_CURVE_SERVER");
    pull.set_key(ZMQ_CURVE_SECRETKEY, server_secret, "ZMQ_CURVE_SECRETKEY");
    push.set_key(ZMQ_CURVE_SERVERKEY, server_public, "ZMQ_CURVE_SERVERKEY");
    push.set_key(ZMQ_CURVE_PUBLICKEY, client_public, "ZMQ_CURVE_PUBLICKEY");
    push.set_key(ZMQ_CURVE_SECRETKEY, client_secret, "ZMQ_CURVE_SECRETKEY");
  }
  zmq_check(zmq_bind(pull.s, "tcp://127.0.0.1:*"), "zmq_bind");
  char endpoint[256];
  size_t endpoint_len = sizeof endpoint;
  zmq_check(zmq_getsockopt(pull.s, ZMQ_LAST_ENDPOINT, endpoint, &endpoint_len), "ZMQ_LAST_ENDPOINT");
  zmq_check(zmq_connect(push.s, endpoint), "zmq_connect");

  const uint64_t n = chunk_count(o);
  std::promise<void> connected;
  auto connected_future = connected.get_future();
  Clock::time_point t_first_send, t_last_receive;
  uint64_t received_sum = 0;
  std::exception_ptr send_error, recv_error;

  std::thread receiver([&] {
    try {
      zmq_msg_t msg;
      zmq_msg_init(&msg);
      if (zmq_msg_recv(&msg, pull.s, 0) == -1) zmq_fail("receiving hello");
      zmq_msg_close(&msg);
      connected.set_value();
      uint64_t sum = 0, total = 0;
      for (uint64_t i = 0; i < n; ++i) {
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, pull.s, 0) == -1) zmq_fail("zmq_msg_recv");
        const size_t size = zmq_msg_size(&msg);
        if (size != chunk_length(o, i)) throw std::runtime_error(format("message %llu: %zu bytes",
                                                                        static_cast<unsigned long long>(i), size));
        sum = sum * 1000003 + touch(static_cast<const uint8_t*>(zmq_msg_data(&msg)), size);
        total += size;
        zmq_msg_close(&msg);
      }
      t_last_receive = Clock::now();
      received_sum = sum;
      if (total != o.bytes) throw std::runtime_error("received byte count differs");
    } catch (...) {
      recv_error = std::current_exception();
      try { connected.set_value(); } catch (...) {}
    }
  });
  std::thread sender([&] {
    try {
      if (zmq_send(push.s, "h", 1, 0) == -1) zmq_fail("sending hello");
      connected_future.wait();
      if (recv_error) return;
      t_first_send = Clock::now();
      for (uint64_t i = 0; i < n; ++i) {
        zmq_msg_t msg;
        // No free function: libzmq sends straight from the payload buffer (zero copy).
        zmq_check(zmq_msg_init_data(&msg, const_cast<uint8_t*>(payload + i * o.chunk_bytes), chunk_length(o, i),
                                    nullptr, nullptr),
                  "zmq_msg_init_data");
        if (zmq_msg_send(&msg, push.s, 0) == -1) {
          zmq_msg_close(&msg);
          zmq_fail("zmq_msg_send");
        }
      }
    } catch (...) {
      send_error = std::current_exception();
    }
  });
  sender.join();
  receiver.join();
  if (send_error) std::rethrow_exception(send_error);
  if (recv_error) std::rethrow_exception(recv_error);
  if (received_sum != expected_sum) throw std::runtime_error("received data differs from what was sent");
  return static_cast<double>(o.bytes) / std::chrono::duration<double>(t_last_receive - t_first_send).count() / 1e9;
}

constexpr const char* kCurveCeilingName = "ZeroMQ PUSH->PULL, CurveZMQ";

uint64_t expected_touch_sum(const Options& o, const uint8_t* payload) {
  uint64_t sum = 0;
  for (uint64_t i = 0, n = chunk_count(o); i < n; ++i)
    sum = sum * 1000003 + touch(payload + i * o.chunk_bytes, chunk_length(o, i));
  return sum;
}

Measurement measure_zmq(const Options& o, bool curve, const uint8_t* payload) {
  if (curve && zmq_has("curve") == 0) throw std::runtime_error("this libzmq was built without CURVE");
  const uint64_t expected = expected_touch_sum(o, payload);
  std::vector<double> runs;
  for (int r = 0; r < o.repeat; ++r) runs.push_back(zmq_run(o, curve, payload, expected));
  return from_runs(curve ? kCurveCeilingName : "ZeroMQ PUSH->PULL, plaintext", runs,
                   format("loopback TCP, %s messages, zero-copy send, receiver reads 1 B/4 KiB; "
                          "2 contexts x %d I/O thread%s + sender + receiver thread",
                          human_bytes(o.chunk_bytes).c_str(), o.io_threads, o.io_threads == 1 ? "" : "s"));
}

// ---- end to end ------------------------------------------------------------------

// fedmesh's own path for one update of o.bytes (o.bytes / 4 fp32 parameters):
// encode + sign + send + receive + verify + decode over loopback CurveZMQ,
// timed from the sender holding the tensor to the receiver holding the decoded
// tensor, o.repeat times (build each result with from_runs).  Printed as its
// own table after the ceilings, with its fraction of the CurveZMQ ceiling.
// One run: a server thread (ServerSocket + UpdateService, as a receiving
// process runs them) and this thread as the sender (prepare_update, then
// upload_update over a ClientSocket), CurveZMQ with the ZAP allowlist on.
// Returns {prepare seconds, transfer seconds}; checks the decoded update.
struct EndToEndTimes {
  double prepare_seconds = 0;
  double transfer_seconds = 0;
};

EndToEndTimes end_to_end_run(const Options& o, const fedmesh::crypto::Roster& roster,
                             const fedmesh::crypto::SiteKeys& server_keys, const fedmesh::crypto::SiteKeys& site_keys,
                             const std::vector<fedmesh::protocol::TensorShape>& manifest,
                             const std::vector<std::vector<float>>& tensors, uint64_t sequence, bool sealed) {
  namespace fp = fedmesh::protocol;
  fp::ReceiverPolicy policy;
  policy.federation = roster.federation;
  policy.self = server_keys.identity.name;
  policy.manifest = manifest;
  policy.decode_runner = fedmesh::parallel_each;  // as fedmesh's processes do
  fp::TransportOptions transport;
  auto server = fp::ServerSocket::bind("tcp://127.0.0.1:*", fp::CurveKeys::from(server_keys),
                                       fp::allowlist_from_roster(roster), transport);
  if (!server.is_ok()) throw std::runtime_error(server.status().to_string());
  auto replay = fedmesh::crypto::ReplayGuard::in_memory();
  std::atomic<bool> stop{false};
  std::vector<fp::ReceivedUpdate> received;
  std::thread receiver([&] {
    fp::UpdateService service(policy, roster, replay, {}, (*server)->counters());
    while (!stop.load() && received.empty()) {
      auto frame = (*server)->receive(std::chrono::milliseconds(50));
      if (!frame.is_ok() || !frame->has_value()) continue;
      auto reply = service.handle(**frame);
      if (reply) (void)(*server)->send((**frame).routing_id, std::move(*reply));
      for (auto& update : service.take_completed()) received.push_back(std::move(update));
    }
  });
  auto client = fp::ClientSocket::connect((*server)->endpoint(), fp::CurveKeys::from(site_keys),
                                          server_keys.identity.box_public, transport);
  if (!client.is_ok() || !fp::wait_connected(**client, std::chrono::seconds(10)).is_ok()) {
    stop.store(true);
    receiver.join();
    throw std::runtime_error("end to end: no CurveZMQ connection to the server");
  }
  fp::UpdateMetadata metadata{roster.federation, 0, 0, site_keys.identity.name, server_keys.identity.name, sequence, 1};
  std::vector<std::span<const float>> spans(tensors.begin(), tensors.end());
  std::vector<fp::TensorPlan> plans(manifest.size());

  const auto t0 = Clock::now();
  // Sealed, as a site sends it: the stream holds a window of chunks
  // (those acknowledged let go), not the whole update.
  const fp::UploadOptions upload;
  auto prepared = sealed ? fp::prepare_sealed_update(metadata, manifest, spans, plans, site_keys, o.chunk_bytes,
                                                     fp::held_limit_for_window(upload.window_chunks))
                         : fp::prepare_update(metadata, manifest, spans, plans, site_keys, o.chunk_bytes);
  if (!prepared.is_ok()) throw std::runtime_error(prepared.status().to_string());
  const auto t1 = Clock::now();
  auto outcome = fp::upload_update(**client, *prepared, upload);
  const double transfer = seconds_since(t1);
  stop.store(true);
  receiver.join();
  if (!outcome.is_ok() || !outcome->accepted) {
    throw std::runtime_error("end to end: update not accepted: " +
                             (outcome.is_ok() && outcome->rejection ? outcome->rejection->reason
                                                                    : outcome.status().to_string()));
  }
  if (received.size() != 1 || received[0].tensors != tensors) {
    throw std::runtime_error("end to end: the decoded update differs from the one sent");
  }
  return {std::chrono::duration<double>(t1 - t0).count(), transfer};
}

std::vector<Measurement> measure_end_to_end(const Options& o) {
  namespace fp = fedmesh::protocol;
  namespace fc = fedmesh::crypto;
  // The update: o.bytes of fp32 in four tensors (a stand-in for a model's
  // largest layers), deterministic values, all finite.
  const uint64_t parameters = o.bytes / sizeof(float);
  std::vector<fp::TensorShape> manifest;
  std::vector<std::vector<float>> tensors;
  const uint64_t per_tensor = parameters / 4;
  for (int t = 0; t < 4; ++t) {
    const uint64_t count = t < 3 ? per_tensor : parameters - 3 * per_tensor;
    manifest.push_back({"layer" + std::to_string(t) + ".weight", {static_cast<int64_t>(count)}});
    std::vector<float> values(count);
    uint32_t state = 12345u + static_cast<uint32_t>(t);
    for (auto& v : values) {
      state = state * 1664525u + 1013904223u;
      v = static_cast<float>(static_cast<int32_t>(state)) * 1e-12f;
    }
    tensors.push_back(std::move(values));
  }
  fc::SiteKeys admin = fc::generate_site_keys("admin").value();
  fc::SiteKeys server = fc::generate_site_keys("aggregator").value();
  fc::SiteKeys site = fc::generate_site_keys("site-a").value();
  fc::Roster roster;
  roster.federation = "bench";
  roster.admin_public = admin.identity.sign_public;
  roster.sites.push_back({server.identity, fc::Role::kAggregator, ""});
  roster.sites.push_back({site.identity, fc::Role::kSite, ""});

  // Sealed and header-signed runs alternate, so that both see the same
  // machine.
  std::vector<double> total, prepare, transfer, sealed_total;
  const double bytes = static_cast<double>(parameters * sizeof(float));
  uint64_t sequence = 0;
  for (int r = 0; r < o.repeat; ++r) {
    const EndToEndTimes times = end_to_end_run(o, roster, server, site, manifest, tensors, ++sequence, false);
    total.push_back(bytes / (times.prepare_seconds + times.transfer_seconds) / 1e9);
    prepare.push_back(bytes / times.prepare_seconds / 1e9);
    transfer.push_back(bytes / times.transfer_seconds / 1e9);
    const EndToEndTimes sealed = end_to_end_run(o, roster, server, site, manifest, tensors, ++sequence, true);
    sealed_total.push_back(bytes / (sealed.prepare_seconds + sealed.transfer_seconds) / 1e9);
  }
  const std::string size = human_bytes(o.bytes) + " fp32 (" + std::to_string(parameters) + " parameters), " +
                           human_bytes(o.chunk_bytes) + " chunks";
  return {
      from_runs("fedmesh update, end to end, sealed", sealed_total,
                size + "; chunks encoded and hashed while the first are sent, signed seal last "
                       "(prepare_sealed_update); CurveZMQ + ZAP; checked bit for bit"),
      from_runs("fedmesh update, end to end, header-signed", total,
                size + "; encode + hash + sign + send + verify + decode, CurveZMQ + ZAP; checked bit for bit"),
      from_runs("  of which: prepare (encode, hash, sign)", prepare, "sender, before the first byte is sent"),
      from_runs("  of which: transfer (send, verify, decode)", transfer, "header to the final Ack"),
  };
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse_options(argc, argv);
  if (sodium_init() < 0) {
    std::fprintf(stderr, "%s: sodium_init failed\n", kProgram);
    return 1;
  }
  try {
    const MachineInfo machine = machine_info();
    print_machine(o, machine);

    Buffer payload;  // generated once, before the first section that needs it
    auto payload_bytes = [&]() -> const uint8_t* {
      if (!payload) payload = random_payload(o.bytes);
      return payload.get();
    };
    // Runs one section if selected; notes how busy other processes kept the CPUs meanwhile.
    auto run_section = [&](const std::string& section, const std::string& label, bool needs_payload,
                           const std::function<std::vector<Measurement>()>& measure, std::vector<Measurement>& into) {
      if (!o.runs(section)) return;
      progress(o, label);
      if (needs_payload) payload_bytes();
      const OtherLoad load;
      std::vector<Measurement> ms = measure();
      const double others = load.busy_cpus();
      for (auto& m : ms) {
        m.note += format("%sother work: %.2f CPUs", m.note.empty() ? "" : "; ", others);
        into.push_back(std::move(m));
      }
    };

    std::vector<Measurement> ceilings;
    run_section("memcpy", "memcpy", true, [&] { return std::vector{measure_memcpy(o, payload_bytes())}; }, ceilings);
    run_section("blake2b", "BLAKE2b-256", true, [&] { return measure_blake2b(o, payload_bytes()); }, ceilings);
    run_section("ed25519", "Ed25519", false, [&] { return measure_ed25519(o); }, ceilings);
    run_section("xsalsa20", "XSalsa20-Poly1305", true, [&] { return measure_xsalsa20poly1305(o, payload_bytes()); },
                ceilings);
    run_section("zmq-plain", "ZeroMQ plaintext", true,
                [&] { return std::vector{measure_zmq(o, false, payload_bytes())}; }, ceilings);
    run_section("zmq-curve", "ZeroMQ CurveZMQ", true,
                [&] { return std::vector{measure_zmq(o, true, payload_bytes())}; }, ceilings);
    payload.reset();
    print_measurements(o, ceilings, "ceiling");

    std::vector<Measurement> e2e;
    run_section("e2e", "end to end", false, [&] { return measure_end_to_end(o); }, e2e);
    const auto curve = std::find_if(ceilings.begin(), ceilings.end(),
                                    [](const Measurement& m) { return m.name == kCurveCeilingName; });
    if (curve != ceilings.end())
      for (auto& m : e2e)
        m.note += format("; %.0f%% of the CurveZMQ ceiling (median/median)", 100.0 * median_of(m) / median_of(*curve));
    print_measurements(o, e2e, "end to end");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", kProgram, e.what());
    return 1;
  }
  return 0;
}
