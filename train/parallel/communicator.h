// Collectives among the ranks of one site (one process per device), the
// piece in-site data and tensor parallelism stand on. Two
// backends behind one interface: Gloo over TCP for CPU ranks, NCCL for GPU
// ranks (buffers in device memory). Every call is blocking and
// collective: all ranks call it in the same order with buffers of the same
// length, as in MPI; a rank that does not (or died) makes the others fail
// with kUnavailable after the timeout, never hang for ever.
//
// Ranks meet through a rendezvous directory on the node's own disk: each
// rank publishes its address there and connects a full mesh (Gloo's
// FileStore). The directory must be fresh for every launch of the ranks.
#pragma once

#include <chrono>
#include <memory>
#include <span>
#include <string>

#include "base/status.h"

namespace fedmesh::train {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* backend() const = 0;
  // Whether the spans every call takes are CUDA device memory (NCCL) rather
  // than host memory (Gloo): data parallelism keeps a model's buckets where
  // the model is and needs a communicator that reads them there.
  virtual bool device_memory() const { return false; }

  // values <- the elementwise sum over ranks.
  virtual Status all_reduce_sum(std::span<float> values) = 0;
  // input: size() equal blocks of output.size(); output <- the sum over
  // ranks of block rank().
  virtual Status reduce_scatter_sum(std::span<const float> input, std::span<float> output) = 0;
  // output: size() blocks of mine.size(); block r <- rank r's `mine`.
  virtual Status all_gather(std::span<const float> mine, std::span<float> output) = 0;
  // values <- root's values.
  virtual Status broadcast(std::span<float> values, int root) = 0;
  virtual Status barrier() = 0;
};

struct RendezvousOptions {
  std::string directory;          // shared by the ranks of one launch; created if missing
  int rank = 0;
  int size = 1;
  std::string host = "127.0.0.1";  // the address this rank listens on
  std::chrono::milliseconds timeout{30000};
  Status validate() const;
};

// Connects this rank to the others (blocks until all have arrived, or the
// timeout: kUnavailable naming the ranks' directory).
Result<std::unique_ptr<Communicator>> make_gloo_communicator(const RendezvousOptions& options);

// GPU ranks: NCCL on CUDA device `device`. The spans every call takes are
// then device memory on that GPU (cudaMalloc'd), and each call returns when
// its collective has completed on the device. The NCCL unique id is
// bootstrapped through the same rendezvous directory (rank 0 writes it,
// the others wait for it). kUnavailable with the reason in a build without
// CUDA or NCCL, or when the device is missing.
Result<std::unique_ptr<Communicator>> make_nccl_communicator(const RendezvousOptions& options, int device);

}  // namespace fedmesh::train
