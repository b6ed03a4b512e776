// What secure aggregation (private mode) adds to a round, next to the same
// round in trusted mode, for n sites and d parameters (default: n in {10,
// 50}, d in {1M, 10M}), all measured on this machine in this run:
//
//   site        one site's extra work: clip and quantize, the X25519 keys and
//               signature, Shamir shares encrypted to n peers, the masked
//               input (a self mask and n - 1 pairwise masks, ChaCha20 over
//               d words each), the consistency signature, the unmasking
//               shares. Sites run in parallel on their own machines: this is
//               what one of them adds to the round's critical path.
//   aggregator  the server's work: n advertisements and share lists, the
//               sum of n masked inputs, the unmasking (n self masks, and
//               with one site dropped after sharing keys its n - 1 pairwise
//               masks) minus what trusted mode does anyway with n updates
//               (the exact accumulator's fold).
//   trusted     the same round in trusted mode: the site encodes, hashes and
//               signs its update (prepare_update, dense fp32, 4 MiB chunks);
//               the aggregator checks n of them (UpdateReceiver: signature,
//               chunk hashes, parse, decode) and folds them (exact accumulator).
//   train       what both modes share: one site's 50 local steps (batch 32)
//               of an MLP of d parameters (784-h-h-10), this build's trainer,
//               one core. Bytes on the wire are the same in both modes (d
//               32-bit words up), so the network is left out of both.
//
// A round's critical path is train + site + aggregator; overhead is private
// over trusted, minus one. One thread throughout.
// The target: under 20% at 10 sites x 10M. A plain program; see --help.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <tuple>
#include <string>
#include <vector>

#include "federation/exact_accumulator.h"
#include "aggregator/secure_round.h"
#include "base/random.h"
#include "crypto/keys.h"
#include "crypto/roster.h"
#include "crypto/secure_aggregation.h"
#include "kernels/parallel.h"
#include "train/data/dataset.h"
#include "train/layers/layers.h"
#include "train/model.h"
#include "node/secure_upload.h"
#include "train/trainer.h"
#include "protocol/secagg_wire.h"
#include "protocol/update_transfer.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace fc = fedmesh::crypto;

double since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

struct Parts {
  double site = 0.0, site_trusted = 0.0, aggregator_secure = 0.0, aggregator_trusted = 0.0, train = 0.0;
};

