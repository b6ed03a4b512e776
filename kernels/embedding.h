// Embedding lookup: rows of a table gathered by integer ids.
#pragma once

#include <cstdint>
#include <span>

#include "kernels/tensor.h"

namespace fedmesh {

// out (ids, dim) = table (vocabulary, dim)[ids]; any dtypes.
void embedding_forward(const Tensor& table, std::span<const int32_t> ids, Tensor& out);
// dtable (vocabulary, dim) fp32 += scatter of dout (ids, dim) by ids.
void embedding_backward(std::span<const int32_t> ids, const Tensor& dout, Tensor& dtable);

}  // namespace fedmesh
