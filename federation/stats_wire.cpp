#include "federation/stats_wire.h"

#include <capnp/message.h>

#include <cmath>
#include <cstdint>

namespace fedmesh::federation {

namespace {

using train::data::DataStats;
using train::data::FeatureSums;

void fill_features(capnp::List<wire::FeatureSum>::Builder out, const DataStats& stats, bool names_only = false) {
  for (size_t i = 0; i < stats.features.size(); ++i) {
    const FeatureSums& f = stats.features[i];
    auto b = out[static_cast<unsigned>(i)];
    b.setName(f.name);
    if (names_only) continue;
    b.setCount(static_cast<uint64_t>(f.count));
    b.setSum(f.sum);
    b.setSumSquares(f.sum_squares);
  }
}

}  // namespace

bool decode_feature_sums(capnp::List<wire::FeatureSum>::Reader features, const std::string& kind, DataStats& out,
                         protocol::Rejection& rejection, bool names_only) {
  const auto refuse = [&](wire::RejectCode code, const std::string& why) {
    rejection = {code, "statistics: " + why};
    return false;
  };
  if (kind != "table" && kind != "images") return refuse(wire::RejectCode::MALFORMED, "kind is neither table nor images");
  if (features.size() == 0 || features.size() > kMaxStatsFeatures) {
    return refuse(wire::RejectCode::MALFORMED, std::to_string(features.size()) + " features (1 to " +
                                                   std::to_string(kMaxStatsFeatures) + " are taken)");
  }
  out = DataStats{};
  out.kind = kind;
  out.parts = 1;
  for (unsigned i = 0; i < features.size(); ++i) {
    const auto f = features[i];
    if (f.getName().size() > protocol::kMaxTextBytes) {
      return refuse(wire::RejectCode::MALFORMED, "feature " + std::to_string(i + 1) + "'s name is over " +
                                                     std::to_string(protocol::kMaxTextBytes) + " bytes");
    }
    if (names_only) {
      out.features.push_back({std::string(f.getName().cStr(), f.getName().size()), 0, 0.0, 0.0});
      continue;
    }
    FeatureSums sums{std::string(f.getName().cStr(), f.getName().size()), static_cast<int64_t>(f.getCount()),
                     f.getSum(), f.getSumSquares()};
    if (f.getCount() < 1 || f.getCount() > (uint64_t{1} << 62)) {
      return refuse(wire::RejectCode::OUT_OF_RANGE, "feature " + std::to_string(i + 1) + " counts " +
                                                        std::to_string(f.getCount()) + " values");
    }
    if (!std::isfinite(sums.sum) || !std::isfinite(sums.sum_squares)) {
      return refuse(wire::RejectCode::NON_FINITE, "feature " + std::to_string(i + 1) + " has a sum that is not finite");
    }
    if (sums.sum_squares < 0.0) {
      return refuse(wire::RejectCode::OUT_OF_RANGE, "feature " + std::to_string(i + 1) + " has a negative sum of squares");
    }
    out.features.push_back(std::move(sums));
  }
  return true;
}

protocol::OutgoingMessage make_stats_report(const std::string& federation, const DataStats& stats, bool masked) {
  capnp::MallocMessageBuilder builder;
  auto report = builder.initRoot<wire::Message>().initStatsReport();
  report.setFederation(federation);
  report.setKind(stats.kind);
  report.setMasked(masked);
  fill_features(report.initFeatures(static_cast<unsigned>(stats.features.size())), stats, masked);
  return protocol::serialize(builder);
}

protocol::OutgoingMessage make_stats_merged(const std::string& federation, const DataStats& merged) {
  capnp::MallocMessageBuilder builder;
  auto out = builder.initRoot<wire::Message>().initStatsMerged();
  out.setFederation(federation);
  out.setKind(merged.kind);
  out.setParts(static_cast<uint32_t>(merged.parts));
  fill_features(out.initFeatures(static_cast<unsigned>(merged.features.size())), merged);
  return protocol::serialize(builder);
}

protocol::OutgoingMessage make_stats_waiting(const std::string& federation, const std::string& waiting) {
  capnp::MallocMessageBuilder builder;
  auto out = builder.initRoot<wire::Message>().initStatsMerged();
  out.setFederation(federation);
  out.setParts(0);
  out.setWaiting(waiting.substr(0, protocol::kMaxTextBytes));
  return protocol::serialize(builder);
}

protocol::OutgoingMessage make_stats_join(const std::string& federation) {
  capnp::MallocMessageBuilder builder;
  auto out = builder.initRoot<wire::Message>().initStatsMerged();
  out.setFederation(federation);
  out.setParts(0);
  out.setJoin(true);
  return protocol::serialize(builder);
}

}  // namespace fedmesh::federation