// One session of n sites over d words; returns the site's and the
// aggregator's seconds (the site's measured on site 0, all sites doing the same).
void time_session(int n, int64_t d, bool one_dropout, Parts& parts) {
  fc::Roster roster;
  roster.federation = "bench";
  std::vector<fc::SiteKeys> keys;
  std::vector<std::string> names;
  for (int i = 0; i < n; ++i) {
    char name[32];
    std::snprintf(name, sizeof name, "site-%03d", i);
    names.emplace_back(name);
    keys.push_back(fc::generate_site_keys(name).value());
    roster.sites.push_back({keys.back().identity, fc::Role::kSite, ""});
  }
  const fc::SecAggParams params{"bench", 1, "r1-bench", fc::secagg_min_threshold(static_cast<size_t>(n)),
                                static_cast<uint64_t>(d)};
  fedmesh::Rng rng(3);
  std::vector<float> delta(static_cast<size_t>(d));
  for (float& v : delta) v = static_cast<float>(rng.normal() * 1e-3);

  double site = 0.0, server = 0.0;
  fc::SecAggServer agg = fc::SecAggServer::create(params, roster, names).value();
  std::vector<fc::SecAggClient> clients;
  auto t = Clock::now();
  for (int i = 0; i < n; ++i) {
    clients.push_back(fc::SecAggClient::start(params, keys[static_cast<size_t>(i)], roster, static_cast<size_t>(n)).value());
  }
  site += since(t) / n;
  for (int i = 0; i < n; ++i) {
    t = Clock::now();
    fc::SecAggAdvertisement ad = clients[static_cast<size_t>(i)].advertise().value();
    if (i == 0) site += since(t);
    t = Clock::now();
    (void)agg.advertise(names[static_cast<size_t>(i)], ad);
    server += since(t);
  }
  agg.advance();
  for (int i = 0; i < n; ++i) {
    t = Clock::now();
    std::vector<fc::SecAggShareCipher> shares = clients[static_cast<size_t>(i)].share_keys(agg.advertisements()).value();
    if (i == 0) site += since(t);
    t = Clock::now();
    (void)agg.share_keys(names[static_cast<size_t>(i)], std::move(shares));
    server += since(t);
  }
  agg.advance();
  // Site 0 does the full work; the others' masked inputs are timed only at
  // the server. Both sides pay for the wire: SecAggUp pieces of 2 MiB
  // encoded by the site, parsed and decoded by the aggregator.
  for (int i = 0; i < n; ++i) {
    if (one_dropout && i == n - 1) continue;  // dropped after sharing its keys
    t = Clock::now();
    std::vector<uint32_t> input = fc::quantize_clipped(delta, 1.0f, 16);
    std::vector<uint32_t> masked =
        clients[static_cast<size_t>(i)].masked_input(agg.shares_for(names[static_cast<size_t>(i)]), std::move(input)).value();
    std::vector<fedmesh::protocol::OutgoingMessage> pieces;
    for (size_t at = 0; at < masked.size(); at += fedmesh::protocol::kSecAggWordsPerMessage) {
      fedmesh::protocol::SecAggUpMessage up;
      up.kind = fedmesh::protocol::SecAggUpMessage::Kind::kMasked;
      up.round = 1;
      up.session = params.session;
      up.offset = at;
      const size_t count = std::min(fedmesh::protocol::kSecAggWordsPerMessage, masked.size() - at);
      pieces.push_back(fedmesh::protocol::encode_secagg_up(up, std::span<const uint32_t>(masked).subspan(at, count)));
    }
    if (i == 0) site += since(t);
    t = Clock::now();
    for (const fedmesh::protocol::OutgoingMessage& piece : pieces) {
      std::unique_ptr<fedmesh::protocol::ParsedMessage> parsed;
      fedmesh::protocol::Rejection rejection;
      fedmesh::protocol::SecAggUpMessage up;
      // As the aggregator does with a received frame: parsed in place (the frame outlives the parse).
      const std::shared_ptr<const void> frame(&piece, [](const void*) {});
      if (!fedmesh::protocol::parse_message(piece.bytes(), fedmesh::protocol::kDefaultMaxMessageBytes, frame, parsed,
                                            rejection) ||
          !fedmesh::protocol::decode_secagg_up(parsed->root().getSecAggUp(), up, rejection)) {
        std::fprintf(stderr, "bench_secure_aggregation: a masked piece does not decode: %s\n", rejection.reason.c_str());
        std::exit(1);
      }
      (void)agg.masked_input(names[static_cast<size_t>(i)], up.offset, up.words);
    }
    server += since(t);
  }
  t = Clock::now();
  agg.advance();
  server += since(t);
  for (int i = 0; i < n; ++i) {
    if (!agg.member(names[static_cast<size_t>(i)])) continue;
    t = Clock::now();
    const fc::Signature sig = clients[static_cast<size_t>(i)].consistency(agg.alive()).value();
    if (i == 0) site += since(t);
    t = Clock::now();
    (void)agg.consistency(names[static_cast<size_t>(i)], sig);
    server += since(t);
  }
  agg.advance();
  for (int i = 0; i < n; ++i) {
    if (!agg.member(names[static_cast<size_t>(i)])) continue;
    t = Clock::now();
    std::vector<fc::SecAggReveal> reveals = clients[static_cast<size_t>(i)].unmask(agg.unmask_request()).value();
    if (i == 0) site += since(t);
    t = Clock::now();
    (void)agg.unmask(names[static_cast<size_t>(i)], std::move(reveals));
    server += since(t);
  }
  t = Clock::now();
  agg.advance();
  server += since(t);
  if (agg.phase() != fc::SecAggPhase::kDone) {
    std::fprintf(stderr, "bench_secure_aggregation: the session did not finish: %s\n", agg.abort_reason().c_str());
    std::exit(1);
  }
  // Decoding the mean, as the aggregator does after the sum.
  t = Clock::now();
  fedmesh::aggregator::SecureResult result;
  result.contributors = agg.alive();
  result.sum = agg.sum();
  const std::vector<float> mean = result.mean(16);
  server += since(t);
  parts.site = site;
  parts.aggregator_secure = server;
}

