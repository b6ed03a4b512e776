// An UpdateCompressor's state in a checkpoint: its error-feedback residuals
// (role "residual") and top-k momentum (role "momentum"), one stored tensor
// per model tensor, named PREFIX + the tensor's name (the simulation keeps
// one compressor per virtual site under "site-0003/"; a node uses ""). The
// compression count (top-k warm-up) goes in the caller's state JSON.
#pragma once

#include <deque>
#include <string>
#include <vector>

#include "base/status.h"
#include "kernels/tensor.h"
#include "protocol/compressor.h"
#include "store/checkpoint_store.h"

namespace fedmesh::federation {

// Appends views of the compressor's state to `out`; `views` keeps them alive
// until the commit.
void add_compression_tensors(protocol::UpdateCompressor& compressor, const std::string& prefix,
                             std::deque<Tensor>& views, std::vector<store::TensorToCommit>& out);

// Restores what add_compression_tensors committed. A missing tensor is
// kCorrupt (the checkpoint was written with another compression plan).
Status restore_compression_tensors(protocol::UpdateCompressor& compressor, const std::string& prefix,
                                   const store::LoadedCheckpoint& checkpoint);

}  // namespace fedmesh::federation
