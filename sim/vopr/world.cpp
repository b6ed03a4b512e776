#include "sim/vopr/world.h"

#include <algorithm>
#include <exception>
#include <stdexcept>
#include <utility>

namespace fedmesh::sim::vopr {
namespace {

// Every wait advances time at least this much, so a loop that polls with a
// zero timeout still lets the rest of the world move.
constexpr Nanos kMinimumWait = 10'000;
constexpr size_t kRecentEvents = 400;
// Virtual Unix time starts here (2027-01-15), so sequences look like real ones.
constexpr uint64_t kUnixMicrosAtStart = 1'800'000'000'000'000ull;

}  // namespace

World::World(uint64_t seed) : rng_(seed) {}

World::~World() {
  for (auto& p : processes_) {
    if (p->alive) kill(p->id);
    if (p->thread.joinable()) p->thread.join();
  }
  for (auto& h : helpers_) {
    if (h->thread.joinable()) h->thread.join();
  }
}

int World::start_helper(std::function<void()> body) {
  if (running_ < 0) throw std::logic_error("World::start_helper: called outside a simulated process");
  auto h = std::make_unique<Process>();
  h->id = kHelperBase + static_cast<int>(helpers_.size());
  h->parent = root_of(running_);
  h->name = process(h->parent).name;
  h->body = std::move(body);
  h->alive = true;
  h->waiting = true;
  h->wake_at = now_;
  h->wait_order = ++order_;
  Process& helper = *h;
  helpers_.push_back(std::move(h));
  helper.thread = std::thread([this, &helper] { run_body(helper); });
  return helper.id;
}

void World::join_helper(int id) {
  Process& h = entry(id);
  while (h.alive) park(now_ + kMinimumWait, false, false);
  if (h.thread.joinable()) h.thread.join();
}

int World::add_process(std::string name, std::function<void()> body) {
  auto p = std::make_unique<Process>();
  p->id = static_cast<int>(processes_.size());
  p->name = std::move(name);
  p->body = std::move(body);
  processes_.push_back(std::move(p));
  return processes_.back()->id;
}

void World::start(int id) {
  Process& p = process(id);
  if (p.alive) return;
  if (p.thread.joinable()) p.thread.join();
  p.alive = true;
  p.killed = false;
  p.disk_dead = false;
  p.receiving = false;
  p.waiting = true;
  p.wake_at = now_;
  p.wait_order = ++order_;
  ++p.incarnation;
  trace("start " + p.name + " (incarnation " + std::to_string(p.incarnation) + ")");
  p.thread = std::thread([this, &p] { run_body(p); });
}

void World::run_body(Process& p) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    p.turn.wait(lock, [&] { return running_ == p.id; });
  }
  std::string failure;
  try {
    p.body();
  } catch (const SimulatedCrash&) {
  } catch (const std::exception& e) {
    failure = e.what();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  if (!failure.empty()) {
    recent_.push_back("exception in " + p.name + ": " + failure);
  }
  p.alive = false;
  p.waiting = false;
  running_ = -1;
  scheduler_turn_.notify_one();
}

void World::resume(Process& p) {
  std::unique_lock<std::mutex> lock(mutex_);
  p.waiting = false;
  running_ = p.id;
  p.turn.notify_one();
  scheduler_turn_.wait(lock, [&] { return running_ == -1; });
}

void World::wait(Nanos wake_at, bool receiving, const void* on) { park(wake_at, receiving, true, on); }

void World::notify(const void* on) {
  const auto wake = [&](Process& p) {
    if (p.alive && p.waiting && p.waiting_on == on && p.wake_at > now_) {
      p.wake_at = now_;
      p.wait_order = ++order_;
    }
  };
  for (auto& p : processes_) wake(*p);
  for (auto& h : helpers_) wake(*h);
}

