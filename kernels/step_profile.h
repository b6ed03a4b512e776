// Where a training step's time goes: GEMMs, the other kernels, exposed
// communication (the step waiting for the in-site all-reduce after its
// backward pass), data (turning samples into a batch: decoding is done
// before training, so this is the copy and normalization per batch), and
// the rest, the host's own work (the trainer, the layers' bookkeeping).
// `fedmesh train --profile` prints it.
//
// Off unless enabled, and then only the thread that enabled it is timed
// (the training thread): each kernel entry point opens a ProfileScope, and
// a scope's time is exclusive, so a GEMM inside a convolution counts as
// GEMM and the rest of the convolution as kernels. Work inside a
// parallel_for body is not timed separately: attention's per-head products,
// run in its parallel loop, count with attention as kernels. Wall-clock time
// on the host: for the CUDA path that is the time to enqueue, not the
// device's (events would be needed; not done), except kDeviceWait: the host
// blocked until the device caught up (stream synchronizations, and copies
// from pageable host memory, which synchronize the stream first). A step
// whose device wait is near zero is bound by the host's enqueueing.
#pragma once

#include <cstdint>

namespace fedmesh {

enum class StepTime : uint8_t { kGemm, kKernels, kCommunication, kData, kDeviceWait };

struct StepTimes {
  double gemm_seconds = 0.0;
  double kernel_seconds = 0.0;
  double communication_seconds = 0.0;
  double data_seconds = 0.0;
  double device_wait_seconds = 0.0;
};

// Starts timing on the calling thread, from zero.
void enable_step_profile();
void disable_step_profile();
// The totals since enable_step_profile().
StepTimes step_profile_totals();

// Not timed while one is alive on this thread (an evaluation inside a
// training run, which is not step time).
class ProfilePause {
 public:
  ProfilePause();
  ~ProfilePause();
  ProfilePause(const ProfilePause&) = delete;
  ProfilePause& operator=(const ProfilePause&) = delete;

 private:
  bool was_paused_;
};

class ProfileScope {
 public:
  explicit ProfileScope(StepTime kind);
  ~ProfileScope();
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  StepTime kind_;
  bool active_;
  int64_t start_ns_ = 0;
  int64_t children_ns_ = 0;  // time of the scopes opened inside this one
  ProfileScope* parent_ = nullptr;
};

}  // namespace fedmesh