// Trusted mode's per-round work on updates: one site encodes, hashes and
// signs its update (prepare_update: dense fp32, 4 MiB chunks); the
// aggregator takes n of them through UpdateReceiver (header signature,
// every chunk's hash, parse, decode) and folds them into the exact
// accumulator. Returns the site's and the aggregator's seconds.
std::pair<double, double> time_trusted(int n, int64_t d) {
  namespace fp = fedmesh::protocol;
  fedmesh::Rng rng(5);
  std::vector<float> update(static_cast<size_t>(d));
  for (float& v : update) v = static_cast<float>(rng.normal() * 1e-3);
  const std::vector<fp::TensorShape> manifest = {{"w", {d}}};
  const std::vector<std::span<const float>> tensors = {update};
  const std::vector<fp::TensorPlan> plans = {fp::TensorPlan{}};
  fc::Roster roster;
  roster.federation = "bench";
  std::vector<fc::SiteKeys> keys;
  for (int i = 0; i < n; ++i) {
    keys.push_back(fc::generate_site_keys("site-" + std::to_string(i)).value());
    roster.sites.push_back({keys.back().identity, fc::Role::kSite, ""});
  }
  fc::ReplayGuard replay = fc::ReplayGuard::in_memory();
  fp::ReceiverPolicy policy;
  policy.federation = "bench";
  policy.self = "aggregator";
  policy.manifest = manifest;
  policy.current_round = 1;
  policy.current_version = 0;
  fp::UpdateReceiver receiver(policy, roster, replay);
  fedmesh::federation::ExactAccumulator accumulator(d);
  double site = 0.0, server = 0.0;
  for (int i = 0; i < n; ++i) {
    fc::UpdateMetadata metadata;
    metadata.federation = "bench";
    metadata.round = 1;
    metadata.sender = "site-" + std::to_string(i);
    metadata.recipient = "aggregator";
    metadata.sequence = 1;
    metadata.sample_count = 100;
    auto t = Clock::now();
    fedmesh::Result<fp::PreparedUpdate> prepared =
        fp::prepare_update(metadata, manifest, tensors, plans, keys[static_cast<size_t>(i)]);
    if (i == 0) site = since(t);
    t = Clock::now();
    std::unique_ptr<fp::ParsedMessage> parsed;
    fp::Rejection rejection;
    (void)fp::parse_message(prepared->header.bytes(), fp::kDefaultMaxMessageBytes, prepared->header.shared(), parsed,
                            rejection);
    (void)receiver.handle_header(metadata.sender, *parsed);
    for (const fp::SharedMessage& chunk : prepared->chunks) {
      fp::Envelope envelope;
      (void)fp::read_envelope(chunk.bytes(), fp::kDefaultMaxMessageBytes, envelope, rejection);
      (void)receiver.handle_chunk(metadata.sender, envelope, chunk.bytes(), chunk.shared());
    }
    for (fp::ReceivedUpdate& received : receiver.take_completed()) (void)accumulator.add(received.tensors[0], 1.0);
    server += since(t);
  }
  auto t = Clock::now();
  std::vector<float> mean(static_cast<size_t>(d));
  accumulator.mean(mean);
  server += since(t);
  if (accumulator.updates() != n) {
    std::fprintf(stderr, "bench_secure_aggregation: the trusted path took %lld of %d updates\n",
                 static_cast<long long>(accumulator.updates()), n);
    std::exit(1);
  }
  return {site, server};
}

