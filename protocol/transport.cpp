#include "protocol/transport.h"

#include <sodium.h>
#include <zmq.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "base/random.h"

// ThreadSanitizer builds (deploy/setup.sh --tsan): libzmq is not
// instrumented, so what it hands between its I/O thread and ours (through
// lock-free queues and reference counts inside libzmq) looks unordered to
// TSan. send_message declares the hand-over of a zero-copy message
// (__tsan_release/__tsan_acquire); message_property reads the properties
// that the I/O thread wrote at the handshake with TSan's read checks off.
// Nothing in other builds.
#if defined(__SANITIZE_THREAD__)
#define FEDMESH_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FEDMESH_TSAN 1
#endif
#endif
#ifdef FEDMESH_TSAN
#include <sanitizer/tsan_interface.h>
// Exported by the TSan runtime (gcc's and clang's), not in its headers.
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
#endif

namespace fedmesh::protocol {
namespace {

constexpr const char* kZapEndpoint = "inproc://zeromq.zap.01";
constexpr const char* kZapDomain = "fedmesh";
constexpr int kZapEnforceDomainOption = 93;  // ZMQ_ZAP_ENFORCE_DOMAIN (a draft name in libzmq 4.3)
constexpr int kZapPollMs = 100;

std::string zmq_error(const char* what) { return std::string(what) + ": " + zmq_strerror(zmq_errno()); }

Status set_int(void* socket, int option, int value, const char* name) {
  if (zmq_setsockopt(socket, option, &value, sizeof value) != 0) return io_error(zmq_error(name));
  return Status::ok();
}

Status set_bytes(void* socket, int option, const void* data, size_t size, const char* name) {
  if (zmq_setsockopt(socket, option, data, size) != 0) return io_error(zmq_error(name));
  return Status::ok();
}

// Options every fedmesh socket gets: bounded messages and queues, ZMTP
// heartbeats, no lingering on close.
Status apply_common_options(void* socket, const TransportOptions& options) {
  const int64_t hard_cap = static_cast<int64_t>(options.max_message_bytes * kTransportCapFactor);
  if (zmq_setsockopt(socket, ZMQ_MAXMSGSIZE, &hard_cap, sizeof hard_cap) != 0) return io_error(zmq_error("ZMQ_MAXMSGSIZE"));
  FEDMESH_RETURN_IF_ERROR(set_int(socket, ZMQ_RCVHWM, options.high_water_mark, "ZMQ_RCVHWM"));
  FEDMESH_RETURN_IF_ERROR(set_int(socket, ZMQ_SNDHWM, options.high_water_mark, "ZMQ_SNDHWM"));
  FEDMESH_RETURN_IF_ERROR(set_int(socket, ZMQ_LINGER, 0, "ZMQ_LINGER"));
  FEDMESH_RETURN_IF_ERROR(set_int(socket, ZMQ_HEARTBEAT_IVL, kHeartbeatIntervalMs, "ZMQ_HEARTBEAT_IVL"));
  FEDMESH_RETURN_IF_ERROR(set_int(socket, ZMQ_HEARTBEAT_TIMEOUT, kHeartbeatTimeoutMs, "ZMQ_HEARTBEAT_TIMEOUT"));
  FEDMESH_RETURN_IF_ERROR(set_int(socket, ZMQ_HEARTBEAT_TTL, kHeartbeatTimeoutMs, "ZMQ_HEARTBEAT_TTL"));
  FEDMESH_RETURN_IF_ERROR(set_int(socket, ZMQ_HANDSHAKE_IVL, kHandshakeTimeoutMs, "ZMQ_HANDSHAKE_IVL"));
  return Status::ok();
}

struct MessageFrame {
  zmq_msg_t msg;
  MessageFrame() { zmq_msg_init(&msg); }
  ~MessageFrame() { zmq_msg_close(&msg); }
  MessageFrame(const MessageFrame&) = delete;
  MessageFrame& operator=(const MessageFrame&) = delete;
};

bool has_more(void* socket) {
  int more = 0;
  size_t size = sizeof more;
  zmq_getsockopt(socket, ZMQ_RCVMORE, &more, &size);
  return more != 0;
}

void drain(void* socket) {
  while (has_more(socket)) {
    MessageFrame frame;
    if (zmq_msg_recv(&frame.msg, socket, ZMQ_DONTWAIT) < 0) break;
  }
}

// Polls one socket for input. true: readable.
Result<bool> wait_readable(void* socket, std::chrono::milliseconds timeout) {
  zmq_pollitem_t item{socket, 0, ZMQ_POLLIN, 0};
  const int rc = zmq_poll(&item, 1, static_cast<long>(timeout.count()));
  if (rc < 0) {
    if (zmq_errno() == EINTR) return false;
    return io_error(zmq_error("zmq_poll"));
  }
  return rc > 0;
}

// A property of a received message (zmq_msg_gets; empty if absent). The
// I/O thread wrote it at the handshake (our copy of std::string, called from
// libzmq, allocated it) and libzmq hands it over unseen by TSan.
std::string message_property(zmq_msg_t* msg, const char* name) {
#ifdef FEDMESH_TSAN
  AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
#endif
  const char* value = zmq_msg_gets(msg, name);
  std::string out = value != nullptr ? value : "";
#ifdef FEDMESH_TSAN
  AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
#endif
  return out;
}

// Receives the payload frame that follows (ROUTER) or is (DEALER) the
// message, with the ZAP User-Id the handshake attached to it.
Result<std::optional<Incoming>> receive_payload(void* socket, TransportCounters& counters, std::string routing_id) {
  auto frame = std::make_shared<MessageFrame>();
  if (zmq_msg_recv(&frame->msg, socket, ZMQ_DONTWAIT) < 0) {
    if (zmq_errno() == EAGAIN) return std::optional<Incoming>();
    return io_error(zmq_error("zmq_msg_recv"));
  }
  Incoming incoming;
  incoming.routing_id = std::move(routing_id);
  incoming.peer = message_property(&frame->msg, "User-Id");
  incoming.peer_key = message_property(&frame->msg, kPeerKeyProperty);
  const size_t size = zmq_msg_size(&frame->msg);
  counters.messages_received.fetch_add(1);
  counters.bytes_received.fetch_add(size);
  if (has_more(socket)) {
    // fedmesh messages are one frame; extra frames make the message
    // malformed (empty bytes fail the envelope check with a reason).
    drain(socket);
    incoming.bytes = {};
  } else {
    incoming.bytes = {static_cast<const uint8_t*>(zmq_msg_data(&frame->msg)), size};
  }
  incoming.frame = frame;
  return std::optional<Incoming>(std::move(incoming));
}

// What a failed send means to the caller: a full queue or a gone peer is
// kUnavailable (retry later); anything else is an I/O error.
Status send_failure(const char* call, int error) {
  if (error == EAGAIN) return unavailable("send queue full (peer not reading)");
  if (error == EHOSTUNREACH) return unavailable("peer is not connected");
  return io_error(std::string(call) + ": " + zmq_strerror(error));
}

// Sends without a copy: ZeroMQ holds a reference to the bytes until they are
// on the wire (a prepared chunk stays resendable; a one-off reply is freed).
Status send_message(void* socket, const SharedMessage& message, int flags, TransportCounters& counters) {
  const auto bytes = message.bytes();
  auto* reference = new std::shared_ptr<const OutgoingMessage>(message.shared());
  zmq_msg_t msg;
  // ZeroMQ calls `release` on its I/O thread once the bytes are sent.
  auto release = [](void*, void* hint) {
#ifdef FEDMESH_TSAN
    __tsan_acquire(hint);
#endif
    delete static_cast<std::shared_ptr<const OutgoingMessage>*>(hint);
  };
#ifdef FEDMESH_TSAN
  __tsan_release(reference);
#endif
  if (zmq_msg_init_data(&msg, const_cast<uint8_t*>(bytes.data()), bytes.size(), release, reference) != 0) {
    delete reference;
    return io_error(zmq_error("zmq_msg_init_data"));
  }
  if (zmq_msg_send(&msg, socket, flags) < 0) {
    const int error = zmq_errno();
    zmq_msg_close(&msg);
    return send_failure("zmq_msg_send", error);
  }
  counters.messages_sent.fetch_add(1);
  counters.bytes_sent.fetch_add(bytes.size());
  return Status::ok();
}

// Socket monitor events read from the inproc PAIR that zmq_socket_monitor feeds.
struct MonitorEvent {
  uint16_t event = 0;
  uint32_t value = 0;
};

std::optional<MonitorEvent> read_monitor_event(void* monitor, int timeout_ms) {
  zmq_pollitem_t item{monitor, 0, ZMQ_POLLIN, 0};
  if (zmq_poll(&item, 1, timeout_ms) <= 0) return std::nullopt;
  MessageFrame head;
  if (zmq_msg_recv(&head.msg, monitor, 0) < 0) return std::nullopt;
  MonitorEvent event;
  if (zmq_msg_size(&head.msg) >= 6) {
    const auto* p = static_cast<const uint8_t*>(zmq_msg_data(&head.msg));
    std::memcpy(&event.event, p, 2);
    std::memcpy(&event.value, p + 2, 4);
  }
  drain(monitor);  // the endpoint frame
  return event;
}

}  // namespace

// ---- ZmqContext ---------------------------------------------------------------

class ZmqContext {
 public:
  ZmqContext() : context_(zmq_ctx_new()) { FEDMESH_CHECK(context_ != nullptr, "zmq_ctx_new failed"); }
  ~ZmqContext() { zmq_ctx_term(context_); }
  ZmqContext(const ZmqContext&) = delete;
  ZmqContext& operator=(const ZmqContext&) = delete;
  void* get() const { return context_; }

