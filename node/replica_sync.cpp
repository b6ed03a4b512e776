#include "node/replica_sync.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <set>
#include <utility>

#include "node/own_update_bytes.h"
#include "protocol/codec.h"

namespace fedmesh::node {

namespace {

constexpr const char* kRole = "replica";
// The exact sum: since this format, its raw 64-bit values as they lie in
// memory (little-endian), viewed as twice as many fp32 words (the store
// keeps bits, not numbers: these are not floats). Before it, three fp32
// tensors of 22, 21 and 21 bits each, still read.
constexpr const char* kRawSumName = "sum.fixed64";
const char* const kPieceNames[3] = {"sum.high", "sum.middle", "sum.low"};
constexpr int64_t kLow = int64_t{1} << 21;
constexpr const char* kOwnIdPrefix = "replica.own.";

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

ReplicaSync::ReplicaSync(gossip::ReplicaState state, std::string self, Clock& clock)
    : state_(std::move(state)), self_(std::move(self)), clock_(&clock) {}

Status ReplicaSync::make(uint64_t round, std::vector<std::vector<float>> trained) {
  Result<gossip::OwnUpdate> update = state_.make_update(std::move(trained));
  if (!update.is_ok()) return update.status();
  Result<bool> applied = state_.apply({self_, round}, update->decoded);
  if (!applied.is_ok()) {
    state_.take_back();
    return applied.status();
  }
  // In the sum now: nothing will be taken back, so the compressor's input
  // (a model's size) is not kept until the next round.
  state_.compressor().release_buffers();
  Own own;
  own.tensors = std::move(update->tensors);
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
  while (!own_.empty() && own_.begin()->first < floor) {
    if (!own_.begin()->second.pending_id.empty()) retired_.push_back(own_.begin()->second.pending_id);
    own_.erase(own_.begin());
  }
}

Status ReplicaSync::persist(uint64_t round, store::CheckpointStore& store) {
  const auto it = own_.find(round);
  if (it == own_.end()) return invalid_argument("no own update of round " + std::to_string(round) + " to persist");
  Own& own = it->second;
  // Unique per making: a round made again after a crash before its commit
  // gets a new id, and the stray one is retired at the next commit.
  static std::atomic<uint64_t> made{0};
  const std::string id = std::string(kOwnIdPrefix) + std::to_string(round) + "." + std::to_string(clock_->unix_micros()) + "." +
                         std::to_string(made.fetch_add(1));
  // As it was sent (its encoded segments): what a restarted peer sends
  // again, byte for byte, and no more bytes than the update itself.
  const std::vector<uint8_t> payload = encode_own_segments(round, own.tensors);
  store::PendingUpdate entry;
  entry.update_id.assign(id.begin(), id.end());
  entry.sender = self_;
  entry.base_version = static_cast<int64_t>(round);
  FEDMESH_RETURN_IF_ERROR(store.add_pending_update(entry, payload));
  own.pending_id = id;
  return Status::ok();
}

void ReplicaSync::committed() {
  retired_.erase(retired_.begin(), retired_.begin() + static_cast<std::ptrdiff_t>(std::min(retiring_, retired_.size())));
  retiring_ = 0;
}

Result<ReplicaSync::Own> ReplicaSync::own_from(uint64_t round, std::vector<uint64_t> index, std::vector<float> value) const {
  uint64_t elements = 0;
  for (const protocol::TensorShape& shape : state_.manifest()) elements += shape.element_count();
  if (index.size() != value.size()) return corrupt("the own update of round " + std::to_string(round) + " is ragged");
  for (size_t k = 0; k < index.size(); ++k) {
    if (index[k] >= elements || !std::isfinite(value[k]) || (k > 0 && index[k] <= index[k - 1])) {
      return corrupt("the own update of round " + std::to_string(round) + " holds a bad entry");
    }
  }
  // Sent again as its exact values, sparse (what every member adds): each
  // tensor's coordinates and values, nothing else (not a model-sized
  // slice of mostly zeros).
  Own own;
  size_t k = 0;
  uint64_t offset = 0;
  for (size_t t = 0; t < state_.manifest().size(); ++t) {
    const protocol::TensorShape& shape = state_.manifest()[t];
    const uint64_t count = shape.element_count();
    std::vector<uint64_t> local;
    const size_t first = k;
    for (; k < index.size() && index[k] < offset + count; ++k) local.push_back(index[k] - offset);
    const std::span<const float> values(value.data() + first, k - first);
    const protocol::SparseIndexCost cost = protocol::sparse_index_cost(local, count);
    const protocol::Encoding encoding = protocol::sparse_with_bitmap(protocol::Encoding::kSparseF32, cost.bitmap_smaller());
    Result<std::vector<protocol::EncodedSegment>> segments =
        protocol::encode_sparse(static_cast<uint32_t>(t), count, local, values, encoding, state_.max_segment_bytes());
    if (!segments.is_ok()) return segments.status();
    protocol::EncodedTensor tensor;
    tensor.descriptor = {shape.name, shape.dims, encoding, 0};
    tensor.segments = std::move(*segments);
    own.tensors.push_back(std::move(tensor));
    offset += count;
  }
  return own;
}

std::vector<uint64_t> ReplicaSync::own_rounds() const {
  std::vector<uint64_t> rounds;
  for (const auto& [round, own] : own_) rounds.push_back(round);
  return rounds;
}

void ReplicaSync::save(std::deque<Tensor>& views, std::vector<store::TensorToCommit>& out, nlohmann::json& state,
                       std::vector<store::AppliedUpdate>& retire) const {
  // The sum's own memory, viewed (no copy): the commit reads it while the
  // peer waits for the commit, so it does not change under the store.
  const federation::ExactAccumulator::Saved sum = state_.saved_counters();
  const std::span<const int64_t> raw = state_.raw_sum();
  views.push_back(Tensor::view_of(const_cast<int64_t*>(raw.data()), Shape({static_cast<int64_t>(raw.size() * 2)}),
                                  DType::kF32));
  out.push_back({kRole, kRawSumName, &views.back()});
  nlohmann::json applied = nlohmann::json::object();
  for (const gossip::UpdateId& id : state_.applied_ids()) applied[id.sender].push_back(id.round);
  nlohmann::json replica = {{"floor", state_.floor()}, {"applied", applied}, {"weight_raw", sum.weight},
                            {"bound_used", sum.bound_used}, {"updates", sum.updates}};
  // Own updates by their pending ids (one not yet persisted is not named:
  // after a restart it cannot be sent again).
  nlohmann::json own = nlohmann::json::object();
  for (const auto& [round, kept] : own_) {
    if (!kept.pending_id.empty()) own[std::to_string(round)] = kept.pending_id;
  }
  replica["own_pending"] = std::move(own);
  state["replica"] = std::move(replica);
  for (const std::string& id : retired_) retire.push_back({std::vector<uint8_t>(id.begin(), id.end()), self_, 0});
  retiring_ = retired_.size();
}

namespace {

// The checkpoint's exact sum (either format) into sum.sum, checked: n
// values, each within the bound the sum says it used.
Status read_sum(const store::LoadedCheckpoint& checkpoint, size_t n, federation::ExactAccumulator::Saved& sum) {
  if (const store::StoredTensor* raw = checkpoint.find(kRole, kRawSumName); raw != nullptr) {
    if (raw->value.dtype() != DType::kF32 || raw->value.numel() % 2 != 0) {
      return corrupt(std::string("the checkpoint's replica tensor ") + kRawSumName + " is not 64-bit words");
    }
    sum.sum.resize(static_cast<size_t>(raw->value.numel() / 2));
    std::memcpy(sum.sum.data(), raw->value.raw(), sum.sum.size() * sizeof(int64_t));
  } else {
    const store::StoredTensor* pieces[3];
    for (int k = 0; k < 3; ++k) {
      pieces[k] = checkpoint.find(kRole, kPieceNames[k]);
      if (pieces[k] == nullptr || pieces[k]->value.dtype() != DType::kF32) {
        return corrupt(std::string("the checkpoint has no replica tensor ") + kRawSumName + " (nor " + kPieceNames[k] +
                       " of the earlier format)");
      }
    }
    const int64_t count = pieces[0]->value.numel();
    if (pieces[1]->value.numel() != count || pieces[2]->value.numel() != count) {
      return corrupt("the replica sum's pieces differ in length");
    }
    sum.sum.resize(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) {
      float parts[3];
      for (int k = 0; k < 3; ++k) {
        parts[k] = pieces[k]->value.data<float>()[i];
        const bool whole = std::isfinite(parts[k]) && parts[k] == std::floor(parts[k]);
        const bool in_range = k == 0 ? std::fabs(parts[k]) <= kLow : (parts[k] >= 0.0f && parts[k] < kLow);
        if (!whole || !in_range) return corrupt("the replica sum holds a piece that is not a 21-bit integer");
      }
      sum.sum[static_cast<size_t>(i)] = join_fixed_point(parts);
    }
  }
  if (sum.sum.size() != n) {
    return corrupt("the checkpoint's replica sum has " + std::to_string(sum.sum.size()) + " values, the model " +
                   std::to_string(n));
  }
  // Every value of a sum is within the largest terms it added (plus their
  // rounding): a value past that was not made by adding updates.
  const double limit = std::ldexp(std::max(sum.bound_used, 0.0), federation::kFractionBits) + static_cast<double>(sum.updates) + 1.0;
  for (size_t i = 0; i < sum.sum.size(); ++i) {
    if (std::fabs(static_cast<double>(sum.sum[i])) > limit) {
      return corrupt("the checkpoint's replica sum holds value " + std::to_string(i) + " beyond the bound it used");
    }
  }
  return Status::ok();
}

}  // namespace

Status ReplicaSync::restore(const store::LoadedCheckpoint& checkpoint, const nlohmann::json& state,
                            store::CheckpointStore& store, std::vector<std::string>& warnings) {
  if (!state.contains("replica")) return corrupt("the checkpoint has no replica state (written with another merge rule)");
  try {
    const nlohmann::json& replica = state.at("replica");
    federation::ExactAccumulator::Saved sum;
    sum.weight = replica.at("weight_raw").get<int64_t>();
    sum.bound_used = replica.at("bound_used").get<double>();
    sum.updates = replica.at("updates").get<int64_t>();
    FEDMESH_RETURN_IF_ERROR(read_sum(checkpoint, state_.raw_sum().size(), sum));
    std::set<gossip::UpdateId> applied;
    for (const auto& [sender, rounds] : replica.at("applied").items()) {
      for (const nlohmann::json& r : rounds) applied.insert({sender, r.get<uint64_t>()});
    }
    FEDMESH_RETURN_IF_ERROR(state_.restore(std::move(sum), std::move(applied), replica.at("floor").get<uint64_t>()));
    own_.clear();
    retired_.clear();
    uint64_t elements = 0;
    for (const protocol::TensorShape& shape : state_.manifest()) elements += shape.element_count();
    std::set<std::string> named;
    if (replica.contains("own_pending")) {
      for (const auto& [key, id_json] : replica.at("own_pending").items()) {
        const uint64_t round = std::stoull(key);
        const std::string id = id_json.get<std::string>();
        named.insert(id);
        Result<std::vector<uint8_t>> bytes = store.read_pending_update(std::vector<uint8_t>(id.begin(), id.end()));
        Result<Own> own = [&]() -> Result<Own> {
          if (!bytes.is_ok()) return bytes.status();
          if (own_update_format(*bytes) == 2) {
            Result<std::vector<protocol::EncodedTensor>> tensors = decode_own_segments(*bytes, round, state_.manifest());
            if (!tensors.is_ok()) return tensors.status();
            Own restored;
            restored.tensors = std::move(*tensors);
            return restored;
          }
          // Format 1 (before 2026-12-07): the coordinates it moved and their values.
          std::vector<uint64_t> index;
          std::vector<float> value;
          FEDMESH_RETURN_IF_ERROR(decode_own_update(*bytes, round, elements, index, value));
          return own_from(round, std::move(index), std::move(value));
        }();
        if (!own.is_ok()) {
          warnings.push_back("our update of round " + std::to_string(round) + " cannot be sent again after this "
                             "restart (it is in the sum): " + own.status().message());
          continue;
        }
        own->pending_id = id;
        own_[round] = std::move(*own);
      }
    } else {
      // The earlier format: own updates as tensors of every checkpoint.
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
        std::vector<uint64_t> index;
        std::vector<float> values;
        for (int64_t k = 0; k < value->value.numel(); ++k) {
          const float h = high->value.data<float>()[k], l = low->value.data<float>()[k];
          if (!(h >= 0.0f && h < 4194304.0f && h == std::floor(h) && l >= 0.0f && l < 4194304.0f && l == std::floor(l))) {
            return corrupt("the checkpoint's own update of round " + std::to_string(round) + " holds a bad entry");
          }
          index.push_back((static_cast<uint64_t>(h) << 22) | static_cast<uint64_t>(l));
          values.push_back(value->value.data<float>()[k]);
        }
        Result<Own> own = own_from(round, std::move(index), std::move(values));
        if (!own.is_ok()) return own.status();
        own_[round] = std::move(*own);
        // Into the store's pending updates, as this build keeps them.
        FEDMESH_RETURN_IF_ERROR(persist(round, store));
      }
    }
    // Own updates in the store that this checkpoint does not name (made
    // before a crash that came before their round's commit, or retired by
    // a commit that never happened): dropped at the next commit.
    Result<std::vector<store::PendingUpdate>> pending = store.pending_updates();
    if (!pending.is_ok()) return pending.status();
    for (const store::PendingUpdate& p : *pending) {
      const std::string id(p.update_id.begin(), p.update_id.end());
      if (id.rfind(kOwnIdPrefix, 0) == 0 && !named.contains(id)) retired_.push_back(id);
    }
  } catch (const nlohmann::json::exception& error) {
    return corrupt(std::string("the replica state is malformed: ") + error.what());
  }
  return Status::ok();
}

}  // namespace fedmesh::node
