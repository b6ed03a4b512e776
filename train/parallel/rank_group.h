// In-site ranks as processes. The process the operator starts
// (`fedmesh train --ranks N`, `fedmesh node --ranks N`) is rank 0: it makes
// a fresh rendezvous directory, launches ranks 1..N-1 as copies of its own
// binary with the same arguments plus `--rank R --rendezvous DIR`, and
// connects the Communicator with them. Rank 0 keeps a command pipe to each
// rank (its stdin): a rank that waits for work (a site between rounds)
// blocks there, not in a collective, so the time between rounds is not
// bounded by the collectives' timeout, and it exits when rank 0 closes the
// pipe. A rank also dies with rank 0 (PR_SET_PDEATHSIG), so no orphan keeps
// a GPU or a core after a crash.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "kernels/tensor.h"
#include "train/parallel/communicator.h"

namespace fedmesh::train {

// What the flags of one process say about its place in the group.
// The group has ranks x tensor_parallel processes: data-parallel groups of
// tensor_parallel ranks each (tensor_parallel_model.h); process g is tensor
// rank g % tensor_parallel of data-parallel rank g / tensor_parallel.
struct RankFlags {
  int ranks = 1;            // --ranks: data-parallel ranks (1: none)
  int tensor_parallel = 1;  // --tensor-parallel: ranks sharing each model's transformer blocks (1: none)
  int rank = 0;             // --rank (hidden): set by rank 0 for the processes it launches
  std::string rendezvous;   // --rendezvous (hidden): the launch's directory
  int processes() const { return ranks * tensor_parallel; }
  int tensor_rank() const { return rank % tensor_parallel; }
  int data_rank() const { return rank / tensor_parallel; }
  bool launched() const { return rank > 0; }
  Status validate() const;
};

inline constexpr int kMaxRanks = 64;
inline constexpr std::chrono::milliseconds kRankTimeout{60000};

class RankGroup {
 public:
  // Launches this process's own binary with its own arguments (from
  // /proc/self/cmdline) once for every rank 1..ranks-1, then connects as
  // rank 0. The ranks' stdout goes to /dev/null (rank 0 speaks for the
  // group); their stderr is this process's.
  // Device kCuda: GPU ranks, each on device rank modulo the GPUs, meeting
  // through NCCL (kernels' use_device_for_rank, make_nccl_communicator).
  static Result<std::unique_ptr<RankGroup>> launch(int ranks, std::chrono::milliseconds timeout = kRankTimeout,
                                                   Device device = Device::kCpu);
  // Closes the command pipes (the ranks exit on end of file), waits for the
  // ranks a few seconds, kills any left and removes the directory.
  ~RankGroup();
  RankGroup(const RankGroup&) = delete;
  RankGroup& operator=(const RankGroup&) = delete;

  Communicator& communicator() { return *communicator_; }
  // The launch's rendezvous directory (connect_parallel_groups meets there).
  const std::string& directory() const { return directory_; }
  int size() const { return static_cast<int>(pids_.size()) + 1; }
  // Sends one command (a JSON object on one line) to every other rank.
  // kUnavailable naming the rank when one has exited.
  Status command(const nlohmann::json& line);
  // kUnavailable naming the first rank that has exited, and how.
  Status check_ranks();
  // Waits for every rank to exit; an error names a rank that failed.
  Status join(std::chrono::milliseconds timeout = kRankTimeout);

 private:
  RankGroup() = default;
  std::string directory_;
  std::vector<pid_t> pids_;          // rank r at r - 1
  std::vector<int> command_fds_;     // write ends of the ranks' stdin
  std::vector<int> exit_statuses_;   // -1 while running
  std::unique_ptr<Communicator> communicator_;
  void reap(size_t index, bool block);  // records rank index+1's exit status if it has exited
};

// In a launched rank: makes it die with its parent, then connects to the
// group (kUnavailable after the timeout when rank 0 is gone).
Result<std::unique_ptr<Communicator>> join_rank_group(const RankFlags& flags,
                                                      std::chrono::milliseconds timeout = kRankTimeout,
                                                      Device device = Device::kCpu);

// The communicators of tensor x data parallelism, for every process of a
// group of flags.processes() (rank 0 gives its group's directory() as
// flags.rendezvous): the tensor group (the ranks of its data-parallel rank)
// when flags.tensor_parallel > 1, and the data-parallel group (the ranks of
// its tensor rank) when flags.ranks > 1; each meets in its own
// subdirectory of the launch's directory. Every process of the group calls
// it, after the group has connected.
struct ParallelGroups {
  std::unique_ptr<Communicator> tensor;  // null without tensor parallelism
  std::unique_ptr<Communicator> data;    // null without data-parallel ranks
};
Result<ParallelGroups> connect_parallel_groups(const RankFlags& flags, Device device,
                                               std::chrono::milliseconds timeout = kRankTimeout);

// In a launched rank: the next command from rank 0 (blocks); nullopt when
// rank 0 closed the pipe (time to exit), kInvalidArgument for a line that
// is not a JSON object.
Result<std::optional<nlohmann::json>> read_rank_command();

}  // namespace fedmesh::train
