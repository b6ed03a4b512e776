// The deterministic world the fault simulator runs the real runtimes in.
//
// Every simulated process (the aggregator, each site, each gossip peer) is a
// thread running the production runtime unchanged, with the helper threads
// it starts (SimThreads: a gossip peer's links), but only one thread runs at
// a time: a thread runs until it waits (its clock's sleep, a channel's
// receive, a helper's wait for work, a join), and
// the scheduler then picks what happens next on virtual time: the earliest
// message delivery or wake-up, ties in the order they were scheduled. The
// seeded PRNG decides every drop, delay, duplication, partition and crash,
// so a seed replays the same run step for step.
//
// A crash marks the process killed and its disk dead (every later file
// operation fails): it goes on only to its next wait, which throws
// SimulatedCrash, and unwinds without writing anything more, as kill -9
// would leave it. Its channels and its helper threads go with it.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/threads.h"
#include "protocol/transport.h"

namespace fedmesh::sim::vopr {

// Thrown out of a wait of a killed process; caught at the top of its thread.
struct SimulatedCrash {};

// Virtual time is nanoseconds since the start of the run.
using Nanos = int64_t;
inline constexpr Nanos kMillisecond = 1'000'000;
inline constexpr Nanos kSecond = 1'000'000'000;

// What happens to messages on the simulated network.
struct NetworkFaults {
  double drop = 0.0;         // each message lost
  double duplicate = 0.0;    // each message delivered twice
  Nanos latency = kMillisecond;
  Nanos jitter = 5 * kMillisecond;  // uniform extra delay: messages reorder
  double long_delay = 0.0;   // a message held up to `long_delay_max` more
  Nanos long_delay_max = 2 * kSecond;
};

class World;
class SimServerChannel;
class SimClientChannel;

// A simulated process, or a helper thread of one (`parent`: the process's
// id; it shares the process's name, crash and clock).
struct Process {
  int id = 0;
  int parent = -1;
  std::string name;
  std::function<void()> body;  // the runtime: start, run, return (or throw SimulatedCrash)
  std::thread thread;
  bool alive = false;       // its thread is running the body
  bool killed = false;      // its next wait throws SimulatedCrash
  bool disk_dead = false;   // its file operations fail (it has crashed)
  bool waiting = false;     // blocked in a wait, resumable
  bool receiving = false;   // a delivery to one of its channels wakes it at once
  const void* waiting_on = nullptr;  // SimThreads: the condition it waits for (a notification wakes it)
  Nanos wake_at = 0;
  uint64_t wait_order = 0;
  int incarnation = 0;
  int64_t wall_clock_offset_micros = 0;  // its Unix clock against virtual time (clock jumps)
  std::condition_variable turn;  // signalled when it is handed the baton
};

class World {
 public:
  explicit World(uint64_t seed);
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  std::mt19937_64& rng() { return rng_; }
  double uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(rng_); }
  bool chance(double p) { return p > 0.0 && uniform() < p; }
  Nanos now() const { return now_; }

  NetworkFaults faults;

  // A process whose body runs on its own thread once started. Returns its id.
  int add_process(std::string name, std::function<void()> body);
  // The process `id` names (a helper thread's id names its process).
  Process& process(int id) { return *processes_.at(static_cast<size_t>(root_of(id))); }
  size_t process_count() const { return processes_.size(); }
  // Starts (or restarts) a process that is not alive; it first runs at the
  // current virtual time.
  void start(int id);
  // Kills a process: its disk is dead from now on and its next wait throws.
  // A waiting process is resumed at once to unwind. Returns once it has
  // (when called by the scheduler) or marks it (when called by the process
  // itself, e.g. the VFS deciding a crash in the middle of a write).
  void kill(int id);
  // The process whose thread (or helper thread) holds the baton, or -1
  // (the scheduler).
  int running() const { return running_ < 0 ? -1 : root_of(running_); }

  // Helper threads, called by a process's thread: starts `body` as a helper
  // of the running process (it first runs at the current virtual time) and
  // returns its id; join waits (on virtual time) until it has ended.
  int start_helper(std::function<void()> body);
  void join_helper(int id);