 private:
  void* context_;
};

// A socket closed when it goes out of scope.
class OwnedSocket {
 public:
  OwnedSocket() = default;
  OwnedSocket(void* context, int type) : socket_(zmq_socket(context, type)) {}
  ~OwnedSocket() { reset(); }
  OwnedSocket(OwnedSocket&& other) noexcept : socket_(std::exchange(other.socket_, nullptr)) {}
  OwnedSocket& operator=(OwnedSocket&& other) noexcept {
    reset();
    socket_ = std::exchange(other.socket_, nullptr);
    return *this;
  }
  void reset() {
    if (socket_ != nullptr) zmq_close(socket_);
    socket_ = nullptr;
  }
  void* get() const { return socket_; }
  explicit operator bool() const { return socket_ != nullptr; }

 private:
  void* socket_ = nullptr;
};

Allowlist allowlist_from_roster(const crypto::Roster& roster) {
  Allowlist allowlist;
  for (const auto& entry : roster.sites) allowlist.emplace(entry.identity.box_public, entry.identity.name);
  return allowlist;
}

CurveKeys CurveKeys::from(const crypto::SiteKeys& keys) {
  CurveKeys curve;
  curve.public_key = keys.identity.box_public;
  curve.secret_key = keys.box_secret;
  return curve;
}

// ---- ZAP handler ----------------------------------------------------------------

// Answers libzmq's ZAP requests (RFC 27) for one context on its own thread.
class ZapAuthenticator {
 public:
  ZapAuthenticator(void* context, Allowlist allowlist, std::shared_ptr<TransportCounters> counters)
      : allowlist_(std::move(allowlist)), counters_(std::move(counters)), socket_(context, ZMQ_REP) {}
  ~ZapAuthenticator() {
    stop_.store(true);
    if (thread_.joinable()) thread_.join();
  }

