#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <filesystem>
#include <vector>

#include "train/parallel/communicator.h"

namespace fedmesh::train {

Status RendezvousOptions::validate() const {
  if (directory.empty()) return invalid_argument("the rendezvous directory is required");
  if (size < 1 || size > 1024) return invalid_argument("the number of ranks must be in 1..1024");
  if (rank < 0 || rank >= size) {
    return invalid_argument("rank " + std::to_string(rank) + " is not one of " + std::to_string(size));
  }
  if (timeout.count() <= 0) return invalid_argument("the rendezvous timeout must be > 0");
  return Status::ok();
}

namespace {

void sum(void* c, const void* a, const void* b, size_t n) {
  float* out = static_cast<float*>(c);
  const float* x = static_cast<const float*>(a);
  const float* y = static_cast<const float*>(b);
  for (size_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
}

// Gloo reports a peer gone or a timeout by throwing; the interface returns
// a Status instead.
template <typename F>
Status guarded(const char* what, F&& f) {
  try {
    f();
    return Status::ok();
  } catch (const ::gloo::IoException& e) {
    return unavailable(std::string(what) + ": a rank is gone or too slow: " + e.what());
  } catch (const std::exception& e) {
    return unavailable(std::string(what) + " failed: " + e.what());
  }
}

class GlooCommunicator final : public Communicator {
 public:
  explicit GlooCommunicator(std::shared_ptr<::gloo::Context> context) : context_(std::move(context)) {}
  int rank() const override { return context_->rank; }
  int size() const override { return context_->size; }
  const char* backend() const override { return "gloo"; }

  Status all_reduce_sum(std::span<float> values) override {
    if (size() == 1 || values.empty()) return Status::ok();
    return guarded("all-reduce", [&] {
      ::gloo::AllreduceOptions options(context_);
      options.setOutput(values.data(), values.size());
      options.setReduceFunction(&sum);
      options.setTag(next_tag());
      ::gloo::allreduce(options);
    });
  }

  Status reduce_scatter_sum(std::span<const float> input, std::span<float> output) override {
    if (input.size() != output.size() * static_cast<size_t>(size())) {
      return invalid_argument("reduce-scatter: the input must hold size() blocks of the output's length");
    }
    // An all-reduce of the whole input, then our block: twice the traffic of
    // a true reduce-scatter, the same result.
    scratch_.assign(input.begin(), input.end());
    FEDMESH_RETURN_IF_ERROR(all_reduce_sum(scratch_));
    std::copy_n(scratch_.begin() + static_cast<std::ptrdiff_t>(output.size() * static_cast<size_t>(rank())),
                output.size(), output.begin());
    return Status::ok();
  }

  Status all_gather(std::span<const float> mine, std::span<float> output) override {
    if (output.size() != mine.size() * static_cast<size_t>(size())) {
      return invalid_argument("all-gather: the output must hold size() blocks of the input's length");
    }
    if (size() == 1) {
      std::copy(mine.begin(), mine.end(), output.begin());
      return Status::ok();
    }
    return guarded("all-gather", [&] {
      ::gloo::AllgatherOptions options(context_);
      options.setInput(const_cast<float*>(mine.data()), mine.size());
      options.setOutput(output.data(), output.size());
      options.setTag(next_tag());
      ::gloo::allgather(options);
    });
  }

  Status broadcast(std::span<float> values, int root) override {
    if (root < 0 || root >= size()) return invalid_argument("broadcast: root " + std::to_string(root) + " is not a rank");
    if (size() == 1 || values.empty()) return Status::ok();
    return guarded("broadcast", [&] {
      ::gloo::BroadcastOptions options(context_);
      if (rank() == root) options.setInput(values.data(), values.size());
      options.setOutput(values.data(), values.size());
      options.setRoot(root);
      options.setTag(next_tag());
      ::gloo::broadcast(options);
    });
  }

  Status barrier() override {
    if (size() == 1) return Status::ok();
    return guarded("barrier", [&] {
      ::gloo::BarrierOptions options(context_);
      options.setTag(next_tag());
      ::gloo::barrier(options);
    });
  }

 private:
  uint32_t next_tag() { return tag_++; }
  std::shared_ptr<::gloo::Context> context_;
  std::vector<float> scratch_;
  uint32_t tag_ = 1;
};

}  // namespace

Result<std::unique_ptr<Communicator>> make_gloo_communicator(const RendezvousOptions& options) {
  FEDMESH_RETURN_IF_ERROR(options.validate());
  std::error_code error;
  std::filesystem::create_directories(options.directory, error);
  if (error) return io_error("cannot create the rendezvous directory " + options.directory + ": " + error.message());
  try {
    ::gloo::transport::tcp::attr attr;
    attr.hostname = options.host;
    auto device = ::gloo::transport::tcp::CreateDevice(attr);
    ::gloo::rendezvous::FileStore store(options.directory);
    auto context = std::make_shared<::gloo::rendezvous::Context>(options.rank, options.size);
    context->setTimeout(options.timeout);
    context->connectFullMesh(store, device);
    return std::unique_ptr<Communicator>(std::make_unique<GlooCommunicator>(std::move(context)));
  } catch (const std::exception& e) {
    return unavailable("rank " + std::to_string(options.rank) + " of " + std::to_string(options.size) +
                       " could not meet the others through " + options.directory + ": " + e.what());
  }
}

}  // namespace fedmesh::train