  // One step: delivers the earliest due message or resumes the earliest
  // process. false when nothing is left to do before `until`.
  bool step(Nanos until);
  // Moves virtual time to `t` when nothing happens before it.
  void advance_to(Nanos t) { now_ = std::max(now_, t); }

  // Called by processes (their clock and channels). `on`: a condition
  // (SimThreads) whose notify() wakes the waiter at once.
  void wait(Nanos wake_at, bool receiving, const void* on = nullptr);
  // Wakes every thread waiting on `on`, at the current time.
  void notify(const void* on);

  // The network: channels register here; sends go through deliver().
  void bind(const std::string& endpoint, SimServerChannel* channel);
  void unbind(const std::string& endpoint, SimServerChannel* channel);
  SimServerChannel* bound(const std::string& endpoint) const;
  uint64_t register_client(SimClientChannel* channel);
  void unregister_client(uint64_t id);
  // Schedules bytes from a process to a channel, through the faults.
  void send_to_server(const std::string& endpoint, const std::string& from, uint64_t client_id,
                      std::vector<uint8_t> bytes);
  void send_to_client(uint64_t client_id, std::vector<uint8_t> bytes);
  // Cuts (or heals) the link between a process and everyone else.
  void set_partitioned(const std::string& name, bool cut) { partitioned_[name] = cut; }
  bool partitioned(const std::string& name) const;

  // A hook every message from the server side passes (the checker reads
  // Acks and RoundAnnounces off the wire): name of the client's process and the bytes.
  std::function<void(const std::string& to, std::span<const uint8_t> bytes)> on_server_message;
  // Readable record of what happened (the last events are printed on a violation).
  void trace(const std::string& line);
  const std::deque<std::string>& recent() const { return recent_; }
  uint64_t trace_digest() const { return digest_; }
  uint64_t steps() const { return steps_; }
  uint64_t messages_sent() const { return messages_sent_; }
  uint64_t messages_dropped() const { return messages_dropped_; }

 private:
  struct Delivery {
    Nanos at = 0;
    uint64_t order = 0;
    bool to_server = false;
    std::string endpoint;      // to_server
    std::string from;          // to_server: the sender's roster name
    uint64_t client_id = 0;    // the client channel (either direction)
    std::vector<uint8_t> bytes;
  };
  void schedule(Delivery delivery, const std::string& sender, const std::string& receiver);
  void run_body(Process& p);
  static constexpr int kHelperBase = 1 << 20;  // helper ids: kHelperBase + index
  int root_of(int id) const { return id >= kHelperBase ? helpers_.at(static_cast<size_t>(id - kHelperBase))->parent : id; }
  Process& entry(int id) {  // the thread's own record
    return id >= kHelperBase ? *helpers_.at(static_cast<size_t>(id - kHelperBase)) : *processes_.at(static_cast<size_t>(id));
  }
  // Hands the baton back until `wake_at`; `interruptible`: a killed
  // process's thread throws SimulatedCrash instead of waiting.
  void park(Nanos wake_at, bool receiving, bool interruptible, const void* on = nullptr);
  void resume(Process& p);  // scheduler side: hand the baton and wait for it back

  std::mt19937_64 rng_;
  Nanos now_ = 0;
  uint64_t order_ = 0;
  std::vector<std::unique_ptr<Process>> processes_;
  std::vector<std::unique_ptr<Process>> helpers_;
  std::vector<Delivery> deliveries_;  // unordered; the earliest is picked
  std::map<std::string, SimServerChannel*> servers_;
  std::map<uint64_t, SimClientChannel*> clients_;
  uint64_t next_client_ = 1;
  std::map<std::string, bool> partitioned_;

  std::mutex mutex_;
  std::condition_variable scheduler_turn_;  // signalled when a process hands the baton back
  int running_ = -1;

  std::deque<std::string> recent_;
  uint64_t digest_ = 1469598103934665603ull;
  uint64_t steps_ = 0, messages_sent_ = 0, messages_dropped_ = 0;
};

