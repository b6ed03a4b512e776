// A site's part in its round's secure aggregation (private mode), over the
// socket it already holds to the aggregator: join the round's session,
// then answer each phase the aggregator's SecAggDown shows (advertise keys,
// send encrypted shares, send the masked input in pieces, sign the
// survivors, reveal shares), polling while the others answer. The update is
// clipped to the session's L2 bound and quantized to fixed point here
// (crypto::quantize_clipped), then masked by crypto::SecAggClient: it never
// leaves the process in the clear.
//
// The client aborts (wiping its secrets) on anything inconsistent in what
// the aggregator sends (crypto/secure_aggregation.h lists the checks); a
// session the aggregator abandons for a new one is followed; the upload
// ends when the session is done (contributed or not), when the round has
// moved on, or after `give_up` without progress.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "crypto/keys.h"
#include "crypto/roster.h"
#include "crypto/secure_aggregation.h"
#include "protocol/transport.h"

namespace fedmesh::node {

struct SecureUploadOptions {
  std::chrono::milliseconds poll{100};
  std::chrono::milliseconds reply_timeout{5000};
  std::chrono::milliseconds give_up{120000};
  // Tests: raise SIGKILL on reaching this phase (before answering it).
  std::optional<crypto::SecAggPhase> exit_at;
  // Tests and audits: write the fixed-point input to this file before masking.
  std::string dump_input;
};

struct SecureUploadOutcome {
  bool contributed = false;  // the session finished with this site's input in the sum
  std::string session;       // the last session taken part in
  std::string reason;        // why not contributed
  int sessions = 0;          // sessions joined (a new one follows an aborted one)
  uint64_t words = 0;
};

using SecureEventSink = std::function<void(const nlohmann::json&)>;

Result<SecureUploadOutcome> secure_upload(protocol::ClientChannel& socket, const crypto::SiteKeys& keys,
                                          const crypto::Roster& roster, uint64_t round, uint64_t base_version,
                                          std::span<const float> delta, const SecureUploadOptions& options,
                                          const SecureEventSink& emit);

// The same part in a session that sums other fixed-point words (the
// federation's statistics, federation/stats_fixed_point.h): `words` as they
// are, the session's signatures bound to `label` instead of the federation's
// name, so that nothing signed here stands for a training round.
Result<SecureUploadOutcome> secure_upload_words(protocol::ClientChannel& socket, const crypto::SiteKeys& keys,
                                                const crypto::Roster& roster, const std::string& label, uint64_t round,
                                                uint64_t base_version, std::span<const uint32_t> words,
                                                const SecureUploadOptions& options, const SecureEventSink& emit);

}  // namespace fedmesh::node
