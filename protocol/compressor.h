// Update compression with error feedback. A site keeps, per tensor, an fp32
// residual e of what earlier compressions dropped; each update it compresses
// a = e + delta, sends C(a) and keeps e <- a - D(C(a)), so nothing is lost,
// only delayed (sum over rounds of what was sent, plus the final residual,
// equals the sum of the deltas: tests/protocol/test_compressor.cpp).
//
// a is formed in the residual's own buffer (e <- e + delta, then
// e <- e - D(C(e))), so a lossy tensor costs one model-sized buffer between
// updates, not two, and its step reads and writes it in place. An update not
// delivered is given back by adding D(C(a)) to e again: for round-to-nearest
// quantization, top-k and half casts e - D and then + D are exact (D is within
// a factor of 2 of a, or 0), so e returns to a bit for bit; stochastic
// rounding, dct-sign and PowerSGD return to within a rounding of it.
//
// The heavy numerics run on a kernels::CompressionKernels backend (CPU or
// CUDA); the bytes are the codec's (protocol/codec.h), and D(C(a)) is
// computed by decoding those very bytes with the codec, so the residual
// always matches what the receiver reconstructs. Deterministic for a seed.
//
// PowerSGD (Vogels et al. 2019) needs a P shared by all sites of a round:
// each site sends P_i = a Q (Q shared, warm-started from the last round), the
// aggregator averages and orthonormalizes P and sends it back, each site
// sends Q_i = a^T P and keeps e = a - P Q_i^T; the aggregate P (mean Q_i)^T is
// then exactly the mean of the sites' decoded updates. That second exchange
// exists in `fedmesh sim` (aggregator path); it has no meaning for pairwise
// gossip (there is no shared P between two peers), and `fedmesh node` refuses
// powersgd until the networked aggregator protocol carries it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "kernels/compression_kernels.h"
#include "protocol/compression_spec.h"
#include "protocol/update_transfer.h"

namespace fedmesh::protocol {

// One tensor's compressor (not PowerSGD, which UpdateCompressor runs itself).
class TensorCompressor {
 public:
  virtual ~TensorCompressor() = default;
  // a = e + delta; top-k with momentum first folds delta into its momentum.
  // a may be delta or the residual itself (each element is read before it is
  // written).
  virtual void form_input(std::span<const float> residual, std::span<const float> delta, std::span<float> a,
                          kernels::CompressionKernels& kernels);
  // Encodes a as tensor `index`; `round` counts this site's compressions
  // (0-based: top-k's warm-up), `seed` drives sampling and stochastic rounding.
  virtual Result<EncodedTensor> compress(uint32_t index, std::span<const float> a, int64_t round, uint64_t seed) = 0;
  // After compress(): residual = a - D(C(a)), and decoded = D(C(a)) unless
  // decoded is empty. residual may be a itself (UpdateCompressor passes the
  // same buffer), so every element of a is read before it is written. D is the receiver's decoding of `sent`: by default the
  // codec decodes the bytes into `scratch`; methods with a cheaper exact path
  // override it (block quantization dequantizes its own q * scale, top-k
  // touches only the k positions it sent), held to the codec by the tests.
  virtual Status update_residual(const EncodedTensor& sent, std::span<const TensorShape> manifest,
                                 std::span<const float> a, std::span<float> residual, std::span<float> decoded,
                                 kernels::CompressionKernels& kernels, std::vector<float>& scratch);
  // compress() then update_residual(), as error feedback runs them; block
  // quantization overrides it with one fused pass over a
  // (CompressionKernels::quantize_blocks_with_residual).
  virtual Result<EncodedTensor> compress_with_residual(uint32_t index, std::span<const float> a, int64_t round,
                                                       uint64_t seed, std::span<const TensorShape> manifest,
                                                       std::span<float> residual, std::span<float> decoded,
                                                       kernels::CompressionKernels& kernels,
                                                       std::vector<float>& scratch);
  // form_input(residual, delta, residual) then compress_with_residual on the
  // residual: a = e + delta formed and stepped. Block quantization overrides
  // it with one pass over e and delta
  // (CompressionKernels::add_quantize_blocks_with_residual). On an error the
  // residual holds a (nothing lost) and nothing is kept to give back.
  virtual Result<EncodedTensor> compress_folding(uint32_t index, std::span<const float> delta, int64_t round,
                                                 uint64_t seed, std::span<const TensorShape> manifest,
                                                 std::span<float> residual, std::span<float> decoded,
                                                 kernels::CompressionKernels& kernels, std::vector<float>& scratch);
  // An update not delivered: residual += D(C(a)) of the last
  // compress_with_residual, from what this compressor kept of it (by default
  // a copy of the segments sent; block quantization its q and scales, top-k
  // its k positions and values).
  virtual Status take_back(std::span<float> residual, std::span<const TensorShape> manifest,
                           kernels::CompressionKernels& kernels, std::vector<float>& scratch);
  // Frees what take_back would read and the buffers kept between updates.
  virtual void release();
  // State other than the residual that a checkpoint must keep: momentum.
  virtual std::vector<float>* momentum() { return nullptr; }