// A process's clock: virtual time; sleeping is a wait.
class SimClock final : public Clock {
 public:
  explicit SimClock(World& world) : world_(world) {}
  time_point now() override { return time_point(std::chrono::nanoseconds(world_.now())); }
  uint64_t unix_micros() override;
  void sleep_for(duration d) override;

 private:
  World& world_;
};

// A process's helper threads: helpers in the world; a wait for work is a
// wait on virtual time that a notification ends at once.
class SimThreads final : public Threads {
 public:
  explicit SimThreads(World& world) : world_(world) {}
  std::unique_ptr<Handle> start(std::function<void()> body) override;
  void wait_for(std::condition_variable& changed, std::unique_lock<std::mutex>& lock,
                Clock::duration timeout) override;
  void notify_all(std::condition_variable& changed) override { world_.notify(&changed); }

 private:
  World& world_;
};

// The aggregator's socket in the world: frames from clients come in with the
// client's roster name as `peer` (the ZAP identity on the real transport).
class SimServerChannel final : public protocol::ServerChannel {
 public:
  SimServerChannel(World& world, Clock& clock, std::string endpoint, int process);
  ~SimServerChannel() override;
  const std::string& endpoint() const override { return endpoint_; }
  Result<std::optional<protocol::Incoming>> receive(std::chrono::milliseconds timeout) override;
  Status send(const std::string& routing_id, protocol::OutgoingMessage message) override;
  Status send(const std::string& routing_id, const protocol::SharedMessage& message) override;
  void set_allowlist(protocol::Allowlist) override {}
  protocol::TransportCounters& counters() override { return counters_; }
  Clock& clock() override { return clock_; }

  void deliver(std::string from, uint64_t client_id, std::vector<uint8_t> bytes);
  int process() const { return process_; }

 private:
  Status send_bytes(const std::string& routing_id, std::span<const uint8_t> bytes);
  World& world_;
  Clock& clock_;
  std::string endpoint_;
  int process_;
  std::deque<protocol::Incoming> inbox_;
  protocol::TransportCounters counters_;
};

class SimClientChannel final : public protocol::ClientChannel {
 public:
  SimClientChannel(World& world, Clock& clock, std::string endpoint, std::string name, int process);
  ~SimClientChannel() override;
  Result<std::optional<protocol::Incoming>> receive(std::chrono::milliseconds timeout) override;
  Status send(protocol::OutgoingMessage message, std::chrono::milliseconds timeout) override;
  Status send(const protocol::SharedMessage& message, std::chrono::milliseconds timeout) override;
  bool connected() override;
  bool handshake_refused() override { return false; }
  protocol::TransportCounters& counters() override { return counters_; }
  Clock& clock() override { return clock_; }

  void deliver(std::vector<uint8_t> bytes);
  int process() const { return process_; }
  const std::string& name() const { return name_; }

 private:
  Status send_bytes(std::span<const uint8_t> bytes);
  World& world_;
  Clock& clock_;
  std::string endpoint_, name_;
  int process_;
  uint64_t id_ = 0;
  std::deque<protocol::Incoming> inbox_;
  protocol::TransportCounters counters_;
};

// The network a runtime binds and dials through, for one process.
class SimNetwork final : public protocol::Network {
 public:
  SimNetwork(World& world, Clock& clock, int process, std::string name)
      : world_(world), clock_(clock), process_(process), name_(std::move(name)) {}
  Result<std::unique_ptr<protocol::ServerChannel>> bind(const std::string& endpoint, const protocol::CurveKeys& keys,
                                                        protocol::Allowlist allowlist,
                                                        const protocol::TransportOptions& options) override;
  Result<std::unique_ptr<protocol::ClientChannel>> connect(const std::string& endpoint,
                                                           const protocol::CurveKeys& keys,
                                                           const crypto::BoxPublicKey& server_public,
                                                           const protocol::TransportOptions& options) override;

 private:
  World& world_;
  Clock& clock_;
  int process_;
  std::string name_;
};

}  // namespace fedmesh::sim::vopr
