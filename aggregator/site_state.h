// What the operator is shown of each site (the dashboard's table, /status):
// one state out of five, decided from what the aggregator knows of it.
//
//   revoked    no longer on the roster (`fedmesh roster revoke`): its
//              messages are refused by name
//   dropped    not heard from within site_timeout_seconds (or never)
//   late       missed the deadline of the last round it was sampled for, or
//              its update came for a round that had closed; cleared by its
//              next accepted update (so a site that misses round after
//              round stays late while it trains for the next one)
//   training   sampled for the open round and its update not in yet
//              (asynchronous rounds: every connected site trains all along)
//   connected  heard from, with nothing owed
//
// The first that applies wins, in that order.
#pragma once

namespace fedmesh::aggregator {

enum class SiteState { kConnected, kTraining, kLate, kDropped, kRevoked };

struct SiteFacts {
  bool on_roster = true;
  double seconds_since_contact = -1.0;  // < 0: never heard from
  bool asynchronous = false;
  bool sampled_in_open_round = false;
  bool delivered_this_round = false;
  bool missed_last_round = false;
};

SiteState classify_site(const SiteFacts& facts, double site_timeout_seconds);

// "connected", "training", "late", "dropped", "revoked".
const char* site_state_name(SiteState state);

}  // namespace fedmesh::aggregator