  Status start() {
    if (!socket_) return io_error(zmq_error("zmq_socket(ZAP)"));
    FEDMESH_RETURN_IF_ERROR(set_int(socket_.get(), ZMQ_LINGER, 0, "ZMQ_LINGER"));
    if (zmq_bind(socket_.get(), kZapEndpoint) != 0) return io_error(zmq_error("binding the ZAP handler"));
    thread_ = std::thread([this] { run(); });
    return Status::ok();
  }

  // A new allowlist (a re-signed roster): handshakes from now on use it.
  void set_allowlist(Allowlist allowlist) {
    std::lock_guard lock(mutex_);
    allowlist_ = std::move(allowlist);
  }

  // The key the self-test uses: refused, and counted apart from strangers.
  void set_self_test_key(const crypto::BoxPublicKey& key) {
    std::lock_guard lock(mutex_);
    self_test_key_ = key;
  }
  uint64_t self_test_refusals() const { return self_test_refusals_.load(); }

 private:
  void run() {
    while (!stop_.load()) {
      zmq_pollitem_t item{socket_.get(), 0, ZMQ_POLLIN, 0};
      if (zmq_poll(&item, 1, kZapPollMs) <= 0) continue;
      std::vector<std::string> frames;
      do {
        MessageFrame frame;
        if (zmq_msg_recv(&frame.msg, socket_.get(), 0) < 0) break;
        if (frames.size() < 8) {
          frames.emplace_back(static_cast<const char*>(zmq_msg_data(&frame.msg)), zmq_msg_size(&frame.msg));
        }
      } while (has_more(socket_.get()));
      answer(frames);
    }
  }

