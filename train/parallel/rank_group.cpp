#include "train/parallel/rank_group.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "kernels/cuda_ops.h"

namespace fedmesh::train {

namespace {

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("was killed by signal ") + strsignal(WTERMSIG(status));
  return "stopped";
}

// Writes all of `text` (a pipe write of a short line is atomic; a full
// pipe blocks, which only a rank that stopped reading causes).
bool write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

Status RankFlags::validate() const {
  if (ranks < 1 || ranks > kMaxRanks) {
    return invalid_argument("--ranks must be in [1, " + std::to_string(kMaxRanks) + "], not " + std::to_string(ranks));
  }
  if (tensor_parallel < 1 || tensor_parallel > kMaxRanks || processes() > kMaxRanks) {
    return invalid_argument("--tensor-parallel " + std::to_string(tensor_parallel) + " with --ranks " + std::to_string(ranks) +
                            ": the group would have " + std::to_string(static_cast<int64_t>(ranks) * tensor_parallel) +
                            " processes, at most " + std::to_string(kMaxRanks));
  }
  if (rank < 0 || rank >= processes()) {
    return invalid_argument("--rank " + std::to_string(rank) + " is not one of the " + std::to_string(processes()) + " ranks");
  }
  if (launched() && rendezvous.empty()) return invalid_argument("--rank needs --rendezvous (set by rank 0)");
  if (!launched() && !rendezvous.empty()) return invalid_argument("--rendezvous is set by rank 0 for the ranks it launches");
  return Status::ok();
}

namespace {

// The group's communicator: Gloo for CPU ranks; NCCL for GPU ranks, on
// device process_rank (the process's rank in its launch; options.rank by
// default) modulo the GPUs, made this process's device first.
Result<std::unique_ptr<Communicator>> connect_ranks(const RendezvousOptions& options, Device device, int process_rank = -1) {
  if (device == Device::kCpu) return make_gloo_communicator(options);
  Result<int> index = cuda::use_device_for_rank(process_rank >= 0 ? process_rank : options.rank);
  if (!index.is_ok()) return index.status();
  return make_nccl_communicator(options, *index);
}

}  // namespace

Result<std::unique_ptr<RankGroup>> RankGroup::launch(int ranks, std::chrono::milliseconds timeout, Device device) {
  if (ranks < 2 || ranks > kMaxRanks) return invalid_argument("a rank group has 2 to " + std::to_string(kMaxRanks) + " ranks");
  std::error_code ec;
  const std::filesystem::path executable = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return io_error("cannot find this program to launch the ranks: " + ec.message());
  // This process's arguments, NUL-separated, argv[0] first.
  std::vector<std::string> arguments;
  {
    std::ifstream in("/proc/self/cmdline", std::ios::binary);
    std::string argument;
    while (std::getline(in, argument, '\0')) arguments.push_back(argument);
    if (arguments.empty()) return io_error("cannot read this process's arguments from /proc/self/cmdline");
    arguments.erase(arguments.begin());
  }
  std::string pattern = (std::filesystem::temp_directory_path() / "fedmesh-ranks-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) return io_error("cannot make the ranks' rendezvous directory: " + std::string(strerror(errno)));

  std::unique_ptr<RankGroup> group(new RankGroup());
  group->directory_ = pattern;
  for (int rank = 1; rank < ranks; ++rank) {
    // Everything the child needs is built before fork: between fork and
    // exec only async-signal-safe calls.
    std::vector<std::string> argv_strings;
    argv_strings.push_back(executable.string());
    argv_strings.insert(argv_strings.end(), arguments.begin(), arguments.end());
    for (std::string extra : {std::string("--rank"), std::to_string(rank), std::string("--rendezvous"), pattern}) {
      argv_strings.push_back(std::move(extra));
    }
    std::vector<char*> argv;
    for (std::string& a : argv_strings) argv.push_back(a.data());
    argv.push_back(nullptr);
    int pipe_fds[2];
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return io_error("cannot make a command pipe: " + std::string(strerror(errno)));
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) {
      ::close(pipe_fds[0]);
      ::close(pipe_fds[1]);
      return io_error("cannot launch rank " + std::to_string(rank) + ": " + strerror(errno));
    }
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);  // rank 0 died before prctl
      ::dup2(pipe_fds[0], STDIN_FILENO);
      const int null = ::open("/dev/null", O_WRONLY);
      if (null >= 0) ::dup2(null, STDOUT_FILENO);
      ::close_range(3, ~0U, 0);  // rank 0's sockets and files are not the rank's
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(pipe_fds[0]);
    group->pids_.push_back(pid);
    group->command_fds_.push_back(pipe_fds[1]);
    group->exit_statuses_.push_back(-1);
  }
  RendezvousOptions options;
  options.directory = pattern;
  options.rank = 0;
  options.size = ranks;
  options.timeout = timeout;
  Result<std::unique_ptr<Communicator>> communicator = connect_ranks(options, device);
  if (!communicator.is_ok()) {
    // Say why when a rank failed at start (a bad flag, no data) rather than
    // only that it never arrived.
    FEDMESH_RETURN_IF_ERROR(group->check_ranks());
    return communicator.status();
  }
  group->communicator_ = std::move(*communicator);
  return group;
}