// 50 local steps, batch 32, of a 784-h-h-10 MLP with about d parameters.
double time_local_training(int64_t d, int64_t& parameters) {
  // 784 h + h^2 + 10 h (+ biases) = d
  const double b = 794.0;
  const auto h = static_cast<int64_t>((-b + std::sqrt(b * b + 4.0 * static_cast<double>(d))) / 2.0);
  fedmesh::Rng rng(11);
  auto model = std::make_unique<fedmesh::train::Sequential>("bench-mlp", fedmesh::Shape{1, 28, 28});
  model->add(std::make_unique<fedmesh::train::Flatten>());
  const int64_t widths[4] = {784, h, h, 10};
  for (int l = 0; l < 3; ++l) {
    auto layer = std::make_unique<fedmesh::train::Linear>("fc" + std::to_string(l + 1), widths[l], widths[l + 1]);
    layer->initialize(rng);
    model->add(std::move(layer));
    if (l < 2) model->add(std::make_unique<fedmesh::train::ReLU>());
  }
  parameters = 0;
  for (fedmesh::Parameter* p : model->parameters()) parameters += p->value.numel();
  fedmesh::train::data::ImageDataset images;
  images.count = 1024;
  images.rows = images.cols = 28;
  images.pixels.resize(static_cast<size_t>(images.count * 784));
  images.labels.resize(static_cast<size_t>(images.count));
  for (auto& p : images.pixels) p = static_cast<uint8_t>(rng.next_u64());
  for (auto& l : images.labels) l = static_cast<uint8_t>(rng.next_u64() % 10);
  const fedmesh::train::data::ImageSet set(std::move(images));
  fedmesh::train::TrainOptions options;
  options.batch_size = 32;
  options.max_steps = 50;
  options.epochs = 2;
  fedmesh::train::Trainer trainer(*model, options);
  const auto t = Clock::now();
  (void)trainer.fit(set, nullptr, {});
  return since(t);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> site_counts = {10, 50};
  std::vector<int64_t> sizes = {1'000'000, 10'000'000};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--sites" && i + 1 < argc) {
      site_counts = {std::atoi(argv[++i])};
    } else if (arg == "--params" && i + 1 < argc) {
      sizes = {std::atoll(argv[++i])};
    } else {
      std::printf("usage: bench_secure_aggregation [--sites N] [--params D]\n"
                  "Secure aggregation's added time per round against the trusted round (50 local steps of an MLP "
                  "of D parameters + the aggregator's fold), for N in {10, 50} and D in {1M, 10M} by default.\n");
      return arg == "--help" ? 0 : 2;
    }
  }
  fedmesh::set_cpu_threads(1);
  std::printf("%-6s %-10s %9s %9s %10s %10s %9s %10s %10s %9s\n", "sites", "params", "site tr s", "site sa s",
              "agg tr s", "agg sa s", "train s", "trusted s", "private s", "overhead");
  for (int64_t d : sizes) {
    int64_t parameters = 0;
    const double train = time_local_training(d, parameters);
    for (int n : site_counts) {
      for (bool dropout : {false, true}) {
        Parts parts;
        time_session(n, d, dropout, parts);
        std::tie(parts.site_trusted, parts.aggregator_trusted) = time_trusted(n, d);
        parts.train = train;
        // The critical path of a round: a site's training and sending, then the aggregator's work.
        const double trusted = train + parts.site_trusted + parts.aggregator_trusted;
        const double secure = train + parts.site + parts.aggregator_secure;
        std::printf("%-6d %-10lld %9.3f %9.3f %10.3f %10.3f %9.3f %10.3f %10.3f %8.1f%%%s\n", n,
                    static_cast<long long>(d), parts.site_trusted, parts.site, parts.aggregator_trusted,
                    parts.aggregator_secure, train, trusted, secure, 100.0 * (secure - trusted) / trusted,
                    dropout ? "  (1 dropout)" : "");
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
