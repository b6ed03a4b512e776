#include "node/replica_sync.h"

#include <cmath>
#include <utility>

#include "gossip/catch_up.h"

namespace fedmesh::node {

namespace {

constexpr const char* kRole = "replica";
const char* const kPieceNames[3] = {"sum.high", "sum.middle", "sum.low"};
constexpr int64_t kLow = int64_t{1} << 21;

}  // namespace

void split_fixed_point(int64_t value, float pieces[3]) {
  pieces[0] = static_cast<float>(value >> 42);  // [-2^21, 2^21): exact
  pieces[1] = static_cast<float>((value >> 21) & (kLow - 1));
  pieces[2] = static_cast<float>(value & (kLow - 1));
}

int64_t join_fixed_point(const float pieces[3]) {
  const auto high = static_cast<uint64_t>(static_cast<int64_t>(pieces[0]));
  const auto middle = static_cast<uint64_t>(pieces[1]);
  const auto low = static_cast<uint64_t>(pieces[2]);
  return static_cast<int64_t>((high << 42) | (middle << 21) | low);
}

ReplicaSync::ReplicaSync(gossip::ReplicaState state, std::string self)
    : state_(std::move(state)), self_(std::move(self)) {}

Status ReplicaSync::make(uint64_t round, std::span<const std::vector<float>> trained) {
  Result<gossip::OwnUpdate> update = state_.make_update(trained);
  if (!update.is_ok()) return update.status();
  Result<bool> applied = state_.apply({self_, round}, update->decoded);
  if (!applied.is_ok()) {
    state_.take_back();
    return applied.status();
  }
  Own own;
  own.tensors = std::move(update->tensors);
  uint64_t flat = 0;
  for (const std::vector<float>& tensor : update->decoded) {
    for (size_t i = 0; i < tensor.size(); ++i, ++flat) {
      if (tensor[i] != 0.0f) {
        own.index.push_back(flat);
        own.value.push_back(tensor[i]);
      }
    }
  }
  own_[round] = std::move(own);
  return Status::ok();
}

const std::vector<protocol::EncodedTensor>* ReplicaSync::own(uint64_t round) const {
  const auto it = own_.find(round);
  return it == own_.end() ? nullptr : &it->second.tensors;
}

Result<bool> ReplicaSync::take(const std::string& sender, uint64_t round, std::span<const std::vector<float>> values) {
  return state_.apply({sender, round}, values);
}

std::vector<uint64_t> ReplicaSync::missing(const std::string& member, uint64_t member_version) const {
  std::vector<uint64_t> rounds;
  const uint64_t first = std::max(state_.floor(), member_version > kKeptRounds ? member_version - kKeptRounds : 0);
  for (uint64_t r = first; r < member_version; ++r) {
    if (!state_.applied({member, r})) rounds.push_back(r);
  }
  return rounds;
}

void ReplicaSync::advance(uint64_t version) {
  if (version <= kKeptRounds) return;
  const uint64_t floor = version - kKeptRounds;
  state_.forget_before(floor);
  while (!own_.empty() && own_.begin()->first < floor) own_.erase(own_.begin());
}

std::vector<uint64_t> ReplicaSync::own_rounds() const {
  std::vector<uint64_t> rounds;
  for (const auto& [round, own] : own_) rounds.push_back(round);
  return rounds;
}

void ReplicaSync::save(std::deque<Tensor>& views, std::vector<store::TensorToCommit>& out, nlohmann::json& state) const {
  const federation::ExactAccumulator::Saved sum = state_.saved_sum();
  for (auto& piece : pieces_) piece.resize(sum.sum.size());
  float parts[3];
  for (size_t i = 0; i < sum.sum.size(); ++i) {
    split_fixed_point(sum.sum[i], parts);
    for (int k = 0; k < 3; ++k) pieces_[k][i] = parts[k];
  }
  for (int k = 0; k < 3; ++k) {
    views.push_back(Tensor::view_of(pieces_[k].data(), Shape({static_cast<int64_t>(pieces_[k].size())}), DType::kF32));
    out.push_back({kRole, kPieceNames[k], &views.back()});
  }
  nlohmann::json applied = nlohmann::json::object();
  for (const gossip::UpdateId& id : state_.applied_ids()) applied[id.sender].push_back(id.round);
  nlohmann::json replica = {{"floor", state_.floor()}, {"applied", applied}, {"weight_raw", sum.weight},
                            {"bound_used", sum.bound_used}, {"updates", sum.updates}};
  own_pieces_.clear();
  nlohmann::json rounds = nlohmann::json::array();
  for (const auto& [round, own] : own_) {
    rounds.push_back(round);
    std::vector<float>& high = own_pieces_.emplace_back(own.index.size());
    std::vector<float>& low = own_pieces_.emplace_back(own.index.size());
    for (size_t k = 0; k < own.index.size(); ++k) {
      high[k] = static_cast<float>(own.index[k] >> 22);
      low[k] = static_cast<float>(own.index[k] & ((uint64_t{1} << 22) - 1));
    }
    const std::string prefix = "own." + std::to_string(round) + ".";
    const auto n = static_cast<int64_t>(own.index.size());
    views.push_back(Tensor::view_of(high.data(), Shape({n}), DType::kF32));
    out.push_back({kRole, prefix + "index.high", &views.back()});
    views.push_back(Tensor::view_of(low.data(), Shape({n}), DType::kF32));
    out.push_back({kRole, prefix + "index.low", &views.back()});
    views.push_back(Tensor::view_of(const_cast<float*>(own.value.data()), Shape({n}), DType::kF32));
    out.push_back({kRole, prefix + "value", &views.back()});
  }
  replica["own_rounds"] = std::move(rounds);
  state["replica"] = std::move(replica);
}

Status ReplicaSync::restore(const store::LoadedCheckpoint& checkpoint, const nlohmann::json& state) {
  if (!state.contains("replica")) return corrupt("the checkpoint has no replica state (written with another merge rule)");
  try {
    const nlohmann::json& replica = state.at("replica");
    federation::ExactAccumulator::Saved sum;
    sum.weight = replica.at("weight_raw").get<int64_t>();
    sum.bound_used = replica.at("bound_used").get<double>();
    sum.updates = replica.at("updates").get<int64_t>();
    const store::StoredTensor* pieces[3];
    for (int k = 0; k < 3; ++k) {
      pieces[k] = checkpoint.find(kRole, kPieceNames[k]);
      if (pieces[k] == nullptr || pieces[k]->value.dtype() != DType::kF32) {
        return corrupt(std::string("the checkpoint has no replica tensor ") + kPieceNames[k]);
      }
    }
    const int64_t n = pieces[0]->value.numel();
    if (pieces[1]->value.numel() != n || pieces[2]->value.numel() != n) return corrupt("the replica sum's pieces differ in length");
    sum.sum.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      float parts[3];
      for (int k = 0; k < 3; ++k) {
        parts[k] = pieces[k]->value.data<float>()[i];
        const bool whole = std::isfinite(parts[k]) && parts[k] == std::floor(parts[k]);
        const bool in_range = k == 0 ? std::fabs(parts[k]) <= kLow : (parts[k] >= 0.0f && parts[k] < kLow);
        if (!whole || !in_range) return corrupt("the replica sum holds a piece that is not a 21-bit integer");
      }
      sum.sum[static_cast<size_t>(i)] = join_fixed_point(parts);
    }
    std::set<gossip::UpdateId> applied;
    for (const auto& [sender, rounds] : replica.at("applied").items()) {
      for (const nlohmann::json& r : rounds) applied.insert({sender, r.get<uint64_t>()});
    }
    FEDMESH_RETURN_IF_ERROR(state_.restore(std::move(sum), std::move(applied), replica.at("floor").get<uint64_t>()));
    own_.clear();
    uint64_t elements = 0;
    for (const protocol::TensorShape& shape : state_.manifest()) elements += shape.element_count();
    for (const nlohmann::json& r : replica.at("own_rounds")) {
      const uint64_t round = r.get<uint64_t>();
      const std::string prefix = "own." + std::to_string(round) + ".";
      const store::StoredTensor* high = checkpoint.find(kRole, prefix + "index.high");
      const store::StoredTensor* low = checkpoint.find(kRole, prefix + "index.low");
      const store::StoredTensor* value = checkpoint.find(kRole, prefix + "value");
      if (high == nullptr || low == nullptr || value == nullptr || high->value.numel() != low->value.numel() ||
          high->value.numel() != value->value.numel()) {
        return corrupt("the checkpoint's own update of round " + std::to_string(round) + " is incomplete");
      }
      Own own;
      std::vector<std::vector<float>> dense, zeros;
      for (const protocol::TensorShape& shape : state_.manifest()) {
        dense.emplace_back(shape.element_count(), 0.0f);
        zeros.emplace_back(shape.element_count(), 0.0f);
      }
      for (int64_t k = 0; k < value->value.numel(); ++k) {
        const float h = high->value.data<float>()[k], l = low->value.data<float>()[k], v = value->value.data<float>()[k];
        if (!(h >= 0.0f && h < 4194304.0f && h == std::floor(h) && l >= 0.0f && l < 4194304.0f && l == std::floor(l)) ||
            !std::isfinite(v)) {
          return corrupt("the checkpoint's own update of round " + std::to_string(round) + " holds a bad entry");
        }
        const uint64_t flat = (static_cast<uint64_t>(h) << 22) | static_cast<uint64_t>(l);
        if (flat >= elements) return corrupt("the checkpoint's own update has an index past the model");
        own.index.push_back(flat);
        own.value.push_back(v);
        uint64_t rest = flat;
        size_t t = 0;
        while (rest >= dense[t].size()) rest -= dense[t++].size();
        dense[t][rest] = v;
      }
      // Sent again as its exact values, sparse (what every member adds).
      Result<std::vector<protocol::EncodedTensor>> encoded =
          gossip::encode_catch_up_slice(state_.manifest(), dense, zeros, 0, 1, state_.max_segment_bytes());
      if (!encoded.is_ok()) return encoded.status();
      own.tensors = std::move(*encoded);
      own_[round] = std::move(own);
    }
  } catch (const nlohmann::json::exception& error) {
    return corrupt(std::string("the replica state is malformed: ") + error.what());
  }
  return Status::ok();
}

}  // namespace fedmesh::node