  void answer(const std::vector<std::string>& frames) {
    // version, request id, domain, address, identity, mechanism, credentials...
    const std::string request_id = frames.size() > 1 ? frames[1] : std::string();
    std::string status = "400", text = "malformed ZAP request", user, metadata;
    if (frames.size() >= 7 && frames[0] == "1.0" && frames[2] == kZapDomain && frames[5] == "CURVE" &&
        frames[6].size() == crypto::kBoxPublicBytes) {
      crypto::BoxPublicKey key{};
      std::memcpy(key.data(), frames[6].data(), key.size());
      bool self_test = false, allowed = false;
      {
        std::lock_guard lock(mutex_);
        self_test = self_test_key_ && *self_test_key_ == key;
        const auto found = allowlist_.find(key);
        allowed = found != allowlist_.end();
        if (allowed) user = found->second;
      }
      if (allowed) {
        status = "200";
        text = "OK";
        // ZMTP metadata: name length (1 byte), name, value length (4 bytes,
        // big-endian), value. It reaches every message as a property.
        const std::string name = kPeerKeyProperty;
        const std::string value = crypto::to_hex(std::span<const uint8_t>(key.data(), key.size()));
        metadata.push_back(static_cast<char>(name.size()));
        metadata += name;
        for (int shift = 24; shift >= 0; shift -= 8) {
          metadata.push_back(static_cast<char>((value.size() >> shift) & 0xff));
        }
        metadata += value;
        counters_->zap_allowed.fetch_add(1);
      } else {
        text = "key not on the roster";
        if (self_test) {
          self_test_refusals_.fetch_add(1);
        } else {
          counters_->zap_denied.fetch_add(1);
          std::fprintf(stderr, "fedmesh: refused a connection from %s: curve key %s… is not on the roster\n",
                       frames[3].c_str(), crypto::to_hex(std::span<const uint8_t>(key.data(), 8)).c_str());
        }
      }
    } else {
      counters_->zap_denied.fetch_add(1);
      std::fprintf(stderr, "fedmesh: refused a connection: %s\n",
                   frames.size() >= 6 && frames[5] != "CURVE" ? "not a CURVE handshake" : "malformed ZAP request");
    }
    const std::string reply[] = {"1.0", request_id, status, text, user, metadata};
    for (size_t i = 0; i < 6; ++i) {
      zmq_send(socket_.get(), reply[i].data(), reply[i].size(), i + 1 < 6 ? ZMQ_SNDMORE : 0);
    }
  }

