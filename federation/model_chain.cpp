#include "federation/model_chain.h"

namespace fedmesh::federation {

namespace {

}  // namespace

crypto::Hash model_version_hash(int64_t version, const crypto::Hash& parent, const std::vector<std::string>& names,
                                const std::vector<Tensor>& tensors) {
  crypto::Hasher hasher;
  hasher.update_text("fedmesh-model-v1");
  hasher.update_u64(static_cast<uint64_t>(version));
  hasher.update(parent);
  hasher.update_u64(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    hasher.update_text(i < names.size() ? names[i] : std::string());
    hasher.update_text(dtype_name(tensors[i].dtype()));
    hasher.update_u64(tensors[i].shape().size());
    for (int64_t dim : tensors[i].shape()) hasher.update_u64(static_cast<uint64_t>(dim));
    hasher.update({static_cast<const uint8_t*>(tensors[i].raw()), tensors[i].nbytes()});
  }
  return hasher.finish();
}

Status verify_chain(const crypto::Hash& trusted, const std::vector<ChainLink>& links) {
  crypto::Hash expected_parent = trusted;
  for (size_t i = 0; i < links.size(); ++i) {
    if (i > 0 && links[i].version != links[i - 1].version + 1) {
      return corrupt("model chain: version " + std::to_string(links[i].version) + " follows version " +
                     std::to_string(links[i - 1].version));
    }
    if (links[i].parent != expected_parent) {
      return corrupt("model chain: version " + std::to_string(links[i].version) + " names parent " +
                     hash_hex(links[i].parent).substr(0, 16) + "..., expected " +
                     hash_hex(expected_parent).substr(0, 16) + "...");
    }
    expected_parent = links[i].hash;
  }
  return Status::ok();
}

Status verify_model(const ChainLink& link, const std::vector<std::string>& names, const std::vector<Tensor>& tensors) {
  const crypto::Hash computed = model_version_hash(link.version, link.parent, names, tensors);
  if (computed != link.hash) {
    return corrupt("model version " + std::to_string(link.version) + " does not hash to its chain entry (" +
                   hash_hex(computed).substr(0, 16) + "... vs " + hash_hex(link.hash).substr(0, 16) + "...)");
  }
  return Status::ok();
}

std::string hash_hex(const crypto::Hash& hash) { return crypto::to_hex(hash); }

Result<crypto::Hash> parse_hash_hex(const std::string& text) {
  crypto::Hash hash{};
  Status s = crypto::from_hex(text, hash, "model hash");
  if (!s.is_ok()) return corrupt(s.message());
  return hash;
}

}  // namespace fedmesh::federation
