// In-site data parallelism: each rank trains on its part of the step's
// batch and, before the optimizer step, the gradients become what one
// process would compute on the whole batch: sum over ranks of
// (rank's samples x rank's mean gradient), divided by all the samples.
// Every rank then applies the same gradient to the same weights, so the
// ranks stay equal (tests/node/test_data_parallel.cpp checks 2 and 3
// processes against one on the combined batch).
//
// One bucket: the gradients are flattened into one buffer and all-reduced
// after the whole backward pass (no overlap with it yet).
#pragma once

#include "node/parallel/communicator.h"
#include "node/trainer.h"

namespace fedmesh::node {

// The hook to give Trainer::set_gradient_hook; `communicator` must outlive
// the trainer's use of it.
Trainer::GradientHook data_parallel_hook(Communicator& communicator);

}  // namespace fedmesh::node
