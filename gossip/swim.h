// SWIM membership and failure detection (Das, Gupta, Motivala 2002), as a
// state machine with no clock and no sockets of its own: the caller passes
// the time to tick() and receive(), and sends what take_outbox() returns.
// The same machine runs over the real transport in a node and over a fake
// network with a fake clock in the tests.
//
// Each protocol period a member probes one other member (round-robin over a
// shuffled list, as HashiCorp memberlist does): a Ping, and if no Ack comes
// within ack_timeout, PingReqs to `indirect_checks` other members who probe
// the target on its behalf and forward its Ack. A target that answered by
// the end of the period is alive; otherwise it becomes Suspect with its
// current incarnation, and the prober tells the suspect so directly. A
// suspect that does not refute within its suspicion timeout is declared
// Dead. As in Lifeguard (memberlist's default), the timeout starts long
// (suspicion_max_multiplier x the minimum) and shrinks towards the minimum
// (suspicion_multiplier x log10(n + 1) periods, never below 2) as other
// members independently confirm the suspicion: a member that really died is
// confirmed by everyone who probes it, one lost packet is not. A
// member that learns it is suspected (or declared dead) refutes by raising
// its incarnation and announcing itself Alive. Joins, suspicions, deaths,
// leaves and refutations are disseminated by piggybacking on every message,
// each retransmitted retransmit_multiplier x ceil(log10(n + 1)) times; a
// Ping to a suspect carries that suspicion first (Lifeguard's buddy system),
// so the suspect hears of it and can refute at once; while a member suspects
// someone it pings the oldest suspect every period, so that a refutation
// the gossip missed it with comes back in the Ack. A member told a stale
// rumour about itself (an incarnation it already refuted) says Alive again.
//
// Merge rules (an update about member m with incarnation i):
//   Alive i   overrides Alive/Suspect/Dead with a lower incarnation
//   Suspect i overrides Alive with incarnation <= i, Suspect with < i
//   Dead i    overrides Alive/Suspect with incarnation <= i
//   Left i    as Dead (a graceful leave: no suspicion period)
// A Dead or Left member stays known (it can come back only with a higher
// incarnation), so a stale Alive never resurrects it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/random.h"
#include "base/status.h"

namespace fedmesh::gossip {

enum class MemberState : uint8_t { kAlive = 0, kSuspect = 1, kDead = 2, kLeft = 3 };
const char* member_state_name(MemberState state);

struct SwimOptions {
  double period_seconds = 1.0;        // one probe per period
  double ack_timeout_seconds = 0.4;   // then the indirect probes
  int indirect_checks = 3;            // k members asked to probe on our behalf
  double suspicion_multiplier = 4.0;  // minimum suspicion timeout = this x log10(n + 1) periods (>= 2 periods)
  double suspicion_max_multiplier = 6.0;  // an unconfirmed suspicion waits this x the minimum
  int retransmit_multiplier = 4;      // each update piggybacks this x ceil(log10(n + 1)) times
  int max_piggyback = 12;             // updates per message
  Status validate() const;
};

// What one message says about one member.
struct MemberUpdate {
  std::string name, address;
  uint64_t incarnation = 0;
  MemberState state = MemberState::kAlive;
  std::string accuser;  // Suspect: the member whose probe failed
  bool operator==(const MemberUpdate&) const = default;
};

enum class SwimMessageKind : uint8_t { kPing = 0, kPingReq = 1, kAck = 2 };

struct SwimMessage {
  SwimMessageKind kind = SwimMessageKind::kPing;
  std::string from, to;   // member names
  uint64_t sequence = 0;  // the probe this belongs to (the sender's counter)
  std::string target;     // PingReq: whom to probe
  std::vector<MemberUpdate> updates;  // piggybacked dissemination
};

struct Member {
  std::string name, address;
  uint64_t incarnation = 0;
  MemberState state = MemberState::kAlive;
  double since = 0.0;  // when it entered this state
  std::vector<std::string> accusers;  // Suspect: distinct members that confirmed it
};

// A change a caller may want to log or count.
struct MembershipEvent {
  std::string member;
  MemberState state;  // the new state (kAlive: joined or refuted)
  uint64_t incarnation = 0;
  double at = 0.0;
};

class Swim {
 public:
  Swim(std::string self, std::string address, SwimOptions options, uint64_t seed);

  const std::string& self() const { return self_.name; }
  uint64_t incarnation() const { return self_.incarnation; }

  // Seeds: members to start from (name, address), known alive at incarnation 0
  // until they say otherwise; our own Alive goes out with the first messages.
  void join(const std::vector<std::pair<std::string, std::string>>& seeds, double now);
  // A restarted member, before join(): its incarnation goes past the one it
  // had (so its Alive overrides whatever the others concluded while it was
  // gone, without waiting to hear the rumour), and the members it knew
  // come back with their incarnations: alive and suspect ones alive (a
  // suspicion's clock did not survive the restart; probing decides again),
  // dead and left ones gone, so that a stale Alive does not resurrect them.
  // A seed given to join() is probed even if it was gone (it may be back,
  // and a member that knows only gone members would hear from no one).
  void resume(uint64_t incarnation, const std::vector<MemberUpdate>& known, double now);
  // Runs the protocol up to `now`: starts probes, sends indirect probes,
  // raises suspicions and declares suspects dead when their time is up.
  void tick(double now);
  // A message from the network. Messages not addressed to us are ignored.
  void receive(const SwimMessage& message, double now);
  // A graceful leave: announces Left to a few members; the machine then
  // stops probing and answering.
  void leave(double now);

  std::vector<SwimMessage> take_outbox();
  std::vector<MembershipEvent> take_events();

  // Every member we know of, ourselves excluded, by name.
  const std::map<std::string, Member>& members() const { return members_; }
  std::optional<MemberState> state_of(const std::string& name) const;
  int count(MemberState state) const;
  // The minimum suspicion timeout, and the one for a suspicion confirmed by
  // `accusers` distinct members.
  double suspicion_timeout_seconds() const;
  double suspicion_timeout_seconds(size_t accusers) const;

 private:
  struct Probe {
    std::string target;
    uint64_t sequence = 0;
    double started = 0.0;
    bool indirect_sent = false;
    bool acked = false;
  };
  struct Forward {  // a PingReq we serve: our probe `sequence` answers theirs
    std::string requester;
    uint64_t requester_sequence = 0;
    double expires = 0.0;
  };
  struct Pending {
    MemberUpdate update;
    int transmissions = 0;
  };

  void start_probe(double now);
  void send(SwimMessageKind kind, const std::string& to, uint64_t sequence, const std::string& target = "");
  void apply(const MemberUpdate& update, double now);
  void set_state(Member& member, MemberState state, uint64_t incarnation, double now);
  void accuse(Member& member, const std::string& accuser, double now);
  void disseminate(const MemberUpdate& update);
  void refute(uint64_t incarnation, double now);
  std::vector<MemberUpdate> piggyback(const std::string& to);
  int retransmit_limit() const;
  int live_members() const;
  MemberUpdate update_of(const Member& member) const;

  Member self_;
  SwimOptions options_;
  Rng rng_;
  std::map<std::string, Member> members_;
  std::vector<std::string> probe_order_;
  size_t probe_index_ = 0;
  std::optional<Probe> probe_;
  double next_probe_ = 0.0;
  uint64_t sequence_ = 0;
  std::map<uint64_t, Forward> forwards_;
  std::vector<Pending> pending_;
  std::vector<SwimMessage> outbox_;
  std::vector<MembershipEvent> events_;
  bool left_ = false;
};

}  // namespace fedmesh::gossip
