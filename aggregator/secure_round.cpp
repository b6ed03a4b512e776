#include "aggregator/secure_round.h"

#include <sodium.h>

#include <algorithm>
#include <cmath>

#include "crypto/keys.h"

namespace fedmesh::aggregator {

using crypto::SecAggPhase;

Status SecureOptions::validate(size_t sites) const {
  if (!(phase_seconds > 0.0)) return invalid_argument("secure_aggregation.phase_seconds must be > 0");
  if (!(clip > 0.0f) || !std::isfinite(clip)) return invalid_argument("secure_aggregation.clip must be a positive L2 norm");
  if (fraction_bits < 0 || fraction_bits > 24) return invalid_argument("secure_aggregation.fraction_bits must be in 0..24");
  // Every coordinate of a clipped update is within ±clip; n of them must sum within int32.
  const double worst = static_cast<double>(std::max<size_t>(sites, 1)) * clip * std::ldexp(1.0, fraction_bits);
  if (worst >= std::ldexp(1.0, 31)) {
    return invalid_argument("secure_aggregation: " + std::to_string(sites) + " sites x clip " + std::to_string(clip) +
                            " x 2^" + std::to_string(fraction_bits) +
                            " overflows the 32-bit sum; lower clip or fraction_bits");
  }
  if (threshold == 1) return invalid_argument("secure_aggregation.threshold must be 0 (a majority) or >= 2");
  return Status::ok();
}

std::vector<float> SecureResult::mean(int fraction_bits) const {
  std::vector<float> out(sum.size());
  // crypto::from_fixed_point, then / k, as one multiplication.
  const double scale = std::ldexp(1.0, -fraction_bits) / static_cast<double>(std::max<size_t>(contributors.size(), 1));
  for (size_t i = 0; i < sum.size(); ++i) out[i] = static_cast<float>(static_cast<double>(static_cast<int32_t>(sum[i])) * scale);
  return out;
}

protocol::SecAggDownMessage secagg_view(const crypto::SecAggServer& s, const std::string& site) {
  protocol::SecAggDownMessage d;
  d.round = s.params().round;
  d.session = s.params().session;
  d.length = s.params().length;
  d.phase = s.phase();
  d.member = s.member(site);
  d.answered = s.answered(site);
  d.threshold = s.params().threshold;
  d.invited = static_cast<uint32_t>(s.invited().size());
  if (!d.member) return d;
  switch (d.phase) {
    case SecAggPhase::kShareKeys: d.advertisements = s.advertisements(); break;
    case SecAggPhase::kMaskedInput:
      d.masked_next = s.masked_words_received(site);
      // The shares once: a site sending its input in pieces has them already.
      if (d.masked_next == 0) d.shares = s.shares_for(site);
      break;
    case SecAggPhase::kConsistency:
    case SecAggPhase::kDone: d.alive = s.alive(); break;
    case SecAggPhase::kUnmask: {
      const crypto::SecAggUnmaskRequest r = s.unmask_request();
      d.alive = r.alive;
      d.dropped = r.dropped;
      d.signatures = r.signatures;
      break;
    }
    default: break;
  }
  return d;
}

void add_dp_fedavg_noise(std::span<float> mean, double noise_multiplier, double clip, size_t contributors,
                         crypto::NoiseSource& source) {
  if (noise_multiplier <= 0.0) return;
  // One site's clipped update moves the mean by at most clip / k.
  const double sensitivity = clip / static_cast<double>(std::max<size_t>(contributors, 1));
  const double stddev = noise_multiplier * sensitivity;
  crypto::add_grid_gaussian_noise(mean, stddev, crypto::noise_grid(sensitivity, stddev), source);
}

SecureRound::SecureRound(SecureOptions options, const crypto::Roster& roster, std::string federation, uint64_t length,
                         EventSink emit)
    : options_(options), roster_(roster), federation_(std::move(federation)), length_(length), emit_(std::move(emit)) {}

void SecureRound::open(int64_t round, int64_t base_version, std::vector<std::string> sampled, Clock::time_point now) {
  round_open_ = true;
  round_ = round;
  base_version_ = base_version;
  sampled_ = std::move(sampled);
  last_abort_.clear();
  start_session(now);
}

void SecureRound::close() {
  if (server_ && server_->phase() != SecAggPhase::kDone && server_->phase() != SecAggPhase::kAborted) {
    emit_({{"event", "secure_session_end"}, {"round", round_}, {"session", server_->params().session},
           {"phase", crypto::secagg_phase_name(server_->phase())}, {"reason", "the round closed at its deadline"}});
  }
  round_open_ = false;
  server_.reset();
}

void SecureRound::start_session(Clock::time_point now) {
  server_.reset();
  if (sampled_.size() < 2) {
    last_abort_ = "secure aggregation needs at least 2 sites in the round";
    return;
  }
  crypto::ensure_sodium();
  std::array<uint8_t, 8> nonce{};
  randombytes_buf(nonce.data(), nonce.size());
  crypto::SecAggParams params;
  params.federation = federation_;
  params.round = static_cast<uint64_t>(round_);
  params.session.clear();
  params.session.push_back('r');
  params.session.append(std::to_string(round_));
  params.session.push_back('-');
  params.session.append(crypto::to_hex(nonce));
  params.length = length_;
  const uint32_t majority = crypto::secagg_min_threshold(sampled_.size());
  params.threshold = options_.threshold == 0 ? majority : std::max(options_.threshold, majority);
  params.threshold = std::min<uint32_t>(params.threshold, static_cast<uint32_t>(sampled_.size()));
  Result<crypto::SecAggServer> created = crypto::SecAggServer::create(params, roster_, sampled_);
  if (!created.is_ok()) {
    last_abort_ = created.status().message();
    emit_({{"event", "secure_session_aborted"}, {"round", round_}, {"reason", last_abort_}});
    return;
  }
  server_.emplace(std::move(*created));
  ++sessions_;
  announced_ = SecAggPhase::kAdvertise;
  phase_deadline_ = now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options_.phase_seconds));
  emit_({{"event", "secure_session"}, {"round", round_}, {"session", params.session}, {"invited", sampled_},
         {"threshold", params.threshold}, {"words", length_}});
}

