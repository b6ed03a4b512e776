// A host emulation of kernels/cuda_ops.h for tests on machines without a GPU.
// Linked into a test executable (as a source of it, ahead of the kernels
// library), it replaces the CUDA backend: "device" memory is host memory
// from a tracked pool, and each op computes with the CPU kernel its CUDA
// version is held to (tests/kernels/test_cuda_ops.cpp), so the code that
// drives a device (kernels/device_ops, the layers, the trainer) runs here
// end to end. It checks what a real device would make fail: every pointer an
// op takes must lie inside a live device block (a host buffer given to a
// device op aborts naming the op), and it counts the ops and the waits
// (copies to the host, synchronize) so a test can hold a training step to
// its one wait per step. It does not show that the CUDA kernels are right:
// test_cuda_ops does, on a GPU.
#pragma once

#include <cstdint>

namespace fedmesh::cuda::emulation {

struct Counters {
  int64_t ops = 0;          // kernels and device-side copies enqueued
  int64_t waits = 0;        // copy_to_host and synchronize calls
  int64_t live_blocks = 0;  // device blocks allocated and not yet freed
  int64_t live_bytes = 0;
};

Counters counters();

}  // namespace fedmesh::cuda::emulation
