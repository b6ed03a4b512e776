// fedmesh-vopr: the fault simulator's driver. Runs seeded federations of the
// real aggregator and site runtimes, or of gossip peers, on virtual time
// (sim/vopr/) and checks
// the invariants of DESIGN.md after every step; a violation prints its seed,
// the virtual time and the last events, and the same seed replays it.
#include <sys/statvfs.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "sim/vopr/federation_run.h"
#include "sim/vopr/seeded_randomness.h"

namespace {

using fedmesh::sim::vopr::kSecond;
using fedmesh::sim::vopr::RunOptions;
using fedmesh::sim::vopr::RunResult;

void usage(FILE* out) {
  std::fprintf(out,
               "Usage: fedmesh-vopr [--seed N | --seeds-file FILE] [--seconds S] [--runs K] [options]\n"
               "\n"
               "Runs a federation of the real aggregator and site runtimes, or of real gossip\n"
               "peers, in one process on virtual time, with faults decided by a seed: message\n"
               "loss, duplication and\n"
               "delay, partitions, crashes at any wait or between any two writes of a store,\n"
               "power cuts losing unsynced writes, failed fsyncs, a full disk. Faults stop at\n"
               "--faults-until; the federation must then finish. The invariants of DESIGN.md\n"
               "(acknowledged updates durable, each counted once, one model per version, stores\n"
               "open and verify after every crash, liveness; gossip: every peer ends with the\n"
               "same replica, no update missing) are checked as it runs.\n"
               "\n"
               "  --seed N           run this seed only (replays a failure exactly)\n"
               "  --seeds-file FILE  run the seeds listed in FILE (one per line, SEED [MODE\n"
               "                     [ROUNDS]], # comments; a line's mode and rounds override\n"
               "                     --mode and --rounds)\n"
               "  --first-seed N     random seeds start here (default: from the clock)\n"
               "  --seconds S        keep running new seeds for S wall seconds (default 60)\n"
               "  --runs K           or stop after K seeds\n"
               "  --sites N          sites per federation (default 3)\n"
               "  --rounds R         rounds per federation (default 3)\n"
               "  --faults-until S   virtual seconds of faults (default 90)\n"
               "  --mode M           sync, async (FedBuff), private (secure aggregation), gossip\n"
               "                     (peers, no aggregator), or mixed: the seed picks (seed %% 4,\n"
               "                     in that order); default mixed\n"
               "  --no-faults        no faults at all (the baseline)\n"
               "  --replay-check     run every seed twice and require the same trace\n"
               "  --work DIR         scratch folder (default: a new one in /dev/shm when it has\n"
               "                     512 MB free, else in the temporary folder; removed at the end)\n"
               "  --verbose          print every seed's summary\n"
               "Exit status: 0 when every run held every invariant, 1 on a violation, 2 on bad usage.\n");
}

bool parse_number(const char* text, uint64_t& out) {
  char* end = nullptr;
  out = std::strtoull(text, &end, 10);
  return end != text && *end == '\0';
}

}  // namespace

