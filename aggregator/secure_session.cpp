#include "aggregator/secure_session.h"

#include <algorithm>

#include "protocol/secagg_wire.h"
#include "protocol/update_transfer.h"

namespace fedmesh::aggregator {

using crypto::SecAggPhase;

Result<SecureSessionOutcome> run_secure_session(const crypto::Roster& roster, const crypto::SecAggParams& params,
                                                std::vector<VirtualSecureSite> sites,
                                                const std::map<std::string, SecAggPhase>& dropped_at) {
  std::sort(sites.begin(), sites.end(),
            [](const VirtualSecureSite& a, const VirtualSecureSite& b) { return a.keys->identity.name < b.keys->identity.name; });
  std::vector<std::string> names;
  for (const VirtualSecureSite& s : sites) names.push_back(s.keys->identity.name);
  Result<crypto::SecAggServer> created = crypto::SecAggServer::create(params, roster, names);
  if (!created.is_ok()) return created.status();
  crypto::SecAggServer& server = *created;
  std::vector<crypto::SecAggClient> clients;
  for (const VirtualSecureSite& s : sites) {
    Result<crypto::SecAggClient> client = crypto::SecAggClient::start(params, *s.keys, roster, sites.size());
    if (!client.is_ok()) return client.status();
    clients.push_back(std::move(*client));
  }
  SecureSessionOutcome outcome;
  const auto up = [&](protocol::SecAggUpMessage m, std::span<const uint32_t> words = {}) {
    m.round = params.round;
    m.session = params.session;
    outcome.bytes_up += protocol::curve_message_bytes(protocol::encode_secagg_up(m, words).size());
  };
  const auto down = [&](const std::string& site) {
    outcome.bytes_down += protocol::curve_message_bytes(protocol::encode_secagg_down(secagg_view(server, site)).size());
  };
  const auto answers = [&](size_t i) {
    const auto it = dropped_at.find(names[i]);
    return server.member(names[i]) && (it == dropped_at.end() || server.phase() < it->second);
  };
  using Kind = protocol::SecAggUpMessage::Kind;
  for (size_t i = 0; i < sites.size(); ++i) {
    if (!answers(i)) continue;
    protocol::SecAggUpMessage m;
    m.kind = Kind::kAdvertise;
    Result<crypto::SecAggAdvertisement> ad = clients[i].advertise();
    if (!ad.is_ok()) return ad.status();
    m.advertisement = *ad;
    up(m);
    FEDMESH_RETURN_IF_ERROR(server.advertise(names[i], std::move(*ad)));
  }
  server.advance();
  for (size_t i = 0; i < sites.size() && server.phase() == SecAggPhase::kShareKeys; ++i) {
    if (!answers(i)) continue;
    down(names[i]);
    Result<std::vector<crypto::SecAggShareCipher>> shares = clients[i].share_keys(server.advertisements());
    if (!shares.is_ok()) return shares.status();
    protocol::SecAggUpMessage m;
    m.kind = Kind::kShares;
    m.shares = *shares;
    up(m);
    FEDMESH_RETURN_IF_ERROR(server.share_keys(names[i], std::move(*shares)));
  }
  server.advance();
  for (size_t i = 0; i < sites.size() && server.phase() == SecAggPhase::kMaskedInput; ++i) {
    if (!answers(i)) continue;
    down(names[i]);
    Result<std::vector<uint32_t>> masked = clients[i].masked_input(server.shares_for(names[i]), std::move(sites[i].input));
    if (!masked.is_ok()) return masked.status();
    for (size_t at = 0; at < masked->size(); at += protocol::kSecAggWordsPerMessage) {
      const size_t count = std::min(protocol::kSecAggWordsPerMessage, masked->size() - at);
      protocol::SecAggUpMessage m;
      m.kind = Kind::kMasked;
      m.offset = at;
      up(m, std::span<const uint32_t>(*masked).subspan(at, count));
    }
    FEDMESH_RETURN_IF_ERROR(server.masked_input(names[i], 0, *masked));
  }
  server.advance();
  for (size_t i = 0; i < sites.size() && server.phase() == SecAggPhase::kConsistency; ++i) {
    if (!answers(i)) continue;
    down(names[i]);
    Result<crypto::Signature> signature = clients[i].consistency(server.alive());
    if (!signature.is_ok()) return signature.status();
    protocol::SecAggUpMessage m;
    m.kind = Kind::kConsistency;
    m.signature = *signature;
    up(m);
    FEDMESH_RETURN_IF_ERROR(server.consistency(names[i], *signature));
  }
  server.advance();
  for (size_t i = 0; i < sites.size() && server.phase() == SecAggPhase::kUnmask; ++i) {
    if (!answers(i)) continue;
    down(names[i]);
    Result<std::vector<crypto::SecAggReveal>> reveals = clients[i].unmask(server.unmask_request());
    if (!reveals.is_ok()) return reveals.status();
    protocol::SecAggUpMessage m;
    m.kind = Kind::kReveals;
    m.reveals = *reveals;
    up(m);
    FEDMESH_RETURN_IF_ERROR(server.unmask(names[i], std::move(*reveals)));
  }
  server.advance();
  if (server.phase() != SecAggPhase::kDone) {
    outcome.reason = server.abort_reason();
    return outcome;
  }
  outcome.done = true;
  outcome.result.round = static_cast<int64_t>(params.round);
  outcome.result.session = params.session;
  outcome.result.contributors = server.alive();
  outcome.result.sum = server.sum();
  return outcome;
}

}  // namespace fedmesh::aggregator