protocol::SecAggDownMessage SecureRound::view(const std::string& site) const {
  // After a result, until the next round opens, sites see `done`.
  const bool shown = server_ && (round_open_ || server_->phase() == SecAggPhase::kDone);
  protocol::SecAggDownMessage d = shown ? secagg_view(*server_, site) : protocol::SecAggDownMessage{};
  d.round = static_cast<uint64_t>(round_);
  d.base_version = static_cast<uint64_t>(base_version_);
  d.clip = options_.clip;
  d.fraction_bits = static_cast<uint8_t>(options_.fraction_bits);
  d.length = length_;
  if (!shown) {
    d.phase = SecAggPhase::kAborted;
    d.reason = round_open_ ? last_abort_ : "no round is open";
  } else if (!d.member) {
    d.reason = d.phase == SecAggPhase::kAborted ? server_->abort_reason()
                                                : "not in session " + d.session + " (it is in phase " +
                                                      crypto::secagg_phase_name(d.phase) + ")";
  }
  return d;
}

bool SecureRound::handle(const std::string& site, const protocol::SecAggUpMessage& up,
                         std::optional<protocol::OutgoingMessage>& reply, protocol::Rejection& rejection) {
  using K = protocol::SecAggUpMessage::Kind;
  const bool contribution = up.kind != K::kJoin && up.kind != K::kPoll;
  if (contribution && server_ && round_open_ && up.session == server_->params().session &&
      up.round == static_cast<uint64_t>(round_)) {
    Status s;
    crypto::SecAggServer& server = *server_;
    switch (up.kind) {
      case K::kAdvertise: s = server.advertise(site, up.advertisement); break;
      case K::kShares: s = server.share_keys(site, up.shares); break;
      case K::kMasked: s = server.masked_input(site, up.offset, up.words); break;
      case K::kConsistency: s = server.consistency(site, up.signature); break;
      case K::kReveals: s = server.unmask(site, up.reveals); break;
      default: break;
    }
    if (!s.is_ok()) {
      rejection = {wire::RejectCode::MALFORMED, "secure aggregation: " + s.message()};
      return false;
    }
    after_change(Clock::now());
  }
  // A contribution to a session that is over (or another round's) is not an
  // error of the site's: the view tells it where things stand.
  reply = protocol::encode_secagg_down(view(site));
  return true;
}

void SecureRound::after_change(Clock::time_point now) {
  // Phases that every member answered close at once.
  while (server_ && server_->phase() < SecAggPhase::kDone && server_->phase_complete()) {
    server_->advance();
    phase_deadline_ = now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options_.phase_seconds));
  }
}

std::optional<SecureResult> SecureRound::tick(Clock::time_point now) {
  if (!round_open_) return std::nullopt;
  if (!server_) return std::nullopt;
  if (server_->phase() < SecAggPhase::kDone && now >= phase_deadline_) {
    server_->advance();
    phase_deadline_ = now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options_.phase_seconds));
  }
  after_change(now);
  const SecAggPhase phase = server_->phase();
  if (phase != announced_) {
    announced_ = phase;
    if (phase < SecAggPhase::kDone) {
      emit_({{"event", "secure_phase"}, {"round", round_}, {"session", server_->params().session},
             {"phase", crypto::secagg_phase_name(phase)}});
    }
  }
  if (phase == SecAggPhase::kAborted) {
    last_abort_ = server_->abort_reason();
    emit_({{"event", "secure_session_aborted"}, {"round", round_}, {"session", server_->params().session},
           {"reason", last_abort_}});
    start_session(now);  // new id, new keys; the sites that are left join it
    return std::nullopt;
  }
  if (phase != SecAggPhase::kDone) return std::nullopt;
  SecureResult result;
  result.round = round_;
  result.base_version = base_version_;
  result.session = server_->params().session;
  result.contributors = server_->alive();
  result.sum = server_->sum();
  // Sites still polling see `done` until the round's model is announced.
  round_open_ = false;
  return result;
}

}  // namespace fedmesh::aggregator