  Allowlist allowlist_;  // guarded by mutex_
  std::shared_ptr<TransportCounters> counters_;
  OwnedSocket socket_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::optional<crypto::BoxPublicKey> self_test_key_;
  std::atomic<uint64_t> self_test_refusals_{0};
};

// ---- ServerSocket ----------------------------------------------------------------

class ServerSocket::Impl {
 public:
  ZmqContext context;
  std::unique_ptr<ZapAuthenticator> zap;  // destroyed after the socket (declared before it)
  OwnedSocket socket;
};

namespace {

// Proves the ZAP handler is in force: a client with a random key must be
// refused at the handshake. Anything else and the server must not run.
Status run_self_test(void* context, const std::string& endpoint, const crypto::BoxPublicKey& server_public,
                     ZapAuthenticator& zap) {
  crypto::BoxPublicKey stranger_public{};
  crypto::SecretBytes<crypto::kBoxSecretBytes> stranger_secret;
  crypto_box_keypair(stranger_public.data(), stranger_secret.data());
  zap.set_self_test_key(stranger_public);

  OwnedSocket client(context, ZMQ_DEALER);
  if (!client) return io_error(zmq_error("self-test socket"));
  FEDMESH_RETURN_IF_ERROR(set_int(client.get(), ZMQ_LINGER, 0, "ZMQ_LINGER"));
  FEDMESH_RETURN_IF_ERROR(set_bytes(client.get(), ZMQ_CURVE_SERVERKEY, server_public.data(), 32, "ZMQ_CURVE_SERVERKEY"));
  FEDMESH_RETURN_IF_ERROR(set_bytes(client.get(), ZMQ_CURVE_PUBLICKEY, stranger_public.data(), 32, "ZMQ_CURVE_PUBLICKEY"));
  FEDMESH_RETURN_IF_ERROR(set_bytes(client.get(), ZMQ_CURVE_SECRETKEY, stranger_secret.data(), 32, "ZMQ_CURVE_SECRETKEY"));
  const std::string monitor_endpoint = "inproc://fedmesh-self-test-" + std::to_string(reinterpret_cast<uintptr_t>(client.get()));
  if (zmq_socket_monitor(client.get(), monitor_endpoint.c_str(),
                         ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                             ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) != 0) {
    return io_error(zmq_error("self-test monitor"));
  }
  OwnedSocket monitor(context, ZMQ_PAIR);
  if (zmq_connect(monitor.get(), monitor_endpoint.c_str()) != 0) return io_error(zmq_error("self-test monitor connect"));

  std::string dial = endpoint;
  if (const auto at = dial.find("://0.0.0.0:"); at != std::string::npos) dial.replace(at + 3, 7, "127.0.0.1");
  if (const auto at = dial.find("://*:"); at != std::string::npos) dial.replace(at + 3, 1, "127.0.0.1");
  if (zmq_connect(client.get(), dial.c_str()) != 0) return io_error(zmq_error("self-test connect"));

  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kSelfTestTimeoutMs);
  while (std::chrono::steady_clock::now() < deadline) {
    const auto event = read_monitor_event(monitor.get(), 50);
    if (event && event->event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
      return Status(StatusCode::kInternal,
                    "transport self-test FAILED: a client with a random key completed the CURVE handshake; "
                    "the ZAP allowlist is not in force, refusing to run");
    }
    if (zap.self_test_refusals() > 0 && event && event->event != ZMQ_EVENT_HANDSHAKE_SUCCEEDED) break;
    if (zap.self_test_refusals() > 0 && !event) break;
  }
  zmq_socket_monitor(client.get(), nullptr, 0);
  if (zap.self_test_refusals() == 0) {
    return Status(StatusCode::kInternal,
                  "transport self-test FAILED: the ZAP handler never saw the self-test's random key within " +
                      std::to_string(kSelfTestTimeoutMs) + " ms; refusing to run");
  }
  return Status::ok();
}

}  // namespace

