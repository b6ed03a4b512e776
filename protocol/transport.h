// ZeroMQ sockets secured with CurveZMQ, admitting only roster keys.
//
// Security by default: a ServerSocket is a ROUTER with CURVE on, and a ZAP
// handler (ZapAuthenticator) bound in the same context *before* the socket,
// because libzmq's CURVE server with no ZAP handler admits any client key.
// The handler answers 200 only for keys on its allowlist and names the
// client (its roster name) as the ZAP User-Id, which every received frame
// carries: that name, not anything inside the message, is who sent it.
// bind() ends with a self-test: a client with a random key dials the socket
// and must be refused, or bind() fails and the process does not run.
// A ClientSocket is a DEALER that dials out (institution firewalls allow
// outbound only) and authenticates the server by the key the roster gives.
//
// Bounds (everything a peer controls): libzmq cuts a connection whose
// message is over kTransportCapFactor times the message limit (ZMQ_MAXMSGSIZE)
// before allocating it; messages between the limit and that cap are read and
// then refused with a Reject (too-large) the sender can act on. Queues are
// bounded by high-water marks; ROUTER sends to a gone peer fail instead of
// silently dropping (ZMQ_ROUTER_MANDATORY).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/status.h"
#include "crypto/keys.h"
#include "crypto/roster.h"
#include "protocol/fault_injection.h"
#include "protocol/wire.h"

namespace fedmesh::protocol {

inline constexpr size_t kTransportCapFactor = 16;
inline constexpr int kDefaultHighWaterMark = 64;        // messages queued per peer
inline constexpr int kHeartbeatIntervalMs = 1000;       // ZMTP PING
inline constexpr int kHeartbeatTimeoutMs = 10000;       // no traffic: connection dropped
inline constexpr int kHandshakeTimeoutMs = 5000;
inline constexpr int kReconnectIntervalMs = 100;        // first retry, jittered +-50%
inline constexpr int kReconnectIntervalMaxMs = 5000;    // doubling up to this
inline constexpr int kSelfTestTimeoutMs = 5000;

// Counters every socket keeps; read by metrics and by tests.
struct TransportCounters {
  std::atomic<uint64_t> messages_received{0};
  std::atomic<uint64_t> bytes_received{0};
  std::atomic<uint64_t> messages_sent{0};
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<uint64_t> zap_allowed{0};
  std::atomic<uint64_t> zap_denied{0};
  std::atomic<uint64_t> dropped_by_faults{0};  // fault injection (TransportOptions::faults)
  std::array<std::atomic<uint64_t>, kRejectCodeCount> rejected{};
  void count_rejection(wire::RejectCode code) { rejected[static_cast<size_t>(code)].fetch_add(1); }
  uint64_t rejections(wire::RejectCode code) const { return rejected[static_cast<size_t>(code)].load(); }
};

struct TransportOptions {
  bool insecure = false;                       // no CURVE, no ZAP: local experiments only
  size_t max_message_bytes = kDefaultMaxMessageBytes;
  int high_water_mark = kDefaultHighWaterMark;
  uint64_t jitter_seed = 0;                    // reconnect jitter; 0: from the clock
  FaultPlan faults;                            // experiments and tests: a lossy, slow link (off by default)
  // Tests only: bind a CURVE socket with no ZAP handler and no domain
  // enforcement, which libzmq then opens to any key, to prove that the
  // start-up self-test refuses to run.
  bool omit_zap_handler_to_test_the_self_test = false;
};

// Who may connect: Curve25519 public key -> roster name.
using Allowlist = std::map<crypto::BoxPublicKey, std::string>;
// All roster entries, optionally only some roles.
Allowlist allowlist_from_roster(const crypto::Roster& roster);

// The curve key pair a socket uses, copied out of SiteKeys.
struct CurveKeys {
  crypto::BoxPublicKey public_key{};
  crypto::SecretBytes<crypto::kBoxSecretBytes> secret_key;
  static CurveKeys from(const crypto::SiteKeys& keys);
};

class ZmqContext;

// ZAP metadata property carrying the connection's Curve public key (hex).
inline constexpr const char* kPeerKeyProperty = "X-Fedmesh-Curve-Key";

// A received frame: who sent it (ZAP User-Id; empty when insecure) and with
// which key (the Curve public key the handshake proved, 64 hex; empty when
// insecure), the ROUTER routing id to answer to, and the bytes, owned by
// `frame`. A name can outlive its key (a connection made before the key was
// revoked): per-peer budgets are kept by `peer_key`.
struct Incoming {
  std::string peer;
  std::string peer_key;
  std::string routing_id;
  std::shared_ptr<const void> frame;  // keeps `bytes` alive
  std::span<const uint8_t> bytes;
};

// What a runtime needs of its socket, as an interface: production binds the
// CurveZMQ sockets below; the fault simulator (sim/vopr) binds in-process
// channels on virtual time, so the aggregator and site runtimes run
// unchanged there. clock() is the time the channel's waits are measured in:
// code that waits on a channel (uploads, model fetches) reads and sleeps by it.
class ServerChannel {
 public:
  virtual ~ServerChannel() = default;
  virtual const std::string& endpoint() const = 0;
  virtual Result<std::optional<Incoming>> receive(std::chrono::milliseconds timeout) = 0;
  virtual Status send(const std::string& routing_id, OutgoingMessage message) = 0;
  virtual Status send(const std::string& routing_id, const SharedMessage& message) = 0;
  virtual void set_allowlist(Allowlist allowlist) = 0;
  virtual TransportCounters& counters() = 0;
  virtual Clock& clock() = 0;
};

class ClientChannel {
 public:
  virtual ~ClientChannel() = default;
  virtual Result<std::optional<Incoming>> receive(std::chrono::milliseconds timeout) = 0;
  virtual Status send(OutgoingMessage message, std::chrono::milliseconds timeout) = 0;
  virtual Status send(const SharedMessage& message, std::chrono::milliseconds timeout) = 0;
  virtual bool connected() = 0;
  virtual bool handshake_refused() = 0;
  virtual TransportCounters& counters() = 0;
  virtual Clock& clock() = 0;
};

// How a runtime binds and dials: production is CurveZMQ (zmq_network()).
class Network {
 public:
  virtual ~Network() = default;
  virtual Result<std::unique_ptr<ServerChannel>> bind(const std::string& endpoint, const CurveKeys& keys,
                                                      Allowlist allowlist, const TransportOptions& options) = 0;
  virtual Result<std::unique_ptr<ClientChannel>> connect(const std::string& endpoint, const CurveKeys& keys,
                                                         const crypto::BoxPublicKey& server_public,
                                                         const TransportOptions& options) = 0;
};
Network& zmq_network();

class ServerSocket final : public ServerChannel {
 public:
  // Binds `endpoint` (e.g. "tcp://127.0.0.1:*"), starts the ZAP handler
  // first, then runs the self-test. Errors: kUnavailable (address in use),
  // kInternal (self-test admitted a stranger).
  static Result<std::unique_ptr<ServerSocket>> bind(const std::string& endpoint, const CurveKeys& keys,
                                                    Allowlist allowlist, const TransportOptions& options);
  ~ServerSocket();
  ServerSocket(const ServerSocket&) = delete;
  ServerSocket& operator=(const ServerSocket&) = delete;

