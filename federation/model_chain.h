// Global model versions form a hash chain: version v's hash is BLAKE2b-256
// over a domain tag, v, version v-1's hash, and every tensor's name, shape
// and bytes (version 0's parent is 32 zero bytes). A node that holds the hash
// of the version it trained from accepts a new model only if its chain links
// back to that hash and its bytes hash to what the chain says; a checkpoint's
// model is checked the same way when it is restored.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "crypto/update_signature.h"
#include "kernels/tensor.h"

namespace fedmesh::federation {

crypto::Hash model_version_hash(int64_t version, const crypto::Hash& parent, const std::vector<std::string>& names,
                                const std::vector<Tensor>& tensors);

struct ChainLink {
  int64_t version = 0;
  crypto::Hash parent{};
  crypto::Hash hash{};
};

// Checks that `links` run from a version whose parent is `trusted` (the hash
// a node already holds) through consecutive versions, each naming the one
// before as its parent; kCorrupt names the first link that breaks.
Status verify_chain(const crypto::Hash& trusted, const std::vector<ChainLink>& links);

// Checks that `tensors` are the model the last link describes.
Status verify_model(const ChainLink& link, const std::vector<std::string>& names, const std::vector<Tensor>& tensors);

std::string hash_hex(const crypto::Hash& hash);
// Parses what hash_hex writes; kCorrupt otherwise.
Result<crypto::Hash> parse_hash_hex(const std::string& text);

}  // namespace fedmesh::federation