 private:
  std::vector<EncodedSegment> kept_;  // the default take_back's copy of what was sent
};

Result<std::unique_ptr<TensorCompressor>> make_tensor_compressor(const CompressionSpec& spec, const TensorShape& shape,
                                                                 kernels::CompressionKernels& kernels,
                                                                 size_t max_segment_bytes);

// Top-k's density for a round under warm-up: F^((round + 1) / (R + 1)) for
// the first R rounds (from near 1 down to F), F after.
double topk_density(const CompressionSpec& spec, int64_t round);

struct CompressedUpdate {
  std::vector<EncodedTensor> tensors;     // for prepare_encoded_update; PowerSGD tensors as NAME@powersgd.q (n x r)
  std::vector<std::vector<float>> decoded;  // per manifest tensor, when asked for: what the receiver reconstructs
  uint64_t payload_bytes = 0;             // segment bytes before framing
};

// The name of a PowerSGD factor on the wire: "fc1.weight@powersgd.p" / ".q".
std::string powersgd_factor_name(const std::string& tensor, char factor);

class UpdateCompressor {
 public:
  static Result<UpdateCompressor> create(const CompressionPlan& plan, std::vector<TensorShape> manifest, uint64_t seed,
                                         kernels::CompressionKernels& kernels,
                                         size_t max_segment_bytes = kDefaultChunkBytes);
  UpdateCompressor(UpdateCompressor&&) noexcept;
  UpdateCompressor& operator=(UpdateCompressor&&) noexcept;
  ~UpdateCompressor();

  const std::vector<TensorShape>& manifest() const;
  const CompressionSpec& spec(size_t tensor) const;
  // Manifest indices of the PowerSGD tensors (2-D, rows x cols), in order.
  const std::vector<size_t>& powersgd_tensors() const;

  // Forms a = e + delta for every tensor (delta: one flattened span each), a
  // lossy tensor's in its residual (e <- e + delta), a lossless one's in a copy.
  Status begin(std::span<const std::span<const float>> delta);
  // The same, delta taken over (a lossy tensor's buffer is freed once it is
  // in the residual, a lossless one's becomes its a): for a caller that has no
  // further use for its delta.
  Status begin(std::vector<std::vector<float>>&& delta);
  // PowerSGD phase 1: P_i = a Q (rows x r) per PowerSGD tensor, given the
  // shared Q (cols x r) of each.
  Result<std::vector<std::vector<float>>> powersgd_p(std::span<const std::vector<float>> shared_q) const;
  // Compresses every tensor of a and updates the residuals; PowerSGD tensors
  // with the shared orthonormal P (rows x r each) of this round. With
  // want_decoded, CompressedUpdate::decoded holds D(C(a)) per tensor.
  Result<CompressedUpdate> finish(std::span<const std::vector<float>> shared_p = {}, bool want_decoded = true);
  // The last finish()'s update was not delivered (refused, or the upload
  // failed): keep all of its input, e <- a (e + D(C(a))), so nothing is lost.
  // A second call, or one after release_buffers(), does nothing. (Top-k's
  // momentum masking of that send is not undone.) A finish() that fails
  // gives back what it had compressed itself.
  void rollback();
  // begin + finish, for plans without PowerSGD.
  Result<CompressedUpdate> compress(std::span<const std::span<const float>> delta, bool want_decoded = true);
  Result<CompressedUpdate> compress(std::vector<std::vector<float>>&& delta, bool want_decoded = true);
  // Frees the buffers kept between updates (a lossless tensor's input,
  // scratch, what rollback() would read), leaving the residuals: for
  // simulations that hold many sites' compressors, and a replica's update
  // once it is in the sum. After it, rollback() has nothing to restore.
  void release_buffers();

  // What a checkpoint keeps: role "residual" for every lossy tensor, role
  // "momentum" for top-k with momentum; names are the manifest's.
  struct StateTensor {
    std::string role, name;
    std::vector<int64_t> dims;
    std::vector<float>* values;
  };
  std::vector<StateTensor> state_tensors();
  int64_t rounds() const;  // compressions so far (top-k warm-up)
  void set_rounds(int64_t rounds);

 private:
  UpdateCompressor();
  void form_in_residual(size_t t, std::span<const float> delta);
  Status give_back(size_t t);
  // finish(), with the deltas of compress() folded into the lossy tensors'
  // steps (empty: begin() formed them already).
  Result<CompressedUpdate> finish_folding(std::span<const std::vector<float>> shared_p, bool want_decoded,
                                          std::span<const std::span<const float>> fold);
  Status take_delta(std::span<const std::span<const float>> delta, std::vector<std::vector<float>>* owned);
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace fedmesh::protocol