  const std::string& endpoint() const override { return endpoint_; }  // resolved, e.g. tcp://127.0.0.1:41234
  // Waits up to timeout for one frame. nullopt on timeout. Frames over the
  // message limit come back too: the caller rejects them (read_envelope).
  Result<std::optional<Incoming>> receive(std::chrono::milliseconds timeout) override;
  Status send(const std::string& routing_id, OutgoingMessage message) override;
  // Zero-copy: the queued message holds a reference to `message`'s bytes,
  // so replies that share one buffer (the published model's chunks) cost
  // one copy however many are queued.
  Status send(const std::string& routing_id, const SharedMessage& message) override;
  // Replaces who may connect (a re-signed roster): new handshakes are checked
  // against it. Connections already made stay up; the caller refuses their
  // messages by name.
  void set_allowlist(Allowlist allowlist) override;
  TransportCounters& counters() override { return *counters_; }
  Clock& clock() override { return real_clock(); }
  const TransportOptions& options() const { return options_; }

 private:
  ServerSocket() = default;
  class Impl;
  std::unique_ptr<Impl> impl_;
  std::string endpoint_;
  TransportOptions options_;
  std::shared_ptr<TransportCounters> counters_;
  std::unique_ptr<FaultInjector> faults_;
};

class ClientSocket final : public ClientChannel {
 public:
  // Dials out; ZeroMQ connects (and reconnects, with backoff) in the
  // background. server_public is the server's roster box key.
  static Result<std::unique_ptr<ClientSocket>> connect(const std::string& endpoint, const CurveKeys& keys,
                                                       const crypto::BoxPublicKey& server_public,
                                                       const TransportOptions& options);
  ~ClientSocket();
  ClientSocket(const ClientSocket&) = delete;
  ClientSocket& operator=(const ClientSocket&) = delete;

  Result<std::optional<Incoming>> receive(std::chrono::milliseconds timeout) override;
  // Waits up to timeout for room in the send queue; kUnavailable if none.
  Status send(OutgoingMessage message, std::chrono::milliseconds timeout) override;
  // Zero-copy: ZeroMQ holds a reference until the bytes are on the wire.
  Status send(const SharedMessage& message, std::chrono::milliseconds timeout) override;
  // True once a CURVE handshake completed; false after the server refused
  // our key (handshake_refused) or while disconnected.
  bool connected() override;
  bool handshake_refused() override;
  TransportCounters& counters() override { return *counters_; }
  Clock& clock() override { return real_clock(); }

 private:
  ClientSocket() = default;
  class Impl;
  std::unique_ptr<Impl> impl_;
  std::shared_ptr<TransportCounters> counters_;
  std::unique_ptr<FaultInjector> faults_;
};

// Runs one outgoing message of `bytes` past a socket's fault injector (null:
// no faults): false when it is to be dropped (counted), after waiting out
// its hold otherwise.
bool pass_faults(FaultInjector* faults, uint64_t bytes, TransportCounters& counters);

}  // namespace fedmesh::protocol