void RankGroup::reap(size_t index, bool block) {
  if (exit_statuses_[index] < 0) {
    int status = 0;
    pid_t done;
    do {
      done = ::waitpid(pids_[index], &status, block ? 0 : WNOHANG);
    } while (done < 0 && errno == EINTR);
    if (done == pids_[index]) exit_statuses_[index] = status;
  }
}

Status RankGroup::check_ranks() {
  for (size_t i = 0; i < pids_.size(); ++i) {
    reap(i, false);
    if (exit_statuses_[i] >= 0) {
      return unavailable("rank " + std::to_string(i + 1) + " " + describe_exit(exit_statuses_[i]) +
                         " (its messages are above)");
    }
  }
  return Status::ok();
}

Status RankGroup::command(const nlohmann::json& line) {
  FEDMESH_RETURN_IF_ERROR(check_ranks());
  const std::string text = line.dump() + "\n";
  for (size_t i = 0; i < command_fds_.size(); ++i) {
    if (!write_all(command_fds_[i], text)) {
      return unavailable("rank " + std::to_string(i + 1) + " stopped reading its commands: " + strerror(errno));
    }
  }
  return Status::ok();
}

Status RankGroup::join(std::chrono::milliseconds timeout) {
  for (int& fd : command_fds_) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  Status failed = Status::ok();
  for (size_t i = 0; i < pids_.size(); ++i) {
    while (exit_statuses_[i] < 0 && std::chrono::steady_clock::now() < deadline) {
      reap(i, false);
      if (exit_statuses_[i] < 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (exit_statuses_[i] < 0) {
      ::kill(pids_[i], SIGKILL);
      reap(i, true);
      if (failed.is_ok()) failed = unavailable("rank " + std::to_string(i + 1) + " did not exit in time and was killed");
    } else if (!(WIFEXITED(exit_statuses_[i]) && WEXITSTATUS(exit_statuses_[i]) == 0) && failed.is_ok()) {
      failed = unavailable("rank " + std::to_string(i + 1) + " " + describe_exit(exit_statuses_[i]));
    }
  }
  return failed;
}

RankGroup::~RankGroup() {
  communicator_.reset();
  (void)join(std::chrono::milliseconds(5000));
  std::error_code ec;
  std::filesystem::remove_all(directory_, ec);
}

Result<std::unique_ptr<Communicator>> join_rank_group(const RankFlags& flags, std::chrono::milliseconds timeout,
                                                      Device device) {
  FEDMESH_RETURN_IF_ERROR(flags.validate());
  if (!flags.launched()) return invalid_argument("this process is rank 0: it launches the group, it does not join one");
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  RendezvousOptions options;
  options.directory = flags.rendezvous;
  options.rank = flags.rank;
  options.size = flags.processes();
  options.timeout = timeout;
  return connect_ranks(options, device);
}

Result<ParallelGroups> connect_parallel_groups(const RankFlags& flags, Device device, std::chrono::milliseconds timeout) {
  if (flags.rendezvous.empty()) return invalid_argument("connect_parallel_groups needs the group's rendezvous directory");
  ParallelGroups groups;
  // Tensor groups first, then data-parallel ones, on every process: each
  // waits only for members that connect in the same order.
  const auto connect = [&](const std::string& name, int rank, int size) -> Result<std::unique_ptr<Communicator>> {
    RendezvousOptions options;
    options.directory = (std::filesystem::path(flags.rendezvous) / name).string();
    options.rank = rank;
    options.size = size;
    options.timeout = timeout;
    return connect_ranks(options, device, flags.rank);  // GPU ranks: the process's own device
  };
  if (flags.tensor_parallel > 1) {
    Result<std::unique_ptr<Communicator>> tensor =
        connect("tensor-" + std::to_string(flags.data_rank()), flags.tensor_rank(), flags.tensor_parallel);
    if (!tensor.is_ok()) return tensor.status();
    groups.tensor = std::move(*tensor);
  }
  if (flags.ranks > 1) {
    Result<std::unique_ptr<Communicator>> data =
        connect("data-" + std::to_string(flags.tensor_rank()), flags.data_rank(), flags.ranks);
    if (!data.is_ok()) return data.status();
    groups.data = std::move(*data);
  }
  return groups;
}

Result<std::optional<nlohmann::json>> read_rank_command() {
  std::string line;
  if (!std::getline(std::cin, line)) return std::optional<nlohmann::json>{};
  nlohmann::json command = nlohmann::json::parse(line, nullptr, false);
  if (!command.is_object()) return invalid_argument("rank 0 sent a command that is not a JSON object: " + line.substr(0, 80));
  return std::optional<nlohmann::json>(std::move(command));
}

}  // namespace fedmesh::train
