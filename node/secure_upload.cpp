#include "node/secure_upload.h"

#include <kj/exception.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <functional>

#include "base/file_io.h"
#include "protocol/secagg_wire.h"

namespace fedmesh::node {

using crypto::SecAggPhase;
using protocol::SecAggDownMessage;
using protocol::SecAggUpMessage;

namespace {

class Exchange {
 public:
  Exchange(protocol::ClientChannel& socket, const SecureUploadOptions& options) : socket_(socket), options_(options) {}

  // Sends one SecAggUp and waits for its SecAggDown (other replies, such as
  // a late RoundAnnounce, are skipped). A Reject comes back as an error.
  Result<SecAggDownMessage> request(const SecAggUpMessage& up, std::span<const uint32_t> words = {}) {
    FEDMESH_RETURN_IF_ERROR(socket_.send(protocol::encode_secagg_up(up, words), options_.reply_timeout));
    const auto until = socket_.clock().now() + options_.reply_timeout;
    while (socket_.clock().now() < until) {
      Result<std::optional<protocol::Incoming>> incoming = socket_.receive(std::chrono::milliseconds(100));
      if (!incoming.is_ok()) return incoming.status();
      if (!incoming->has_value()) continue;
      std::unique_ptr<protocol::ParsedMessage> parsed;
      protocol::Rejection rejection;
      if (!protocol::parse_message((*incoming)->bytes, protocol::kDefaultMaxMessageBytes, (*incoming)->frame, parsed,
                                   rejection)) {
        return corrupt("unreadable reply from the aggregator: " + rejection.reason);
      }
      try {
        const auto root = parsed->root();
        if (root.isReject()) {
          return invalid_argument(std::string("the aggregator refused: ") + root.getReject().getText().cStr());
        }
        if (!root.isSecAggDown()) continue;
        SecAggDownMessage down;
        if (!protocol::decode_secagg_down(root.getSecAggDown(), down, rejection)) return corrupt(rejection.reason);
        return down;
      } catch (const kj::Exception& e) {
        return corrupt(std::string("malformed reply from the aggregator: ") + e.getDescription().cStr());
      }
    }
    return unavailable("no secure-aggregation reply from the aggregator within " +
                       std::to_string(options_.reply_timeout.count()) + " ms");
  }