int main(int argc, char** argv) {
  // First: libsodium's random bytes follow from each run's seed.
  fedmesh::sim::vopr::install_seeded_randomness();
  RunOptions options;
  struct Seed {
    uint64_t seed = 0;
    std::string mode;  // "": --mode
    int rounds = 0;    // 0: --rounds
  };
  std::vector<Seed> seeds;
  const auto known_mode = [](const std::string& m) {
    return m == "sync" || m == "async" || m == "private" || m == "gossip" || m == "mixed";
  };
  bool fixed = false, replay_check = false, verbose = false;
  uint64_t first_seed = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) % 1000000007;
  double seconds = 60.0;
  uint64_t runs = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "fedmesh-vopr: %s needs a value (see --help)\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    uint64_t n = 0;
    const auto number = [&]() {
      const char* v = value();
      if (!parse_number(v, n)) {
        std::fprintf(stderr, "fedmesh-vopr: %s: not a number: %s\n", a.c_str(), v);
        std::exit(2);
      }
      return n;
    };
    if (a == "-h" || a == "--help") {
      usage(stdout);
      return 0;
    } else if (a == "--seed") {
      seeds.push_back({number(), "", 0});
      fixed = true;
    } else if (a == "--seeds-file") {
      const char* file = value();
      std::ifstream in(file);
      if (!in) {
        std::fprintf(stderr, "fedmesh-vopr: cannot read %s\n", file);
        return 2;
      }
      std::string line;
      while (std::getline(in, line)) {
        if (const size_t hash = line.find('#'); hash != std::string::npos) line.resize(hash);
        while (!line.empty() && (line.back() == ' ' || line.back() == '\t' || line.back() == '\r')) line.pop_back();
        if (line.empty()) continue;
        std::vector<std::string> words;
        for (size_t at = line.find_first_not_of(" \t"); at != std::string::npos;) {
          const size_t end = line.find_first_of(" \t", at);
          words.push_back(line.substr(at, end == std::string::npos ? std::string::npos : end - at));
          at = end == std::string::npos ? end : line.find_first_not_of(" \t", end);
        }
        Seed entry;
        uint64_t rounds = 0;
        if (words.size() > 3 || !parse_number(words[0].c_str(), entry.seed) ||
            (words.size() > 1 && !known_mode(words[1])) ||
            (words.size() > 2 && (!parse_number(words[2].c_str(), rounds) || rounds < 1 || rounds > 100))) {
          std::fprintf(stderr, "fedmesh-vopr: %s: not SEED [MODE [ROUNDS]]: '%s'\n", file, line.c_str());
          return 2;
        }
        if (words.size() > 1) entry.mode = words[1];
        entry.rounds = static_cast<int>(rounds);
        seeds.push_back(entry);
      }
      fixed = true;
    } else if (a == "--first-seed") {
      first_seed = number();
    } else if (a == "--seconds") {
      seconds = static_cast<double>(number());
    } else if (a == "--runs") {
      runs = number();
    } else if (a == "--sites") {
      options.sites = static_cast<int>(number());
    } else if (a == "--rounds") {
      options.rounds = static_cast<int>(number());
    } else if (a == "--faults-until") {
      options.faults_until = static_cast<int64_t>(number()) * kSecond;
    } else if (a == "--mode") {
      options.mode = value();
      if (!known_mode(options.mode)) {
        std::fprintf(stderr, "fedmesh-vopr: --mode must be sync, async, private, gossip or mixed\n");
        return 2;
      }
    } else if (a == "--no-faults") {
      options.faults = false;
    } else if (a == "--replay-check") {
      replay_check = true;
    } else if (a == "--work") {
      options.work_dir = value();
    } else if (a == "--verbose") {
      verbose = true;
    } else {
      std::fprintf(stderr, "fedmesh-vopr: unknown argument %s (see --help)\n", a.c_str());
      return 2;
    }
  }
  if (options.sites < 1 || options.sites > 16 || options.rounds < 1 || options.rounds > 100) {
    std::fprintf(stderr, "fedmesh-vopr: --sites must be 1..16 and --rounds 1..100\n");
    return 2;
  }
  bool own_work = false;
  if (options.work_dir.empty()) {
    // In memory when there is room (a simulated fsync then costs nothing);
    // the stores of a run take a few MB.
    std::filesystem::path base = std::filesystem::temp_directory_path();
    struct statvfs shm {};
    if (::statvfs("/dev/shm", &shm) == 0 && ::access("/dev/shm", W_OK) == 0 &&
        static_cast<double>(shm.f_bavail) * static_cast<double>(shm.f_frsize) > 512.0 * (1 << 20)) {
      base = "/dev/shm";
    }
    options.work_dir = (base / ("fedmesh-vopr-" + std::to_string(::getpid()))).string();
    own_work = true;
  }
  const auto began = std::chrono::steady_clock::now();
  const auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count(); };
  uint64_t done = 0, rounds = 0, crashes = 0, steps = 0;
  int status = 0;
  const std::string default_mode = options.mode;
  const int default_rounds = options.rounds;
  for (uint64_t index = 0;; ++index) {
    if (fixed && index >= seeds.size()) break;
    if (!fixed && ((runs > 0 && index >= runs) || (runs == 0 && elapsed() >= seconds))) break;
    options.seed = fixed ? seeds[index].seed : first_seed + index;
    options.mode = fixed && !seeds[index].mode.empty() ? seeds[index].mode : default_mode;
    options.rounds = fixed && seeds[index].rounds > 0 ? seeds[index].rounds : default_rounds;
    RunResult result = fedmesh::sim::vopr::run_federation(options);
    if (result.ok && replay_check) {
      RunResult again = fedmesh::sim::vopr::run_federation(options);
      if (again.digest != result.digest || again.steps != result.steps) {
        result.ok = false;
        result.violation = "the seed did not replay: " + std::to_string(result.steps) + " then " +
                           std::to_string(again.steps) + " steps, digests differ";
        // The first of the last events that differs (both keep the last 400).
        for (size_t i = 0; i < std::min(result.recent.size(), again.recent.size()); ++i) {
          if (result.recent[i] != again.recent[i]) {
            result.violation += "; first difference in the last events:\n    " + result.recent[i] + "\n    " + again.recent[i];
            break;
          }
        }
      }
    }
    ++done;
    rounds += static_cast<uint64_t>(std::max<int64_t>(0, result.rounds_committed));
    crashes += static_cast<uint64_t>(result.crashes);
    steps += result.steps;
    if (verbose || !result.ok) {
      std::printf("seed %llu (%s): %s, %lld rounds, %d crashes, %d restarts, %d partitions, %llu/%llu messages lost, "
                  "%d store checks, %d ack checks, %.1f virtual s, %llu steps, digest %016llx\n",
                  static_cast<unsigned long long>(options.seed), fedmesh::sim::vopr::run_mode(options).c_str(),
                  result.ok ? "ok" : "VIOLATION",
                  static_cast<long long>(result.rounds_committed), result.crashes, result.restarts, result.partitions,
                  static_cast<unsigned long long>(result.messages_dropped),
                  static_cast<unsigned long long>(result.messages), result.stores_checked, result.acks_checked,
                  static_cast<double>(result.at) / static_cast<double>(kSecond),
                  static_cast<unsigned long long>(result.steps), static_cast<unsigned long long>(result.digest));
    }
    if (!result.ok) {
      std::printf("VIOLATION at %.3f virtual s: %s\nlast events:\n", static_cast<double>(result.at) / 1e9,
                  result.violation.c_str());
      for (const std::string& line : result.recent) std::printf("  %s\n", line.c_str());
      std::printf("replay: fedmesh-vopr --seed %llu --sites %d --rounds %d --mode %s%s\n",
                  static_cast<unsigned long long>(options.seed), options.sites, options.rounds,
                  fedmesh::sim::vopr::run_mode(options).c_str(), options.faults ? "" : " --no-faults");
      status = 1;
      break;
    }
    std::fflush(stdout);
  }
  const double wall = elapsed();
  std::printf("fedmesh-vopr: %llu seeds, %llu rounds committed, %llu crashes, %llu steps in %.1f s: %.2f seeds/s, %.1f rounds/s\n",
              static_cast<unsigned long long>(done), static_cast<unsigned long long>(rounds),
              static_cast<unsigned long long>(crashes), static_cast<unsigned long long>(steps), wall,
              static_cast<double>(done) / std::max(wall, 1e-9), static_cast<double>(rounds) / std::max(wall, 1e-9));
  if (own_work) {
    std::error_code error;
    std::filesystem::remove_all(options.work_dir, error);
  }
  return status;
}