void World::park(Nanos wake_at, bool receiving, bool interruptible, const void* on) {
  const Process& root = process(running_);
  if (interruptible && root.killed) {
    // Unwinding after a crash: nothing waits any more.
    if (std::uncaught_exceptions() > 0) return;
    throw SimulatedCrash{};
  }
  Process& p = entry(running_);
  {
    std::unique_lock<std::mutex> lock(mutex_);
    p.wake_at = std::max(wake_at, now_ + kMinimumWait);
    p.receiving = receiving;
    p.waiting_on = on;
    p.waiting = true;
    p.wait_order = ++order_;
    const int self = p.id;
    running_ = -1;
    scheduler_turn_.notify_one();
    p.turn.wait(lock, [&] { return running_ == self; });
    p.receiving = false;
    p.waiting_on = nullptr;
  }
  if (interruptible && root.killed && std::uncaught_exceptions() == 0) throw SimulatedCrash{};
}

void World::kill(int id) {
  Process& p = process(id);
  if (!p.alive) return;
  p.killed = true;
  p.disk_dead = true;
  if (running() == id) return;  // the process itself: it stops at its next wait
  trace("crash " + p.name);
  // Its helper threads unwind first (each ends at its wait), then the
  // process, whose joins then find them ended.
  for (auto& h : helpers_) {
    if (h->parent == id && h->alive && h->waiting) resume(*h);
  }
  if (p.waiting) resume(p);  // it unwinds and its thread ends
  if (p.thread.joinable()) p.thread.join();
}

bool World::step(Nanos until) {
  ++steps_;
  const Delivery* first = nullptr;
  for (const Delivery& d : deliveries_) {
    if (first == nullptr || d.at < first->at || (d.at == first->at && d.order < first->order)) first = &d;
  }
  Process* next = nullptr;
  const auto consider = [&](Process& p) {
    if (!p.alive || !p.waiting) return;
    if (next == nullptr || p.wake_at < next->wake_at || (p.wake_at == next->wake_at && p.wait_order < next->wait_order)) {
      next = &p;
    }
  };
  for (auto& p : processes_) consider(*p);
  for (auto& h : helpers_) consider(*h);
  if (first != nullptr && (next == nullptr || first->at <= next->wake_at)) {
    if (first->at > until) return false;
    now_ = std::max(now_, first->at);
    Delivery d = std::move(const_cast<Delivery&>(*first));
    deliveries_.erase(deliveries_.begin() + (first - deliveries_.data()));
    int woken = -1;
    if (d.to_server) {
      if (SimServerChannel* server = bound(d.endpoint)) {
        server->deliver(d.from, d.client_id, std::move(d.bytes));
        woken = server->process();
      }
    } else if (auto it = clients_.find(d.client_id); it != clients_.end()) {
      it->second->deliver(std::move(d.bytes));
      woken = it->second->process();
    }
    if (woken >= 0) {
      Process& p = process(woken);
      if (p.alive && p.waiting && p.receiving && p.wake_at > now_) {
        p.wake_at = now_;
        p.wait_order = ++order_;
      }
    }
    return true;
  }
  if (next == nullptr || next->wake_at > until) return false;
  now_ = std::max(now_, next->wake_at);
  resume(*next);
  return true;
}

void World::bind(const std::string& endpoint, SimServerChannel* channel) { servers_[endpoint] = channel; }

void World::unbind(const std::string& endpoint, SimServerChannel* channel) {
  auto it = servers_.find(endpoint);
  if (it != servers_.end() && it->second == channel) servers_.erase(it);
}

SimServerChannel* World::bound(const std::string& endpoint) const {
  auto it = servers_.find(endpoint);
  return it == servers_.end() ? nullptr : it->second;
}

uint64_t World::register_client(SimClientChannel* channel) {
  const uint64_t id = next_client_++;
  clients_[id] = channel;
  return id;
}

void World::unregister_client(uint64_t id) { clients_.erase(id); }

bool World::partitioned(const std::string& name) const {
  auto it = partitioned_.find(name);
  return it != partitioned_.end() && it->second;
}

void World::schedule(Delivery delivery, const std::string& sender, const std::string& receiver) {
  ++messages_sent_;
  if (partitioned(sender) || partitioned(receiver) || chance(faults.drop)) {
    ++messages_dropped_;
    trace("drop " + sender + " -> " + receiver + " (" + std::to_string(delivery.bytes.size()) + " bytes)");
    return;
  }
  const auto delay = [&] {
    Nanos d = faults.latency;
    if (faults.jitter > 0) d += static_cast<Nanos>(uniform() * static_cast<double>(faults.jitter));
    if (chance(faults.long_delay)) d += static_cast<Nanos>(uniform() * static_cast<double>(faults.long_delay_max));
    return d;
  };
  if (chance(faults.duplicate)) {
    Delivery copy = delivery;
    copy.at = now_ + delay();
    copy.order = ++order_;
    trace("duplicate " + sender + " -> " + receiver);
    deliveries_.push_back(std::move(copy));
  }
  delivery.at = now_ + delay();
  delivery.order = ++order_;
  deliveries_.push_back(std::move(delivery));
}