 private:
  protocol::ClientChannel& socket_;
  const SecureUploadOptions& options_;
};

void exit_if_asked(const SecureUploadOptions& options, SecAggPhase phase) {
  if (options.exit_at && *options.exit_at == phase) std::raise(SIGKILL);  // a crash, as a test asked
}

// The fixed-point words a session sums for this site, from what its
// SecAggDown says of the session (the length is checked before).
using InputFor = std::function<Result<std::vector<uint32_t>>(const SecAggDownMessage&)>;

Result<SecureUploadOutcome> run_upload(protocol::ClientChannel& socket, const crypto::SiteKeys& keys,
                                       const crypto::Roster& roster, const std::string& label, uint64_t round,
                                       uint64_t base_version, uint64_t length, const InputFor& input_for,
                                       const SecureUploadOptions& options, const SecureEventSink& emit) {
  Exchange exchange(socket, options);
  SecureUploadOutcome outcome;
  std::optional<crypto::SecAggClient> client;
  std::vector<uint32_t> input, masked;
  auto last_progress = socket.clock().now();
  const std::string self = keys.identity.name;

  const auto up = [&](SecAggUpMessage::Kind kind) {
    SecAggUpMessage m;
    m.kind = kind;
    m.round = round;
    if (client) m.session = client->params().session;
    return m;
  };
  // The client gives up this session (the reason is the aggregator's fault
  // or its decision); the upload goes on only where a new session may follow.
  const auto abort_session = [&](const std::string& reason) {
    if (client && client->phase() != SecAggPhase::kAborted && client->phase() != SecAggPhase::kDone) {
      (void)client->abort(reason);
      emit({{"event", "secure_abort"}, {"round", round}, {"session", client->params().session}, {"reason", reason}});
    }
    client.reset();
    masked.clear();
  };

  Result<SecAggDownMessage> down = exchange.request(up(SecAggUpMessage::Kind::kJoin));
  while (true) {
    if (!down.is_ok()) {
      abort_session(down.status().message());
      return down.status();
    }
    const SecAggDownMessage d = std::move(*down);
    if (socket.clock().now() - last_progress > options.give_up) {
      abort_session("no progress");
      return unavailable("secure aggregation made no progress for " +
                         std::to_string(std::chrono::duration_cast<std::chrono::seconds>(options.give_up).count()) + " s");
    }
    if (d.round != round || d.base_version != base_version) {
      abort_session("the aggregator moved to round " + std::to_string(d.round));
      outcome.reason = "the round is over";
      return outcome;
    }
    if (d.session.empty()) {
      abort_session(d.reason);
      outcome.reason = d.reason.empty() ? "no secure-aggregation session" : d.reason;
      return outcome;
    }
    const bool ours = client && client->params().session == d.session;
    if (d.phase == SecAggPhase::kDone) {
      const bool in_sum = ours && std::find(d.alive.begin(), d.alive.end(), self) != d.alive.end();
      if (client) client->finish();
      outcome.contributed = in_sum;
      if (!in_sum) outcome.reason = "session " + d.session + " finished without this site";
      return outcome;
    }
    if (!ours) {
      if (client) abort_session("the aggregator moved to session " + d.session);
      if (d.phase == SecAggPhase::kAdvertise && d.member && !d.answered) {
        exit_if_asked(options, SecAggPhase::kAdvertise);
        crypto::SecAggParams params;
        params.federation = label;
        params.round = round;
        params.session = d.session;
        params.threshold = d.threshold;
        params.length = d.length;
        if (d.length != length) {
          return invalid_argument("the session sums " + std::to_string(d.length) + " words; this site's input has " +
                                  std::to_string(length));
        }
        Result<std::vector<uint32_t>> words = input_for(d);
        if (!words.is_ok()) return words.status();
        Result<crypto::SecAggClient> started = crypto::SecAggClient::start(params, keys, roster, d.invited);
        if (!started.is_ok()) return started.status();  // a session this site refuses to take part in
        client.emplace(std::move(*started));
        ++outcome.sessions;
        outcome.session = d.session;
        input = std::move(*words);
        outcome.words = input.size();
        if (!options.dump_input.empty()) {
          FEDMESH_RETURN_IF_ERROR(write_file_atomically(
              options.dump_input,
              std::string_view(reinterpret_cast<const char*>(input.data()), input.size() * sizeof(uint32_t)), 0600));
        }
        emit({{"event", "secure_session"}, {"round", round}, {"session", d.session}, {"threshold", d.threshold},
              {"invited", d.invited}});
        Result<crypto::SecAggAdvertisement> ad = client->advertise();
        if (!ad.is_ok()) return ad.status();
        SecAggUpMessage m = up(SecAggUpMessage::Kind::kAdvertise);
        m.advertisement = *ad;
        last_progress = socket.clock().now();
        down = exchange.request(m);
        continue;
      }
      // A session without us (it began before we came): wait for the next
      // one or for the round to end.
      socket.clock().sleep_for(options.poll);
      down = exchange.request(up(SecAggUpMessage::Kind::kJoin));
      continue;
    }
    if (!d.member) {
      abort_session("dropped from session " + d.session + ": " + d.reason);
      outcome.reason = "dropped from session " + d.session;
      socket.clock().sleep_for(options.poll);
      down = exchange.request(up(SecAggUpMessage::Kind::kJoin));
      continue;
    }
    if (d.answered) {
      socket.clock().sleep_for(options.poll);
      down = exchange.request(up(SecAggUpMessage::Kind::kPoll));
      continue;
    }
    last_progress = socket.clock().now();
    SecAggUpMessage m;
    switch (d.phase) {
      case SecAggPhase::kShareKeys: {
        exit_if_asked(options, d.phase);
        Result<std::vector<crypto::SecAggShareCipher>> shares = client->share_keys(d.advertisements);
        if (!shares.is_ok()) return shares.status();
        m = up(SecAggUpMessage::Kind::kShares);
        m.shares = std::move(*shares);
        down = exchange.request(m);
        continue;
      }
      case SecAggPhase::kMaskedInput: {
        if (masked.empty()) {
          exit_if_asked(options, d.phase);
          Result<std::vector<uint32_t>> y = client->masked_input(d.shares, input);  // a copy: a new session needs it again
          if (!y.is_ok()) return y.status();
          masked = std::move(*y);
        }
        if (d.masked_next >= masked.size()) {
          socket.clock().sleep_for(options.poll);
          down = exchange.request(up(SecAggUpMessage::Kind::kPoll));
          continue;
        }
        m = up(SecAggUpMessage::Kind::kMasked);
        m.offset = d.masked_next;
        const size_t n = std::min<size_t>(protocol::kSecAggWordsPerMessage, masked.size() - d.masked_next);
        down = exchange.request(m, std::span<const uint32_t>(masked).subspan(d.masked_next, n));
        continue;
      }
      case SecAggPhase::kConsistency: {
        exit_if_asked(options, d.phase);
        Result<crypto::Signature> signature = client->consistency(d.alive);
        if (!signature.is_ok()) return signature.status();
        m = up(SecAggUpMessage::Kind::kConsistency);
        m.signature = *signature;
        down = exchange.request(m);
        continue;
      }
      case SecAggPhase::kUnmask: {
        exit_if_asked(options, d.phase);
        crypto::SecAggUnmaskRequest request{d.alive, d.dropped, d.signatures};
        Result<std::vector<crypto::SecAggReveal>> reveals = client->unmask(request);
        if (!reveals.is_ok()) return reveals.status();
        m = up(SecAggUpMessage::Kind::kReveals);
        m.reveals = std::move(*reveals);
        down = exchange.request(m);
        continue;
      }
      case SecAggPhase::kAborted:
        abort_session(d.reason);
        socket.clock().sleep_for(options.poll);
        down = exchange.request(up(SecAggUpMessage::Kind::kJoin));
        continue;
      default:
        // Advertise with our session and not answered cannot happen: ask again.
        socket.clock().sleep_for(options.poll);
        down = exchange.request(up(SecAggUpMessage::Kind::kPoll));
        continue;
    }
  }
}

}  // namespace

Result<SecureUploadOutcome> secure_upload(protocol::ClientChannel& socket, const crypto::SiteKeys& keys,
                                          const crypto::Roster& roster, uint64_t round, uint64_t base_version,
                                          std::span<const float> delta, const SecureUploadOptions& options,
                                          const SecureEventSink& emit) {
  const auto quantized = [delta](const SecAggDownMessage& d) -> Result<std::vector<uint32_t>> {
    if (!(d.clip > 0.0f) || !std::isfinite(d.clip) || d.fraction_bits > 24 ||
        std::ldexp(static_cast<double>(d.clip), d.fraction_bits) * std::max<uint32_t>(d.invited, 1) >= std::ldexp(1.0, 31)) {
      return invalid_argument("the session's fixed point (clip " + std::to_string(d.clip) + ", " +
                              std::to_string(d.fraction_bits) + " fraction bits) is not usable");
    }
    return crypto::quantize_clipped(delta, d.clip, d.fraction_bits);
  };
  return run_upload(socket, keys, roster, roster.federation, round, base_version, delta.size(), quantized, options,
                    emit);
}

Result<SecureUploadOutcome> secure_upload_words(protocol::ClientChannel& socket, const crypto::SiteKeys& keys,
                                                const crypto::Roster& roster, const std::string& label, uint64_t round,
                                                uint64_t base_version, std::span<const uint32_t> words,
                                                const SecureUploadOptions& options, const SecureEventSink& emit) {
  const auto copied = [words](const SecAggDownMessage&) -> Result<std::vector<uint32_t>> {
    return std::vector<uint32_t>(words.begin(), words.end());
  };
  return run_upload(socket, keys, roster, label, round, base_version, words.size(), copied, options, emit);
}

}  // namespace fedmesh::node