Result<std::unique_ptr<ServerSocket>> ServerSocket::bind(const std::string& endpoint, const CurveKeys& keys,
                                                         Allowlist allowlist, const TransportOptions& options) {
  if (sodium_init() < 0) return Status(StatusCode::kInternal, "libsodium failed to initialize");
  std::unique_ptr<ServerSocket> server(new ServerSocket());
  FEDMESH_RETURN_IF_ERROR(options.faults.validate());
  server->options_ = options;
  server->counters_ = std::make_shared<TransportCounters>();
  if (options.faults.active()) server->faults_ = std::make_unique<FaultInjector>(options.faults);
  server->impl_ = std::make_unique<Impl>();
  Impl& impl = *server->impl_;
  void* context = impl.context.get();

  if (!options.insecure) {
    // The ZAP handler first: a CURVE socket bound without one admits anyone.
    impl.zap = std::make_unique<ZapAuthenticator>(context, std::move(allowlist), server->counters_);
    if (!options.omit_zap_handler_to_test_the_self_test) FEDMESH_RETURN_IF_ERROR(impl.zap->start());
  }
  impl.socket = OwnedSocket(context, ZMQ_ROUTER);
  void* socket = impl.socket.get();
  if (socket == nullptr) return io_error(zmq_error("zmq_socket(ROUTER)"));
  FEDMESH_RETURN_IF_ERROR(apply_common_options(socket, options));
  FEDMESH_RETURN_IF_ERROR(set_int(socket, ZMQ_ROUTER_MANDATORY, 1, "ZMQ_ROUTER_MANDATORY"));
  if (!options.insecure) {
    FEDMESH_RETURN_IF_ERROR(set_int(socket, ZMQ_CURVE_SERVER, 1, "ZMQ_CURVE_SERVER"));
    FEDMESH_RETURN_IF_ERROR(set_bytes(socket, ZMQ_CURVE_SECRETKEY, keys.secret_key.data(), 32, "ZMQ_CURVE_SECRETKEY"));
    FEDMESH_RETURN_IF_ERROR(set_bytes(socket, ZMQ_ZAP_DOMAIN, kZapDomain, std::strlen(kZapDomain), "ZMQ_ZAP_DOMAIN"));
    // (With enforcement and no handler, libzmq refuses everyone; the test
    // knob turns both off to recreate the admit-anyone configuration.)
    if (!options.omit_zap_handler_to_test_the_self_test) {
      FEDMESH_RETURN_IF_ERROR(set_int(socket, kZapEnforceDomainOption, 1, "ZMQ_ZAP_ENFORCE_DOMAIN"));
    }
  }
  if (zmq_bind(socket, endpoint.c_str()) != 0) {
    return unavailable("cannot listen on " + endpoint + ": " + zmq_strerror(zmq_errno()));
  }
  char resolved[256] = {};
  size_t resolved_size = sizeof resolved;
  zmq_getsockopt(socket, ZMQ_LAST_ENDPOINT, resolved, &resolved_size);
  server->endpoint_ = resolved;
  if (!options.insecure) {
    FEDMESH_RETURN_IF_ERROR(run_self_test(context, server->endpoint_, keys.public_key, *impl.zap));
  }
  return server;
}

ServerSocket::~ServerSocket() {
  if (impl_) impl_->socket.reset();
}

Result<std::optional<Incoming>> ServerSocket::receive(std::chrono::milliseconds timeout) {
  void* socket = impl_->socket.get();
  auto ready = wait_readable(socket, timeout);
  if (!ready.is_ok()) return ready.status();
  if (!*ready) return std::optional<Incoming>();
  MessageFrame routing;
  if (zmq_msg_recv(&routing.msg, socket, ZMQ_DONTWAIT) < 0) {
    if (zmq_errno() == EAGAIN) return std::optional<Incoming>();
    return io_error(zmq_error("zmq_msg_recv"));
  }
  std::string routing_id(static_cast<const char*>(zmq_msg_data(&routing.msg)), zmq_msg_size(&routing.msg));
  if (!has_more(socket)) return std::optional<Incoming>();  // ROUTER always sends the id with a payload
  return receive_payload(socket, *counters_, std::move(routing_id));
}

bool pass_faults(FaultInjector* faults, uint64_t bytes, TransportCounters& counters) {
  if (faults == nullptr) return true;
  const double now = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  const FaultInjector::Decision decision = faults->decide(bytes, now);
  if (decision.drop) {
    counters.dropped_by_faults.fetch_add(1);
    return false;
  }
  if (decision.hold_seconds > 0.0) std::this_thread::sleep_for(std::chrono::duration<double>(decision.hold_seconds));
  return true;
}

