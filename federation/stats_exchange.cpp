#include "federation/stats_exchange.h"

#include <capnp/message.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>

#include "crypto/roster.h"
#include "federation/stats_fixed_point.h"
#include "protocol/transport.h"
#include "protocol/update_transfer.h"

namespace fedmesh::federation {

namespace {

using Clock = std::chrono::steady_clock;
using train::data::DataStats;
using train::data::FeatureSums;

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

// "site-a, site-b" of the names in `all` missing from `have`.
std::string missing_names(const std::vector<std::string>& all, const std::map<std::string, DataStats>& have) {
  std::string out;
  for (const std::string& name : all) {
    if (have.count(name) == 0) out += (out.empty() ? "" : ", ") + name;
  }
  return out;
}

// How `got` differs from `want` (kind, feature count, the first name
// apart); "" when they describe the same features.
std::string difference(const DataStats& want, const DataStats& got) {
  if (got.kind != want.kind) return "sums of " + got.kind + ", expected " + want.kind;
  if (got.features.size() != want.features.size()) {
    return std::to_string(got.features.size()) + " features, expected " + std::to_string(want.features.size());
  }
  for (size_t i = 0; i < got.features.size(); ++i) {
    if (got.features[i].name != want.features[i].name) {
      return "feature " + std::to_string(i + 1) + " is '" + got.features[i].name.substr(0, 64) + "', expected '" +
             want.features[i].name.substr(0, 64) + "'";
    }
  }
  return "";
}

Result<crypto::Membership> load(const StatsMembership& m) {
  return crypto::load_membership(m.keys, m.name, m.roster, m.admin_public, m.federation);
}

}  // namespace

Result<DataStats> serve_stats(const StatsServeOptions& options, const StatsEventSink& emit) {
  Result<crypto::Membership> membership = load(options.member);
  if (!membership.is_ok()) return membership.status();
  std::vector<std::string> expected;
  for (const crypto::RosterEntry& entry : membership->roster.sites) {
    if (entry.role == crypto::Role::kSite) expected.push_back(entry.identity.name);
  }
  if (expected.empty()) {
    return invalid_argument(options.member.roster + ": no sites on the roster to compute statistics with");
  }
  if (options.masked != nullptr && expected.size() < 2) {
    return invalid_argument(options.member.roster + ": secure aggregation needs at least 2 sites on the roster (one "
                            "site's sums would be its own)");
  }
  protocol::TransportOptions transport;
  Result<std::unique_ptr<protocol::ServerSocket>> bound =
      protocol::ServerSocket::bind(options.listen, protocol::CurveKeys::from(membership->keys),
                                   protocol::allowlist_from_roster(membership->roster), transport);
  if (!bound.is_ok()) return bound.status();
  protocol::ServerSocket& socket = **bound;
  emit({{"event", "listening"}, {"endpoint", socket.endpoint()}, {"sites", expected}});

  std::map<std::string, DataStats> reports;  // private mode: the feature names only
  bool session_open = false;                 // private mode: every site named its features
  std::optional<DataStats> merged;
  std::optional<protocol::OutgoingMessage> merged_message;
  const Clock::time_point deadline = Clock::now() + millis(options.timeout_seconds);
  Clock::time_point linger_until{};
  const auto reply = [&](const std::string& routing_id, protocol::OutgoingMessage message) {
    (void)socket.send(routing_id, std::move(message));  // a site that left asks again or times out
  };
  // The merged statistics are in: write them, answer with them from now on.
  const auto conclude = [&](DataStats all) -> Status {
    FEDMESH_RETURN_IF_ERROR(train::data::write_data_stats(all, options.out));
    merged = std::move(all);
    merged_message = make_stats_merged(options.member.federation, *merged);
    linger_until = Clock::now() + millis(options.linger_seconds);
    emit({{"event", "merged"}, {"parts", merged->parts}, {"digest", merged->digest()}, {"out", options.out}});
    return Status::ok();
  };
  for (;;) {
    const Clock::time_point now = Clock::now();
    if (merged && now >= linger_until) return *merged;
    if (!merged && now >= deadline) {
      const std::string seconds = std::to_string(static_cast<int64_t>(options.timeout_seconds));
      if (session_open) return unavailable("statistics: the secure-aggregation session did not finish in " + seconds + " s");
      return unavailable("statistics: no sums from " + missing_names(expected, reports) + " after " + seconds + " s");
    }
    if (session_open && !merged) {
      if (std::optional<MaskedStatsSum::Sum> sum = options.masked->tick()) {
        emit({{"event", "masked_sum"}, {"contributors", sum->contributors}});
        Result<DataStats> all = decode_stats_words(sum->words, reports.begin()->second,
                                                   static_cast<int64_t>(sum->contributors.size()));
        if (!all.is_ok()) return all.status();
        FEDMESH_RETURN_IF_ERROR(conclude(std::move(*all)));
      }
    }
    Result<std::optional<protocol::Incoming>> got = socket.receive(std::chrono::milliseconds(200));
    if (!got.is_ok()) return got.status();
    if (!got->has_value()) continue;
    const protocol::Incoming& incoming = **got;
    std::unique_ptr<protocol::ParsedMessage> parsed;
    protocol::Rejection rejection;
    const auto refuse = [&](const protocol::Rejection& why) {
      emit({{"event", "refused"}, {"site", incoming.peer}, {"code", protocol::reject_code_name(why.code)},
            {"reason", why.reason}});
      reply(incoming.routing_id, protocol::make_reject(0, why));
    };
    if (!protocol::parse_message(incoming.bytes, transport.max_message_bytes, incoming.frame, parsed, rejection)) {
      refuse(rejection);
      continue;
    }
    const auto root = parsed->root();
    const crypto::RosterEntry* sender = membership->roster.find(incoming.peer);
    if (sender == nullptr || sender->role != crypto::Role::kSite) {
      refuse({wire::RejectCode::WRONG_ROLE, incoming.peer.substr(0, 64) + " is not a site of the roster"});
      continue;
    }
    if (root.which() == wire::Message::SEC_AGG_UP && session_open) {
      std::optional<protocol::OutgoingMessage> answer;
      if (!options.masked->handle(incoming.peer, root.getSecAggUp(), answer, rejection)) {
        refuse(rejection);
      } else if (answer) {
        reply(incoming.routing_id, std::move(*answer));
      }
      continue;
    }
    if (root.which() != wire::Message::STATS_REPORT) {
      refuse({wire::RejectCode::MALFORMED,
              root.which() == wire::Message::SEC_AGG_UP
                  ? "no secure-aggregation session is open: not every site has named its features yet"
                  : "this aggregator is computing the federation's statistics: it takes statistics reports only, "
                    "and trains later"});
      continue;
    }
    const auto report = root.getStatsReport();
    if (std::string(report.getFederation().cStr()) != options.member.federation) {
      refuse({wire::RejectCode::WRONG_FEDERATION, "statistics for another federation"});
      continue;
    }
    const bool private_mode = options.masked != nullptr;
    if (report.getMasked() != private_mode) {
      refuse({wire::RejectCode::WRONG_ROLE,
              private_mode ? "this federation is private: the aggregator takes a site's sums masked only (set "
                             "privacy.mode = \"private\" in the site's config); these came in the clear"
                           : "this aggregator takes the sums in the clear (privacy.mode = \"trusted\"); this site "
                             "sends them masked"});
      continue;
    }
    DataStats sums;
    if (!decode_feature_sums(report.getFeatures(), report.getKind().cStr(), sums, rejection, private_mode)) {
      refuse(rejection);
      continue;
    }
    if (merged) {  // lingering: everyone's sums are in; answer again
      reply(incoming.routing_id, protocol::OutgoingMessage::from_bytes(merged_message->bytes()));
      continue;
    }
    if (session_open) {  // private mode: the session over everyone's features is running
      if (const std::string differs = difference(reports.begin()->second, sums); !differs.empty()) {
        refuse({wire::RejectCode::OUT_OF_RANGE, "statistics that do not match the federation's features: " + differs});
      } else {
        reply(incoming.routing_id, make_stats_join(options.member.federation));
      }
      continue;
    }
    // Every site must describe the same features: those of the aggregator's
    // validation data, or else those of the first report in.
    const auto other = std::find_if(reports.begin(), reports.end(), [&](const auto& r) { return r.first != incoming.peer; });
    const DataStats* reference = options.expected ? &*options.expected : other != reports.end() ? &other->second : nullptr;
    if (reference != nullptr) {
      if (const std::string differs = difference(*reference, sums); !differs.empty()) {
        const std::string whose = options.expected ? std::string("the aggregator's validation data") : other->first + "'s";
        refuse({wire::RejectCode::OUT_OF_RANGE, "statistics that do not match " + whose + ": " + differs});
        continue;
      }
    }
    emit({{"event", "stats_report"}, {"site", incoming.peer}, {"kind", sums.kind}, {"features", sums.features.size()},
          {"masked", private_mode}});
    reports[incoming.peer] = std::move(sums);
    const std::string waiting = missing_names(expected, reports);
    if (!waiting.empty()) {
      reply(incoming.routing_id, make_stats_waiting(options.member.federation, waiting));
      continue;
    }
    if (private_mode) {
      options.masked->open(expected, reports.begin()->second.features.size() * kStatsWordsPerFeature);
      session_open = true;
      reply(incoming.routing_id, make_stats_join(options.member.federation));
      continue;
    }
    std::vector<DataStats> parts;
    for (const std::string& name : expected) parts.push_back(reports.at(name));
    Result<DataStats> all = train::data::merge_data_stats(parts);
    if (!all.is_ok()) return all.status();  // checked pairwise above: not reachable with honest code
    FEDMESH_RETURN_IF_ERROR(conclude(std::move(*all)));
    reply(incoming.routing_id, protocol::OutgoingMessage::from_bytes(merged_message->bytes()));
  }
}

Result<DataStats> send_stats(const StatsSendOptions& options, const DataStats& mine, const StatsEventSink& emit) {
  Result<crypto::Membership> membership = load(options.member);
  if (!membership.is_ok()) return membership.status();
  const crypto::RosterEntry* aggregator = membership->roster.find(options.aggregator_name);
  if (aggregator == nullptr || aggregator->role != crypto::Role::kAggregator) {
    return invalid_argument("the roster has no aggregator named '" + options.aggregator_name + "'");
  }
  Result<std::unique_ptr<protocol::ClientSocket>> connected =
      protocol::ClientSocket::connect(options.aggregator, protocol::CurveKeys::from(membership->keys),
                                      aggregator->identity.box_public, protocol::TransportOptions{});
  if (!connected.is_ok()) return connected.status();
  protocol::ClientSocket& socket = **connected;
  const bool private_mode = static_cast<bool>(options.masked);
  std::vector<uint32_t> words;
  if (private_mode) {
    Result<std::vector<uint32_t>> encoded = encode_stats_words(mine);
    if (!encoded.is_ok()) return encoded.status();
    words = std::move(*encoded);
  }
  bool contributed = !private_mode;  // whether this site's sums are in the federation's
  const Clock::time_point deadline = Clock::now() + millis(options.timeout_seconds);
  Clock::time_point next_send{};
  std::string last_waiting;
  for (;;) {
    const Clock::time_point now = Clock::now();
    if (now >= deadline) {
      return unavailable("statistics: no merged statistics from the aggregator at " + options.aggregator + " after " +
                         std::to_string(static_cast<int64_t>(options.timeout_seconds)) + " s" +
                         (last_waiting.empty() ? std::string(" (is `fedmesh stats serve` running there?)")
                                               : " (still waiting for " + last_waiting + ")"));
    }
    if (now >= next_send) {
      (void)socket.send(make_stats_report(options.member.federation, mine, private_mode), std::chrono::milliseconds(200));
      next_send = now + millis(options.resend_seconds);
    }
    Result<std::optional<protocol::Incoming>> got = socket.receive(std::chrono::milliseconds(200));
    if (!got.is_ok()) return got.status();
    if (!got->has_value()) continue;
    std::unique_ptr<protocol::ParsedMessage> parsed;
    protocol::Rejection rejection;
    if (!protocol::parse_message((*got)->bytes, protocol::kDefaultMaxMessageBytes, (*got)->frame, parsed, rejection)) {
      return corrupt("statistics: the aggregator's reply does not parse: " + rejection.reason);
    }
    const auto root = parsed->root();
    if (root.which() == wire::Message::REJECT) {
      return invalid_argument("the aggregator refused this site's statistics (" +
                              std::string(protocol::reject_code_name(root.getReject().getCode())) +
                              "): " + root.getReject().getText().cStr());
    }
    if (root.which() != wire::Message::STATS_MERGED) continue;  // nothing else is asked for here
    const auto answer = root.getStatsMerged();
    if (answer.getParts() == 0 && answer.getJoin()) {
      if (!private_mode) return corrupt("statistics: the aggregator asks for masked sums; this site is in trusted mode");
      emit({{"event", "secure_join"}, {"words", words.size()}});
      Result<bool> in_sum = options.masked(socket, *membership, words);
      if (!in_sum.is_ok()) return in_sum.status();
      contributed = contributed || *in_sum;
      emit({{"event", "masked"}, {"contributed", *in_sum}});
      next_send = Clock::now();  // ask for the merged statistics now
      continue;
    }
    if (answer.getParts() == 0) {
      const std::string waiting = answer.getWaiting().cStr();
      if (waiting != last_waiting) emit({{"event", "waiting"}, {"for", waiting}});
      last_waiting = waiting;
      continue;
    }
    DataStats merged;
    if (!decode_feature_sums(answer.getFeatures(), answer.getKind().cStr(), merged, rejection)) {
      return corrupt("statistics: the aggregator's merged sums are unusable: " + rejection.reason);
    }
    merged.parts = answer.getParts();
    // The federation's sums must describe this site's features and, where
    // they hold this site's, at least its own values.
    if (const std::string differs = difference(mine, merged); !differs.empty()) {
      return invalid_argument("statistics: the merged sums do not describe this site's features: " + differs);
    }
    for (size_t i = 0; contributed && i < mine.features.size(); ++i) {
      if (merged.features[i].count < mine.features[i].count) {
        return corrupt("statistics: the merged sums count fewer values of '" + mine.features[i].name +
                       "' than this site alone holds");
      }
    }
    FEDMESH_RETURN_IF_ERROR(train::data::write_data_stats(merged, options.out));
    emit({{"event", "merged"}, {"parts", merged.parts}, {"digest", merged.digest()}, {"out", options.out},
          {"contributed", contributed}});
    return merged;
  }
}

}  // namespace fedmesh::federation