void World::send_to_server(const std::string& endpoint, const std::string& from, uint64_t client_id,
                           std::vector<uint8_t> bytes) {
  Delivery d;
  d.to_server = true;
  d.endpoint = endpoint;
  d.from = from;
  d.client_id = client_id;
  d.bytes = std::move(bytes);
  const SimServerChannel* server = bound(endpoint);
  schedule(std::move(d), from, server != nullptr ? process(server->process()).name : endpoint);
}

void World::send_to_client(uint64_t client_id, std::vector<uint8_t> bytes) {
  auto it = clients_.find(client_id);
  if (it == clients_.end()) return;
  if (on_server_message) on_server_message(it->second->name(), bytes);
  Delivery d;
  d.client_id = client_id;
  d.bytes = std::move(bytes);
  const std::string sender = running_ >= 0 ? process(running_).name : "?";
  schedule(std::move(d), sender, it->second->name());
}

void World::trace(const std::string& line) {
  std::string entry = std::to_string(now_ / kMillisecond) + " ms: " + line;
  for (const char c : entry) digest_ = (digest_ ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  recent_.push_back(std::move(entry));
  while (recent_.size() > kRecentEvents) recent_.pop_front();
}

uint64_t SimClock::unix_micros() {
  const int64_t offset = world_.running() >= 0 ? world_.process(world_.running()).wall_clock_offset_micros : 0;
  return static_cast<uint64_t>(static_cast<int64_t>(kUnixMicrosAtStart) + world_.now() / 1000 + offset);
}

void SimClock::sleep_for(duration d) {
  world_.wait(world_.now() + std::chrono::duration_cast<std::chrono::nanoseconds>(d).count(), false);
}

namespace {

class SimThreadHandle final : public Threads::Handle {
 public:
  SimThreadHandle(World& world, int id) : world_(world), id_(id) {}
  ~SimThreadHandle() override { join(); }
  void join() override {
    if (joined_) return;
    joined_ = true;
    world_.join_helper(id_);
  }

 private:
  World& world_;
  int id_;
  bool joined_ = false;
};

}  // namespace

std::unique_ptr<Threads::Handle> SimThreads::start(std::function<void()> body) {
  return std::make_unique<SimThreadHandle>(world_, world_.start_helper(std::move(body)));
}

void SimThreads::wait_for(std::condition_variable& changed, std::unique_lock<std::mutex>& lock, Clock::duration timeout) {
  lock.unlock();
  try {
    world_.wait(world_.now() + std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count(), false, &changed);
  } catch (...) {
    lock.lock();
    throw;
  }
  lock.lock();
}

namespace {

protocol::Incoming incoming_of(std::string peer, std::string routing_id, std::vector<uint8_t> bytes) {
  auto frame = std::make_shared<std::vector<uint8_t>>(std::move(bytes));
  protocol::Incoming in;
  in.peer = peer;
  in.peer_key = std::move(peer);
  in.routing_id = std::move(routing_id);
  in.bytes = std::span<const uint8_t>(frame->data(), frame->size());
  in.frame = std::move(frame);
  return in;
}

// Waits on `world` until `inbox` has a frame or the timeout passes.
Result<std::optional<protocol::Incoming>> receive_from(World& world, std::deque<protocol::Incoming>& inbox,
                                                       protocol::TransportCounters& counters,
                                                       std::chrono::milliseconds timeout) {
  if (inbox.empty()) {
    world.wait(world.now() + std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count(), true);
  }
  if (inbox.empty()) return std::optional<protocol::Incoming>();
  protocol::Incoming in = std::move(inbox.front());
  inbox.pop_front();
  counters.messages_received.fetch_add(1);
  counters.bytes_received.fetch_add(in.bytes.size());
  return std::optional<protocol::Incoming>(std::move(in));
}

}  // namespace

SimServerChannel::SimServerChannel(World& world, Clock& clock, std::string endpoint, int process)
    : world_(world), clock_(clock), endpoint_(std::move(endpoint)), process_(process) {
  world_.bind(endpoint_, this);
}

SimServerChannel::~SimServerChannel() { world_.unbind(endpoint_, this); }

void SimServerChannel::deliver(std::string from, uint64_t client_id, std::vector<uint8_t> bytes) {
  inbox_.push_back(incoming_of(std::move(from), std::to_string(client_id), std::move(bytes)));
}

Result<std::optional<protocol::Incoming>> SimServerChannel::receive(std::chrono::milliseconds timeout) {
  return receive_from(world_, inbox_, counters_, timeout);
}

Status SimServerChannel::send_bytes(const std::string& routing_id, std::span<const uint8_t> bytes) {
  if (world_.process(process_).killed) return Status::ok();  // a crashed process sends nothing
  uint64_t client = 0;
  try {
    client = std::stoull(routing_id);
  } catch (const std::exception&) {
    return invalid_argument("no such connection: " + routing_id);
  }
  counters_.messages_sent.fetch_add(1);
  counters_.bytes_sent.fetch_add(bytes.size());
  world_.send_to_client(client, std::vector<uint8_t>(bytes.begin(), bytes.end()));
  return Status::ok();
}

Status SimServerChannel::send(const std::string& routing_id, protocol::OutgoingMessage message) {
  return send_bytes(routing_id, message.bytes());
}

Status SimServerChannel::send(const std::string& routing_id, const protocol::SharedMessage& message) {
  return send_bytes(routing_id, message.bytes());
}

SimClientChannel::SimClientChannel(World& world, Clock& clock, std::string endpoint, std::string name, int process)
    : world_(world), clock_(clock), endpoint_(std::move(endpoint)), name_(std::move(name)), process_(process) {
  id_ = world_.register_client(this);
}

SimClientChannel::~SimClientChannel() { world_.unregister_client(id_); }

void SimClientChannel::deliver(std::vector<uint8_t> bytes) {
  inbox_.push_back(incoming_of("", "", std::move(bytes)));
}

Result<std::optional<protocol::Incoming>> SimClientChannel::receive(std::chrono::milliseconds timeout) {
  return receive_from(world_, inbox_, counters_, timeout);
}

bool SimClientChannel::connected() { return world_.bound(endpoint_) != nullptr && !world_.partitioned(name_); }

Status SimClientChannel::send_bytes(std::span<const uint8_t> bytes) {
  if (world_.process(process_).killed) return Status::ok();
  counters_.messages_sent.fetch_add(1);
  counters_.bytes_sent.fetch_add(bytes.size());
  world_.send_to_server(endpoint_, name_, id_, std::vector<uint8_t>(bytes.begin(), bytes.end()));
  return Status::ok();
}

Status SimClientChannel::send(protocol::OutgoingMessage message, std::chrono::milliseconds) {
  return send_bytes(message.bytes());
}

Status SimClientChannel::send(const protocol::SharedMessage& message, std::chrono::milliseconds) {
  return send_bytes(message.bytes());
}

Result<std::unique_ptr<protocol::ServerChannel>> SimNetwork::bind(const std::string& endpoint,
                                                                  const protocol::CurveKeys&, protocol::Allowlist,
                                                                  const protocol::TransportOptions&) {
  if (SimServerChannel* existing = world_.bound(endpoint); existing != nullptr && world_.process(existing->process()).alive &&
                                                           existing->process() != process_) {
    return unavailable(endpoint + ": address in use");
  }
  return std::unique_ptr<protocol::ServerChannel>(std::make_unique<SimServerChannel>(world_, clock_, endpoint, process_));
}

Result<std::unique_ptr<protocol::ClientChannel>> SimNetwork::connect(const std::string& endpoint,
                                                                     const protocol::CurveKeys&,
                                                                     const crypto::BoxPublicKey&,
                                                                     const protocol::TransportOptions&) {
  return std::unique_ptr<protocol::ClientChannel>(
      std::make_unique<SimClientChannel>(world_, clock_, endpoint, name_, process_));
}

}  // namespace fedmesh::sim::vopr