void ServerSocket::set_allowlist(Allowlist allowlist) {
  if (impl_->zap) impl_->zap->set_allowlist(std::move(allowlist));
}

Status ServerSocket::send(const std::string& routing_id, OutgoingMessage message) {
  if (!pass_faults(faults_.get(), message.bytes().size(), *counters_)) return Status::ok();  // lost on the link
  void* socket = impl_->socket.get();
  if (zmq_send(socket, routing_id.data(), routing_id.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
    return send_failure("zmq_send", zmq_errno());
  }
  return send_message(socket, SharedMessage(std::move(message)), ZMQ_DONTWAIT, *counters_);
}

Status ServerSocket::send(const std::string& routing_id, const SharedMessage& message) {
  if (!pass_faults(faults_.get(), message.size(), *counters_)) return Status::ok();  // lost on the link
  void* socket = impl_->socket.get();
  if (zmq_send(socket, routing_id.data(), routing_id.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
    return send_failure("zmq_send", zmq_errno());
  }
  return send_message(socket, message, ZMQ_DONTWAIT, *counters_);
}

// ---- ClientSocket ----------------------------------------------------------------

class ClientSocket::Impl {
 public:
  ZmqContext context;
  OwnedSocket socket;
  OwnedSocket monitor;
  bool connected = false;
  bool refused = false;

  void poll_monitor() {
    while (auto event = read_monitor_event(monitor.get(), 0)) {
      switch (event->event) {
        case ZMQ_EVENT_HANDSHAKE_SUCCEEDED: connected = true; refused = false; break;
        case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH: refused = true; connected = false; break;
        case ZMQ_EVENT_DISCONNECTED: connected = false; break;
        default: break;
      }
    }
  }
};

Result<std::unique_ptr<ClientSocket>> ClientSocket::connect(const std::string& endpoint, const CurveKeys& keys,
                                                            const crypto::BoxPublicKey& server_public,
                                                            const TransportOptions& options) {
  if (sodium_init() < 0) return Status(StatusCode::kInternal, "libsodium failed to initialize");
  FEDMESH_RETURN_IF_ERROR(options.faults.validate());
  std::unique_ptr<ClientSocket> client(new ClientSocket());
  client->counters_ = std::make_shared<TransportCounters>();
  if (options.faults.active()) client->faults_ = std::make_unique<FaultInjector>(options.faults);
  client->impl_ = std::make_unique<Impl>();
  Impl& impl = *client->impl_;
  void* context = impl.context.get();
  impl.socket = OwnedSocket(context, ZMQ_DEALER);
  void* socket = impl.socket.get();
  if (socket == nullptr) return io_error(zmq_error("zmq_socket(DEALER)"));
  FEDMESH_RETURN_IF_ERROR(apply_common_options(socket, options));
  // Jittered backoff: sites that lost the server together do not return
  // together.
  Rng rng(options.jitter_seed != 0 ? options.jitter_seed
                                   : static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  const int reconnect_ms = kReconnectIntervalMs / 2 + static_cast<int>(rng.below(kReconnectIntervalMs));
  FEDMESH_RETURN_IF_ERROR(set_int(socket, ZMQ_RECONNECT_IVL, reconnect_ms, "ZMQ_RECONNECT_IVL"));
  FEDMESH_RETURN_IF_ERROR(set_int(socket, ZMQ_RECONNECT_IVL_MAX, kReconnectIntervalMaxMs, "ZMQ_RECONNECT_IVL_MAX"));
  if (!options.insecure) {
    FEDMESH_RETURN_IF_ERROR(set_bytes(socket, ZMQ_CURVE_SERVERKEY, server_public.data(), 32, "ZMQ_CURVE_SERVERKEY"));
    FEDMESH_RETURN_IF_ERROR(set_bytes(socket, ZMQ_CURVE_PUBLICKEY, keys.public_key.data(), 32, "ZMQ_CURVE_PUBLICKEY"));
    FEDMESH_RETURN_IF_ERROR(set_bytes(socket, ZMQ_CURVE_SECRETKEY, keys.secret_key.data(), 32, "ZMQ_CURVE_SECRETKEY"));
  }
  const std::string monitor_endpoint = "inproc://fedmesh-client-monitor";
  if (zmq_socket_monitor(socket, monitor_endpoint.c_str(),
                         ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_DISCONNECTED) != 0) {
    return io_error(zmq_error("client monitor"));
  }
  impl.monitor = OwnedSocket(context, ZMQ_PAIR);
  if (zmq_connect(impl.monitor.get(), monitor_endpoint.c_str()) != 0) return io_error(zmq_error("client monitor connect"));
  if (zmq_connect(socket, endpoint.c_str()) != 0) {
    return invalid_argument("cannot dial " + endpoint + ": " + zmq_strerror(zmq_errno()));
  }
  return client;
}

ClientSocket::~ClientSocket() {
  if (impl_) {
    zmq_socket_monitor(impl_->socket.get(), nullptr, 0);
    impl_->monitor.reset();
    impl_->socket.reset();
  }
}

bool ClientSocket::connected() {
  impl_->poll_monitor();
  return impl_->connected;
}

bool ClientSocket::handshake_refused() {
  impl_->poll_monitor();
  return impl_->refused;
}

Result<std::optional<Incoming>> ClientSocket::receive(std::chrono::milliseconds timeout) {
  auto ready = wait_readable(impl_->socket.get(), timeout);
  if (!ready.is_ok()) return ready.status();
  if (!*ready) return std::optional<Incoming>();
  return receive_payload(impl_->socket.get(), *counters_, std::string());
}

namespace {

Status wait_writable(void* socket, std::chrono::milliseconds timeout) {
  zmq_pollitem_t item{socket, 0, ZMQ_POLLOUT, 0};
  const int rc = zmq_poll(&item, 1, static_cast<long>(timeout.count()));
  if (rc < 0) return io_error(zmq_error("zmq_poll"));
  if (rc == 0) return unavailable("no connection to the server within " + std::to_string(timeout.count()) + " ms");
  return Status::ok();
}

}  // namespace

Status ClientSocket::send(OutgoingMessage message, std::chrono::milliseconds timeout) {
  if (!pass_faults(faults_.get(), message.bytes().size(), *counters_)) return Status::ok();  // lost on the link
  FEDMESH_RETURN_IF_ERROR(wait_writable(impl_->socket.get(), timeout));
  return send_message(impl_->socket.get(), SharedMessage(std::move(message)), ZMQ_DONTWAIT, *counters_);
}

Status ClientSocket::send(const SharedMessage& message, std::chrono::milliseconds timeout) {
  if (!pass_faults(faults_.get(), message.size(), *counters_)) return Status::ok();  // lost on the link
  FEDMESH_RETURN_IF_ERROR(wait_writable(impl_->socket.get(), timeout));
  return send_message(impl_->socket.get(), message, ZMQ_DONTWAIT, *counters_);
}

}  // namespace fedmesh::protocol

namespace fedmesh::protocol {
namespace {

class ZmqNetwork final : public Network {
 public:
  Result<std::unique_ptr<ServerChannel>> bind(const std::string& endpoint, const CurveKeys& keys, Allowlist allowlist,
                                              const TransportOptions& options) override {
    Result<std::unique_ptr<ServerSocket>> bound = ServerSocket::bind(endpoint, keys, std::move(allowlist), options);
    if (!bound.is_ok()) return bound.status();
    return std::unique_ptr<ServerChannel>(std::move(*bound));
  }
  Result<std::unique_ptr<ClientChannel>> connect(const std::string& endpoint, const CurveKeys& keys,
                                                 const crypto::BoxPublicKey& server_public,
                                                 const TransportOptions& options) override {
    Result<std::unique_ptr<ClientSocket>> connected = ClientSocket::connect(endpoint, keys, server_public, options);
    if (!connected.is_ok()) return connected.status();
    return std::unique_ptr<ClientChannel>(std::move(*connected));
  }
};

}  // namespace

Network& zmq_network() {
  static ZmqNetwork network;
  return network;
}

}  // namespace fedmesh::protocol
