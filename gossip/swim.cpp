#include "gossip/swim.h"

#include <algorithm>
#include <cmath>

namespace fedmesh::gossip {

const char* member_state_name(MemberState state) {
  switch (state) {
    case MemberState::kAlive: return "alive";
    case MemberState::kSuspect: return "suspect";
    case MemberState::kDead: return "dead";
    case MemberState::kLeft: return "left";
  }
  return "unknown";
}

Status SwimOptions::validate() const {
  if (!(period_seconds > 0.0) || !std::isfinite(period_seconds)) return invalid_argument("the SWIM period must be > 0");
  if (!(ack_timeout_seconds > 0.0) || !(ack_timeout_seconds < period_seconds)) {
    return invalid_argument("the SWIM ack timeout must be in (0, period)");
  }
  if (indirect_checks < 0 || indirect_checks > 16) return invalid_argument("SWIM indirect checks must be in [0, 16]");
  if (!(suspicion_multiplier >= 1.0) || !std::isfinite(suspicion_multiplier)) {
    return invalid_argument("the SWIM suspicion multiplier must be >= 1");
  }
  if (!(suspicion_max_multiplier >= 1.0) || !std::isfinite(suspicion_max_multiplier)) {
    return invalid_argument("the SWIM suspicion max multiplier must be >= 1");
  }
  if (retransmit_multiplier < 1 || retransmit_multiplier > 64) {
    return invalid_argument("the SWIM retransmit multiplier must be in [1, 64]");
  }
  if (max_piggyback < 1 || max_piggyback > 1024) return invalid_argument("SWIM max piggyback must be in [1, 1024]");
  return Status::ok();
}

namespace {

bool is_gone(MemberState state) { return state == MemberState::kDead || state == MemberState::kLeft; }

}  // namespace

Swim::Swim(std::string self, std::string address, SwimOptions options, uint64_t seed)
    : options_(options), rng_(seed) {
  self_.name = std::move(self);
  self_.address = std::move(address);
}

void Swim::resume(uint64_t incarnation, const std::vector<MemberUpdate>& known, double now) {
  self_.incarnation = std::max(self_.incarnation, incarnation + 1);
  for (const MemberUpdate& m : known) {
    if (m.name == self_.name || m.name.empty()) continue;
    const MemberState state = m.state == MemberState::kSuspect ? MemberState::kAlive : m.state;
    const bool is_new = !members_.contains(m.name);
    members_[m.name] = Member{m.name, m.address, m.incarnation, state, now};
    if (is_new && !is_gone(state)) probe_order_.push_back(m.name);
  }
}

void Swim::join(const std::vector<std::pair<std::string, std::string>>& seeds, double now) {
  for (const auto& [name, address] : seeds) {
    if (name == self_.name) continue;
    const auto it = members_.find(name);
    if (it != members_.end()) {
      // Known from before a restart: a gone seed is probed again, at the
      // incarnation it had (an Alive of it still needs a higher one).
      if (is_gone(it->second.state)) {
        it->second.state = MemberState::kAlive;
        it->second.since = now;
        probe_order_.push_back(name);
      }
      continue;
    }
    members_[name] = Member{name, address, 0, MemberState::kAlive, now};
    probe_order_.push_back(name);
  }
  disseminate(update_of(self_));
  next_probe_ = now;
}

int Swim::live_members() const {
  int n = 1;  // ourselves
  for (const auto& [name, member] : members_) n += is_gone(member.state) ? 0 : 1;
  return n;
}

int Swim::count(MemberState state) const {
  int n = 0;
  for (const auto& [name, member] : members_) n += member.state == state ? 1 : 0;
  return n;
}

std::optional<MemberState> Swim::state_of(const std::string& name) const {
  const auto it = members_.find(name);
  if (it == members_.end()) return std::nullopt;
  return it->second.state;
}

double Swim::suspicion_timeout_seconds() const {
  const double scale = std::max(1.0, std::log10(static_cast<double>(live_members()) + 1.0));
  return std::max(2.0, options_.suspicion_multiplier * scale) * options_.period_seconds;
}

// Lifeguard: max - (max - min) x log(C + 1) / log(K + 1) for C confirmations
// beyond the first accuser, K = indirect_checks of them expected.
double Swim::suspicion_timeout_seconds(size_t accusers) const {
  const double low = suspicion_timeout_seconds();
  const double high = low * options_.suspicion_max_multiplier;
  const double confirmations = static_cast<double>(accusers > 0 ? accusers - 1 : 0);
  const double expected = static_cast<double>(std::max(1, options_.indirect_checks));
  const double fraction = std::min(1.0, std::log(confirmations + 1.0) / std::log(expected + 1.0));
  return std::max(low, high - (high - low) * fraction);
}

int Swim::retransmit_limit() const {
  return options_.retransmit_multiplier *
         static_cast<int>(std::ceil(std::log10(static_cast<double>(live_members()) + 1.0)));
}

MemberUpdate Swim::update_of(const Member& member) const {
  MemberUpdate update{member.name, member.address, member.incarnation, member.state, ""};
  if (member.state == MemberState::kSuspect && !member.accusers.empty()) update.accuser = member.accusers.front();
  return update;
}

void Swim::disseminate(const MemberUpdate& update) {
  // A newer word about a member replaces what was queued about it.
  std::erase_if(pending_, [&](const Pending& p) { return p.update.name == update.name; });
  pending_.push_back(Pending{update, 0});
}

std::vector<MemberUpdate> Swim::piggyback(const std::string& to) {
  std::vector<MemberUpdate> out;
  const int limit = retransmit_limit();
  // The buddy system: a suspect hears of its suspicion from whoever probes
  // it, and a member we hold dead hears so from any answer we send it (so a
  // live member declared dead during a partition refutes when it is back).
  const auto target = members_.find(to);
  if (target != members_.end() && target->second.state != MemberState::kAlive &&
      target->second.state != MemberState::kLeft) {
    out.push_back(update_of(target->second));
  }
  // The least-sent first, so that fresh news spreads before old news repeats.
  std::stable_sort(pending_.begin(), pending_.end(),
                   [](const Pending& a, const Pending& b) { return a.transmissions < b.transmissions; });
  for (Pending& p : pending_) {
    if (static_cast<int>(out.size()) >= options_.max_piggyback) break;
    if (!out.empty() && out.front() == p.update) continue;
    out.push_back(p.update);
    ++p.transmissions;
  }
  std::erase_if(pending_, [&](const Pending& p) { return p.transmissions >= limit; });
  return out;
}

void Swim::send(SwimMessageKind kind, const std::string& to, uint64_t sequence, const std::string& target) {
  SwimMessage message;
  message.kind = kind;
  message.from = self_.name;
  message.to = to;
  message.sequence = sequence;
  message.target = target;
  message.updates = piggyback(to);
  outbox_.push_back(std::move(message));
}

void Swim::set_state(Member& member, MemberState state, uint64_t incarnation, double now) {
  const bool changed = member.state != state || member.incarnation != incarnation;
  if (state != MemberState::kSuspect || member.incarnation != incarnation) member.accusers.clear();
  member.incarnation = incarnation;
  if (member.state != state) member.since = now;
  member.state = state;
  if (changed) {
    events_.push_back(MembershipEvent{member.name, state, incarnation, now});
    disseminate(update_of(member));
  }
}

// Another member (or we) confirms a suspicion: counted once per accuser,
// and passed on so that the others' timeouts shrink too.
void Swim::accuse(Member& member, const std::string& accuser, double now) {
  if (accuser.empty() || std::find(member.accusers.begin(), member.accusers.end(), accuser) != member.accusers.end()) {
    return;
  }
  member.accusers.push_back(accuser);
  MemberUpdate update = update_of(member);
  update.accuser = accuser;
  disseminate(update);
  (void)now;
}

void Swim::refute(uint64_t incarnation, double now) {
  if (left_) return;
  self_.incarnation = std::max(self_.incarnation, incarnation) + 1;
  events_.push_back(MembershipEvent{self_.name, MemberState::kAlive, self_.incarnation, now});
  disseminate(update_of(self_));
}

void Swim::apply(const MemberUpdate& update, double now) {
  if (update.name.empty()) return;
  if (update.name == self_.name) {
    // Word that we are suspect or dead is refuted with a higher incarnation.
    if (update.state == MemberState::kSuspect || update.state == MemberState::kDead) {
      if (update.incarnation >= self_.incarnation) {
        refute(update.incarnation, now);
      } else if (!left_) {
        // A stale rumour (we refuted it already): whoever still spreads it
        // missed our refutation, so say it again.
        disseminate(update_of(self_));
      }
    }
    return;
  }
  auto it = members_.find(update.name);
  if (it == members_.end()) {
    if (is_gone(update.state)) {
      // Remember the departed so that an older Alive cannot bring them back.
      members_[update.name] = Member{update.name, update.address, update.incarnation, update.state, now};
      return;
    }
    members_[update.name] = Member{update.name, update.address, update.incarnation, update.state, now};
    probe_order_.insert(probe_order_.begin() + static_cast<int64_t>(rng_.below(probe_order_.size() + 1)), update.name);
    events_.push_back(MembershipEvent{update.name, update.state, update.incarnation, now});
    disseminate(update);
    return;
  }
  Member& member = it->second;
  if (!update.address.empty()) member.address = update.address;
  switch (update.state) {
    case MemberState::kAlive:
      if (update.incarnation > member.incarnation) set_state(member, MemberState::kAlive, update.incarnation, now);
      break;
    case MemberState::kSuspect:
      if ((member.state == MemberState::kAlive && update.incarnation >= member.incarnation) ||
          (member.state == MemberState::kSuspect && update.incarnation > member.incarnation)) {
        set_state(member, MemberState::kSuspect, update.incarnation, now);
        accuse(member, update.accuser, now);
      } else if (member.state == MemberState::kSuspect && update.incarnation == member.incarnation) {
        accuse(member, update.accuser, now);  // a confirmation
      }
      break;
    case MemberState::kDead:
    case MemberState::kLeft:
      if (!is_gone(member.state) && update.incarnation >= member.incarnation) {
        set_state(member, update.state, update.incarnation, now);
      }
      break;
  }
}

void Swim::start_probe(double now) {
  // Round-robin over a shuffled list; reshuffled after each full pass.
  std::vector<std::string> candidates;
  for (size_t tried = 0; tried < probe_order_.size(); ++tried) {
    if (probe_index_ >= probe_order_.size()) {
      probe_index_ = 0;
      rng_.shuffle(std::span<std::string>(probe_order_));
    }
    const std::string& name = probe_order_[probe_index_++];
    const auto it = members_.find(name);
    if (it != members_.end() && !is_gone(it->second.state)) {
      probe_ = Probe{name, ++sequence_, now, false, false};
      send(SwimMessageKind::kPing, name, probe_->sequence);
      return;
    }
  }
  probe_.reset();
}

void Swim::tick(double now) {
  if (left_) return;
  // The probe of the last period: indirect checks after ack_timeout, a
  // suspicion if the period ended without an ack.
  if (probe_ && !probe_->acked) {
    const auto target = members_.find(probe_->target);
    const bool target_gone = target == members_.end() || is_gone(target->second.state);
    if (!target_gone && !probe_->indirect_sent && now >= probe_->started + options_.ack_timeout_seconds) {
      probe_->indirect_sent = true;
      std::vector<std::string> helpers;
      for (const auto& [name, member] : members_) {
        if (name != probe_->target && member.state == MemberState::kAlive) helpers.push_back(name);
      }
      rng_.shuffle(std::span<std::string>(helpers));
      helpers.resize(std::min<size_t>(helpers.size(), static_cast<size_t>(options_.indirect_checks)));
      for (const std::string& helper : helpers) send(SwimMessageKind::kPingReq, helper, probe_->sequence, probe_->target);
    }
    if (!target_gone && now >= probe_->started + options_.period_seconds) {
      Member& member = target->second;
      if (member.state == MemberState::kAlive) {
        set_state(member, MemberState::kSuspect, member.incarnation, now);
        accuse(member, self_.name, now);
        // Tell the suspect at once (the Ping carries its suspicion): if it is
        // alive it refutes in its answer instead of waiting to be probed.
        send(SwimMessageKind::kPing, member.name, ++sequence_);
      } else if (member.state == MemberState::kSuspect) {
        accuse(member, self_.name, now);  // our own probe confirms it
      }
      probe_.reset();
    }
  }
  // Suspects whose time is up are declared dead.
  for (auto& [name, member] : members_) {
    if (member.state == MemberState::kSuspect &&
        now >= member.since + suspicion_timeout_seconds(member.accusers.size())) {
      set_state(member, MemberState::kDead, member.incarnation, now);
    }
  }
  std::erase_if(forwards_, [&](const auto& entry) { return now > entry.second.expires; });
  if (now >= next_probe_) {
    start_probe(now);
    next_probe_ = now + options_.period_seconds;
    // While we suspect someone, we also ping the oldest suspect every
    // period (not a probe: its silence confirms nothing). The Ping carries
    // the suspicion; a live suspect's Ack carries its refutation back to us,
    // so a refutation that the gossip missed us with still arrives.
    const Member* oldest = nullptr;
    for (const auto& [name, member] : members_) {
      if (member.state == MemberState::kSuspect && (oldest == nullptr || member.since < oldest->since)) {
        oldest = &member;
      }
    }
    if (oldest != nullptr && (!probe_ || probe_->target != oldest->name)) {
      send(SwimMessageKind::kPing, oldest->name, ++sequence_);
    }
  }
}

void Swim::receive(const SwimMessage& message, double now) {
  if (left_ || message.to != self_.name || message.from == self_.name) return;
  // A message is itself word that its sender is alive, at whatever
  // incarnation we know (news of a higher one comes in its updates).
  if (!members_.contains(message.from)) {
    apply(MemberUpdate{message.from, "", 0, MemberState::kAlive}, now);
  }
  for (const MemberUpdate& update : message.updates) apply(update, now);
  switch (message.kind) {
    case SwimMessageKind::kPing:
      send(SwimMessageKind::kAck, message.from, message.sequence);
      break;
    case SwimMessageKind::kPingReq: {
      if (message.target.empty() || message.target == self_.name) break;
      const uint64_t sequence = ++sequence_;
      forwards_[sequence] = Forward{message.from, message.sequence, now + options_.period_seconds};
      send(SwimMessageKind::kPing, message.target, sequence);
      break;
    }
    case SwimMessageKind::kAck: {
      if (const auto forward = forwards_.find(message.sequence); forward != forwards_.end()) {
        // Our probe on someone's behalf was answered: pass the ack on,
        // naming the member it came from.
        SwimMessage relay;
        relay.kind = SwimMessageKind::kAck;
        relay.from = self_.name;
        relay.to = forward->second.requester;
        relay.sequence = forward->second.requester_sequence;
        relay.target = message.from;
        // The target's own news first (e.g. its refutation of the very
        // suspicion that made the requester ask), then ours.
        relay.updates = message.updates;
        for (MemberUpdate& update : piggyback(relay.to)) {
          if (static_cast<int>(relay.updates.size()) >= 2 * options_.max_piggyback) break;
          relay.updates.push_back(std::move(update));
        }
        outbox_.push_back(std::move(relay));
        forwards_.erase(forward);
        break;
      }
      const std::string& answered = message.target.empty() ? message.from : message.target;
      if (probe_ && probe_->sequence == message.sequence && probe_->target == answered) probe_->acked = true;
      break;
    }
  }
}

void Swim::leave(double now) {
  if (left_) return;
  Member gone = self_;
  gone.state = MemberState::kLeft;
  disseminate(update_of(gone));
  // Tell a few members directly; they spread it.
  std::vector<std::string> alive;
  for (const auto& [name, member] : members_) {
    if (member.state == MemberState::kAlive) alive.push_back(name);
  }
  rng_.shuffle(std::span<std::string>(alive));
  alive.resize(std::min<size_t>(alive.size(), static_cast<size_t>(std::max(1, options_.indirect_checks))));
  for (const std::string& name : alive) send(SwimMessageKind::kPing, name, ++sequence_);
  events_.push_back(MembershipEvent{self_.name, MemberState::kLeft, self_.incarnation, now});
  left_ = true;
}

std::vector<SwimMessage> Swim::take_outbox() { return std::exchange(outbox_, {}); }
std::vector<MembershipEvent> Swim::take_events() { return std::exchange(events_, {}); }

}  // namespace fedmesh::gossip
