// A networked peer's replica bookkeeping (node/replica_sync.h): the exact
// sum's checkpoint pieces round-trip every 64-bit value; a checkpoint in a
// real store restores the same sum (digest), the ids applied, the floor and
// the own updates kept, whose re-encoding decodes to the very values sent;
// the window forgets old rounds; what a member lacks is listed by round.
#include <gtest/gtest.h>

#include <deque>
#include <filesystem>
#include <cmath>
#include <limits>

#include "node/replica_sync.h"
#include "protocol/codec.h"
#include "store/checkpoint_store.h"
#include "tests/gossip/gossip_models.h"

namespace fedmesh::node {
namespace {

using gossip::testing::Model;

std::vector<protocol::TensorShape> manifest() { return gossip::testing::two_tensors(24, 30); }

ReplicaSync sync(const std::string& self, const Model& x0) {
  Result<gossip::ReplicaState> state = gossip::ReplicaState::create(
      gossip::testing::plan("topk:0.05+int8"), manifest(), x0, 3, 1.0, 7, kernels::cpu_compression_kernels());
  EXPECT_TRUE(state.is_ok()) << state.status().message();
  return ReplicaSync(std::move(*state), self);
}

Model plus(const Model& a, const Model& b) {
  Model out = a;
  for (size_t t = 0; t < out.size(); ++t) {
    for (size_t i = 0; i < out[t].size(); ++i) out[t][i] += b[t][i];
  }
  return out;
}

// A store file of its own for one test, none there yet.
std::filesystem::path fresh_store(const std::string& name) {
  const std::filesystem::path path =
      std::filesystem::path(::testing::TempDir()) / (name + "-" + std::to_string(::getpid()) + ".db");
  std::filesystem::remove(path);
  return path;
}

// An update as it travels, decoded: one dense tensor per manifest entry.
Model decoded(const std::vector<protocol::EncodedTensor>& update) {
  Model out;
  for (size_t t = 0; t < manifest().size(); ++t) {
    out.emplace_back(manifest()[t].element_count(), 0.0f);
    for (const protocol::EncodedSegment& segment : update[t].segments) {
      EXPECT_TRUE(protocol::decode_segment(segment.view(), manifest(), out[t]).is_ok());
    }
  }
  return out;
}

// Saves `sync` as round `round` and commits it; the commit retires
// `retired` own updates and holds no own-update tensors. Returns the state.
nlohmann::json commit(ReplicaSync& sync, store::CheckpointStore& db, int64_t round, size_t retired) {
  store::RoundToCommit entry;
  entry.round = round;
  std::deque<Tensor> views;
  nlohmann::json state;
  sync.save(views, entry.tensors, state, entry.applied_updates);
  EXPECT_EQ(entry.applied_updates.size(), retired) << "round " << round;
  for (const store::TensorToCommit& t : entry.tensors) EXPECT_EQ(t.name.rfind("own.", 0), std::string::npos) << t.name;
  entry.state_json = state.dump();
  EXPECT_TRUE(db.commit_round(entry).is_ok()) << "round " << round;
  sync.committed();
  return state;
}

TEST(ReplicaSync, FixedPointPiecesRoundTripEveryValue) {
  for (const int64_t v : {int64_t{0}, int64_t{1}, int64_t{-1}, int64_t{123456789012345}, int64_t{-98765432109876},
                          std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()}) {
    float pieces[3];
    split_fixed_point(v, pieces);
    EXPECT_EQ(join_fixed_point(pieces), v);
  }
}

TEST(ReplicaSync, ACheckpointRestoresTheSumTheIdsAndTheOwnUpdates) {
  const std::filesystem::path path = fresh_store("replica-sync");
  const Model x0 = gossip::testing::random_model(manifest(), 1, 1.0f);
  ReplicaSync a = sync("a", x0);
  crypto::Hash committed_digest{};
  Model committed_model;
  std::set<gossip::UpdateId> committed_ids;
  {
    Result<store::CheckpointStore> db = store::CheckpointStore::open(path.string());
    ASSERT_TRUE(db.is_ok()) << db.status().message();
    for (uint64_t r = 0; r < 20; ++r) {
      ASSERT_TRUE(a.make(r, plus(a.state().model(), gossip::testing::random_model(manifest(), 100 + r, 0.1f))).is_ok());
      ASSERT_TRUE(a.persist(r, *db).is_ok());
      const Model theirs = gossip::testing::random_model(manifest(), 200 + r, 0.01f);
      ASSERT_TRUE(*a.take("b", r, theirs));
      EXPECT_FALSE(*a.take("b", r, theirs)) << "a second copy is not applied";
      a.advance(r + 1);
    }
    // The window: 16 rounds kept, older ones forgotten and no longer taken.
    EXPECT_EQ(a.state().floor(), 4u);
    EXPECT_EQ(a.own(3), nullptr);
    ASSERT_NE(a.own(4), nullptr);
    EXPECT_FALSE(*a.take("c", 2, gossip::testing::random_model(manifest(), 9, 0.01f)));
    EXPECT_EQ(a.missing("b", 20), std::vector<uint64_t>{});
    EXPECT_EQ(a.missing("c", 6), (std::vector<uint64_t>{4, 5}));

    // Each own update was written once; the commit names the 16 kept and
    // retires the 4 that left the window.
    const nlohmann::json state = commit(a, *db, 1, 4);
    EXPECT_EQ(state["replica"]["own_pending"].size(), 16u);
    ASSERT_EQ(db->pending_updates()->size(), 16u);
    committed_digest = a.state().digest();
    committed_model = a.state().model();
    committed_ids = a.state().applied_ids();
    // A round made again after a crash before its commit: a stray.
    ASSERT_TRUE(a.make(20, plus(a.state().model(), gossip::testing::random_model(manifest(), 120, 0.1f))).is_ok());
    ASSERT_TRUE(a.persist(20, *db).is_ok());
    ASSERT_EQ(db->pending_updates()->size(), 17u);
  }
  Result<store::CheckpointStore> db = store::CheckpointStore::open(path.string());
  ASSERT_TRUE(db.is_ok());
  Result<store::LoadedCheckpoint> loaded = db->resume_latest({});
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().message();
  ReplicaSync b = sync("a", x0);
  std::vector<std::string> warnings;
  ASSERT_TRUE(b.restore(*loaded, nlohmann::json::parse(loaded->round.state_json), *db, warnings).is_ok());
  EXPECT_TRUE(warnings.empty());
  EXPECT_EQ(b.state().digest(), committed_digest);
  EXPECT_EQ(b.state().model(), committed_model);
  EXPECT_EQ(b.state().applied_ids(), committed_ids);
  EXPECT_EQ(b.state().floor(), 4u);
  EXPECT_EQ(b.own(20), nullptr) << "round 20 was never committed";
  std::vector<uint64_t> kept;
  for (uint64_t r = 4; r < 20; ++r) kept.push_back(r);
  EXPECT_EQ(b.own_rounds(), kept);
  // A restored own update, sent again, decodes to the values first sent.
  for (const uint64_t r : {uint64_t{4}, uint64_t{19}}) {
    const std::vector<protocol::EncodedTensor>* sent = a.own(r);
    const std::vector<protocol::EncodedTensor>* again = b.own(r);
    ASSERT_TRUE(sent && again);
    const Model values = decoded(*again);
    EXPECT_EQ(decoded(*sent), values) << "round " << r;
    // Only the coordinates sent: at most 8 bytes an entry and a segment
    // header per tensor, not a model-sized slice (a restored peer once
    // resent every update of its window as one).
    size_t entries = 0, bytes = 0, model = 0;
    for (size_t t = 0; t < manifest().size(); ++t) {
      model += manifest()[t].element_count();
      for (const protocol::EncodedSegment& segment : (*again)[t].segments) bytes += segment.payload_bytes();
      for (const float v : values[t]) entries += v != 0.0f;
    }
    EXPECT_LT(entries, model / 4) << "top-k 5 % keeps few coordinates";
    EXPECT_LE(bytes, 8 * entries + 64 * manifest().size()) << "round " << r;
    // Kept as sent (format 2): the very segments, byte for byte.
    for (size_t t = 0; t < manifest().size(); ++t) {
      ASSERT_EQ((*sent)[t].segments.size(), (*again)[t].segments.size());
      EXPECT_EQ((*sent)[t].descriptor.encoding, (*again)[t].descriptor.encoding);
      for (size_t k = 0; k < (*sent)[t].segments.size(); ++k) {
        const protocol::EncodedSegment &x = (*sent)[t].segments[k], &y = (*again)[t].segments[k];
        EXPECT_TRUE(x.encoding == y.encoding && x.offset == y.offset && x.count == y.count && x.nnz == y.nnz &&
                    x.indices == y.indices && x.values == y.values && x.scales == y.scales)
            << "round " << r << " tensor " << t << " segment " << k;
      }
    }
  }
  // The stray is retired by the next commit.
  commit(b, *db, 2, 1);
  EXPECT_EQ(db->pending_updates()->size(), 16u);
  // A state from another merge rule is refused, not guessed at.
  ReplicaSync c = sync("a", x0);
  EXPECT_FALSE(c.restore(*loaded, nlohmann::json::object(), *db, warnings).is_ok());
  std::filesystem::remove(path);
}

// The sum is checkpointed as its raw 64-bit words; a checkpoint of the
// earlier format (three exact float pieces per value) still restores, and a
// sum holding a value no sequence of updates could make is refused.
TEST(ReplicaSync, TheSumRestoresFromEitherFormatAndOutOfBoundValuesAreRefused) {
  const std::filesystem::path path =
      std::filesystem::path(::testing::TempDir()) / ("replica-sum-" + std::to_string(::getpid()) + ".db");
  std::filesystem::remove(path);
  const Model x0 = gossip::testing::random_model(manifest(), 2, 1.0f);
  ReplicaSync a = sync("a", x0);
  for (uint64_t r = 0; r < 3; ++r) {
    ASSERT_TRUE(a.make(r, plus(a.state().model(), gossip::testing::random_model(manifest(), 300 + r, 0.1f))).is_ok());
    ASSERT_TRUE(*a.take("b", r, gossip::testing::random_model(manifest(), 400 + r, 0.01f)));
  }
  Result<store::CheckpointStore> db = store::CheckpointStore::open(path.string());
  ASSERT_TRUE(db.is_ok()) << db.status().message();
  // This format: one tensor, the sum's own bytes (8 per value).
  store::RoundToCommit entry;
  entry.round = 1;
  std::deque<Tensor> views;
  nlohmann::json state;
  a.save(views, entry.tensors, state, entry.applied_updates);
  ASSERT_EQ(entry.tensors.size(), 1u);
  EXPECT_EQ(entry.tensors[0].tensor->nbytes(), a.state().raw_sum().size_bytes());
  entry.state_json = state.dump();
  ASSERT_TRUE(db->commit_round(entry).is_ok());
  a.committed();
  // The earlier format, written by hand: three pieces.
  const std::span<const int64_t> raw = a.state().raw_sum();
  const auto n = static_cast<int64_t>(raw.size());
  std::vector<Tensor> pieces;
  for (int k = 0; k < 3; ++k) pieces.push_back(Tensor::empty(Shape({n}), DType::kF32));
  for (int64_t i = 0; i < n; ++i) {
    float parts[3];
    split_fixed_point(raw[static_cast<size_t>(i)], parts);
    for (int k = 0; k < 3; ++k) pieces[static_cast<size_t>(k)].data<float>()[i] = parts[k];
  }
  store::RoundToCommit earlier;
  earlier.round = 2;
  earlier.state_json = entry.state_json;
  const char* names[3] = {"sum.high", "sum.middle", "sum.low"};
  for (int k = 0; k < 3; ++k) earlier.tensors.push_back({"replica", names[k], &pieces[static_cast<size_t>(k)]});
  ASSERT_TRUE(db->commit_round(earlier).is_ok());
  // A raw sum with one value far past what its updates could make.
  std::vector<int64_t> forged(raw.begin(), raw.end());
  forged[5] = int64_t{1} << 62;
  Tensor forged_view = Tensor::view_of(forged.data(), Shape({2 * n}), DType::kF32);
  store::RoundToCommit bad;
  bad.round = 3;
  bad.state_json = entry.state_json;
  bad.tensors.push_back({"replica", "sum.fixed64", &forged_view});
  ASSERT_TRUE(db->commit_round(bad).is_ok());
  std::vector<std::string> warnings;
  for (const int64_t round : {int64_t{1}, int64_t{2}, int64_t{3}}) {
    Result<store::LoadedCheckpoint> loaded = db->load_round(round);
    ASSERT_TRUE(loaded.is_ok()) << loaded.status().message();
    ReplicaSync b = sync("a", x0);
    const Status restored = b.restore(*loaded, nlohmann::json::parse(loaded->round.state_json), *db, warnings);
    if (round == 3) {
      EXPECT_FALSE(restored.is_ok());
      EXPECT_NE(restored.message().find("beyond the bound"), std::string::npos) << restored.message();
    } else {
      ASSERT_TRUE(restored.is_ok()) << "round " << round << ": " << restored.message();
      EXPECT_EQ(b.state().digest(), a.state().digest()) << "round " << round;
      EXPECT_EQ(b.state().model(), a.state().model()) << "round " << round;
    }
  }
  std::filesystem::remove(path);
}

TEST(ReplicaSync, OwnUpdateBytesAreCheckedBeforeUse) {
  const std::vector<uint64_t> index = {1, 5, 9};
  const std::vector<float> value = {0.5f, -1.0f, 2.0f};
  std::vector<uint64_t> i;
  std::vector<float> v;
  const std::vector<uint8_t> good = encode_own_update(7, index, value);
  ASSERT_TRUE(decode_own_update(good, 7, 10, i, v).is_ok());
  EXPECT_EQ(i, index);
  EXPECT_EQ(v, value);
  const auto refused = [&](std::vector<uint8_t> bytes, uint64_t round, uint64_t elements, const char* why) {
    const Status s = decode_own_update(bytes, round, elements, i, v);
    EXPECT_FALSE(s.is_ok()) << why;
    EXPECT_NE(s.message().find(why), std::string::npos) << s.message();
  };
  refused({}, 7, 10, "no FMRO header");
  refused(good, 8, 10, "holds round 7");
  refused(good, 7, 9, "holds a bad entry");
  refused(std::vector<uint8_t>(good.begin(), good.end() - 1), 7, 10, "bytes for 3 coordinates");
  refused(encode_own_update(7, std::vector<uint64_t>{5, 1, 9}, value), 7, 10, "holds a bad entry");
  refused(encode_own_update(7, index, std::vector<float>{0.5f, std::nanf(""), 2.0f}), 7, 10, "holds a bad entry");
  std::vector<uint8_t> versioned = good;
  versioned[4] = 2;
  refused(versioned, 7, 10, "format version 2");
}

// Stores written before format 2 keep own updates as coordinates and
// values (format 1): a checkpoint naming such updates still restores them,
// re-encoded sparse, decoding to the values first sent.
TEST(ReplicaSync, OwnUpdatesOfTheFirstFormatStillRestore) {
  const std::filesystem::path path = fresh_store("replica-sync-v1");
  const Model x0 = gossip::testing::random_model(manifest(), 1, 1.0f);
  ReplicaSync a = sync("a", x0);
  Result<store::CheckpointStore> db = store::CheckpointStore::open(path.string());
  ASSERT_TRUE(db.is_ok()) << db.status().message();
  for (uint64_t r = 0; r < 3; ++r) {
    ASSERT_TRUE(a.make(r, plus(a.state().model(), gossip::testing::random_model(manifest(), 100 + r, 0.1f))).is_ok());
    ASSERT_TRUE(a.persist(r, *db).is_ok());
    a.advance(r + 1);
  }
  nlohmann::json state = commit(a, *db, 1, 0);
  // Each own update again as format 1, under an id of its own, named by the state.
  for (uint64_t r = 0; r < 3; ++r) {
    std::vector<uint64_t> index;
    std::vector<float> value;
    uint64_t flat = 0;
    for (const std::vector<float>& dense : decoded(*a.own(r))) {
      for (size_t i = 0; i < dense.size(); ++i, ++flat) {
        if (dense[i] != 0.0f) {
          index.push_back(flat);
          value.push_back(dense[i]);
        }
      }
    }
    const std::string id = "replica.own.v1." + std::to_string(r);
    store::PendingUpdate entry;
    entry.update_id.assign(id.begin(), id.end());
    entry.sender = "a";
    entry.base_version = static_cast<int64_t>(r);
    ASSERT_TRUE(db->add_pending_update(entry, encode_own_update(r, index, value)).is_ok());
    state["replica"]["own_pending"][std::to_string(r)] = id;
  }
  Result<store::LoadedCheckpoint> loaded = db->resume_latest({});
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().message();
  ReplicaSync b = sync("a", x0);
  std::vector<std::string> warnings;
  ASSERT_TRUE(b.restore(*loaded, state, *db, warnings).is_ok());
  EXPECT_TRUE(warnings.empty()) << warnings.front();
  for (uint64_t r = 0; r < 3; ++r) {
    ASSERT_NE(b.own(r), nullptr) << "round " << r;
    EXPECT_EQ(decoded(*a.own(r)), decoded(*b.own(r))) << "round " << r;
  }
  std::filesystem::remove(path);
}

// Format 2 (an own update as it was sent) round-trips, and bytes that are
// cut, of another round or model, or hold a segment a receiver would refuse
// are refused with what is wrong, never read past their end.
TEST(ReplicaSync, OwnSegmentsRoundTripAndBadBytesAreRefused) {
  const Model x0 = gossip::testing::random_model(manifest(), 1, 1.0f);
  ReplicaSync a = sync("a", x0);
  ASSERT_TRUE(a.make(4, plus(x0, gossip::testing::random_model(manifest(), 5, 0.1f))).is_ok());
  const std::vector<protocol::EncodedTensor>& sent = *a.own(4);
  const std::vector<uint8_t> good = encode_own_segments(4, sent);
  EXPECT_EQ(own_update_format(good), 2u);
  Result<std::vector<protocol::EncodedTensor>> back = decode_own_segments(good, 4, manifest());
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  ASSERT_EQ(back->size(), sent.size());
  for (size_t t = 0; t < sent.size(); ++t) {
    ASSERT_EQ((*back)[t].segments.size(), sent[t].segments.size());
    for (size_t k = 0; k < sent[t].segments.size(); ++k) {
      EXPECT_EQ((*back)[t].segments[k].indices, sent[t].segments[k].indices);
      EXPECT_EQ((*back)[t].segments[k].values, sent[t].segments[k].values);
      EXPECT_EQ((*back)[t].segments[k].scales, sent[t].segments[k].scales);
    }
  }
  const auto refused = [&](const std::vector<uint8_t>& bytes, uint64_t round, const char* why) {
    Result<std::vector<protocol::EncodedTensor>> r = decode_own_segments(bytes, round, manifest());
    ASSERT_FALSE(r.is_ok()) << why;
    EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status().message();
  };
  refused({}, 4, "not an own update");
  refused(good, 5, "holds round 4");
  for (const size_t cut : {size_t{12}, size_t{30}, good.size() / 2, good.size() - 1}) {
    refused(std::vector<uint8_t>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(cut)), 4, "cut short");
  }
  std::vector<uint8_t> longer = good;
  longer.push_back(0);
  refused(longer, 4, "past its end");
  std::vector<uint8_t> tensors = good;
  tensors[16] = 3;
  refused(tensors, 4, "3 tensors for a model of 2");
  std::vector<uint8_t> encoding = good;
  encoding[24] = 200;  // after magic, version, round and tensor count (24 bytes)
  refused(encoding, 4, "no encoding 200");
  // The first segment's offset (after the 24-byte header, the tensor's 16
  // bytes and the segment's tensor and encoding) pushed past its tensor:
  // refused as a receiver refuses it.
  std::vector<uint8_t> offset = good;
  offset[24 + 16 + 8 + 7] = 0x7f;
  Result<std::vector<protocol::EncodedTensor>> r = decode_own_segments(offset, 4, manifest());
  EXPECT_FALSE(r.is_ok());
  // A segment count no bytes could hold is refused before anything is made for it.
  std::vector<uint8_t> segments = good;
  segments[24 + 8 + 7] = 0x7f;
  refused(segments, 4, "tensor 0 is cut short");
  // Format 1 bytes are not format 2.
  refused(encode_own_update(4, std::vector<uint64_t>{1}, std::vector<float>{1.0f}), 4, "not an own update of format 2");
  EXPECT_EQ(own_update_format(encode_own_update(4, std::vector<uint64_t>{1}, std::vector<float>{1.0f})), 1u);
}

}  // namespace
}  // namespace fedmesh::node
