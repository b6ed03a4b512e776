// The aggregator's round logic as a state machine with no clock, network or
// disk of its own: the caller (the aggregator process, or `fedmesh sim`)
// passes the time in and moves updates in and out. The same code then runs
// against real sites and virtual ones, and a seed replays a run.
//
// Synchronous rounds: start_round() samples m of the available sites (seeded)
// and sets a deadline; each update for the round is checked and folded in;
// the round can close once every sampled site has reported, or at the
// deadline with at least min_updates. An update that arrives after its round
// closed is dropped or, with fold_late_updates, carried into the round in
// progress with staleness weight s(tau).
//
// Asynchronous (FedBuff): updates arrive whenever sites finish; each is
// weighted by sample count and s(tau), tau = current version - the version
// it was computed from; every buffer_size updates the buffer is aggregated
// as sum(n s(tau) delta) / sum(n), as FedBuff does (a stale update shrinks
// the step), and applied. FedAsync (buffer_size 1 with mixing) applies each update at
// once: x <- (1 - a s(tau)) x + a s(tau) x_site.
//
// Every update is checked before it touches the aggregate: its length, every
// value finite, its sample count within the cap, its base version not in the
// future, its norm bounded (scaled down to norm_bound when above), its id not
// already applied. Streaming rules (fedavg family) fold into the exact
// accumulator; median, trimmed mean and Krum buffer the round's updates.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "federation/exact_accumulator.h"
#include "federation/model_chain.h"
#include "aggregator/server_optimizer.h"
#include "federation/staleness.h"
#include "base/random.h"
#include "base/status.h"
#include "kernels/tensor.h"

namespace fedmesh::aggregator {

inline constexpr int64_t kMaxSitesPerRound = 100'000;

struct RoundOptions {
  // Rounds
  bool asynchronous = false;
  int64_t sites_per_round = 0;     // sync: sampled per round (0: every available site)
  int64_t min_updates = 1;         // sync: needed to close at the deadline
  double round_deadline_seconds = 60.0;
  bool fold_late_updates = false;  // sync: late updates join the next round, weighted by s(tau)
  int64_t buffer_size = 4;         // async FedBuff: updates per server step
  double fedasync_mixing = 0.0;    // async: > 0 selects FedAsync with this alpha (buffer size ignored)
  federation::StalenessFunction staleness;
  // Aggregation
  std::string rule = "mean";       // mean | median | trimmed_mean | krum
  double trim_beta = 0.2;          // trimmed_mean
  int krum_byzantine = 1;          // krum: f
  int krum_keep = 0;               // krum: m (0: n - f)
  double norm_bound = 0.0;         // > 0: scale every update to at most this L2 norm
  int64_t max_sample_count = 1'000'000;  // an update claiming more is refused
  ServerOptimizerOptions server;
  uint64_t seed = 0;

  Status validate() const;
};

// Sets the aggregation rule from "mean", "median", "trimmed_mean[:BETA]" or
// "krum[:F[:M]]"; kInvalidArgument naming the text otherwise.
Status parse_rule(std::string_view text, RoundOptions& options);

// An update's values kept outside the manager (the aggregator's store),
// read front to back in passes: once to check the update when it is
// submitted, and once more at the server step, slice by slice beside the
// other updates of the round, so the mean family never holds an update or a
// model-sized sum. A pass is reads of consecutive values from the first,
// then finish().
class StoredValues {
 public:
  virtual ~StoredValues() = default;
  // The next out.size() values of the pass.
  virtual Status read(std::span<float> out) = 0;
  // Ends the pass; kCorrupt when what was read is not what was stored.
  virtual Status finish() = 0;
};

struct SiteUpdate {
  std::string id;                  // unique per update
  std::string site;
  int64_t round = 0;               // sync: the round it answers
  int64_t base_version = 0;        // the global version the site trained from
  int64_t sample_count = 0;
  std::vector<float> delta;        // x_site - x_base, the model's tensors back to back
  std::shared_ptr<StoredValues> stored;  // with delta empty: where the delta's values are
  bool is_stored() const { return stored && delta.empty(); }
  double local_loss = 0.0;         // reported metrics
  double local_accuracy = 0.0;
};

struct AppliedUpdateRecord {
  std::string id, site;
  int64_t staleness = 0;
  double weight = 0.0;
  double norm = 0.0;
};

// What one server step did: the round record of the store.
struct RoundRecord {
  int64_t round = 0;
  int64_t version = 0;  // the model version the step produced
  federation::ChainLink link;       // its place in the model hash chain
  std::vector<AppliedUpdateRecord> applied;
  double mean_local_loss = 0.0, mean_local_accuracy = 0.0;
  bool closed_by_deadline = false;
};

// What a checkpoint keeps of a RoundManager besides the model and the server
// optimizer's tensors. Only taken and restored between rounds.
struct RoundManagerState {
  int64_t version = 0, round = 0;
  Rng::State rng;
  int64_t server_steps = 0;
  int64_t accepted = 0, refused = 0;
  std::vector<std::string> applied_ids;
  federation::ChainLink link;  // the current version's
};

class RoundManager {
 public:
  // `model`: the global model's tensors (fp32), in a fixed order.
  static Result<RoundManager> create(RoundOptions options, std::vector<std::string> names, std::vector<Tensor> model);

  int64_t version() const { return version_; }
  // The current version's link in the model hash chain.
  const federation::ChainLink& link() const { return link_; }
  int64_t round() const { return round_; }
  bool round_open() const { return round_open_; }
  const std::vector<std::string>& sampled() const { return sampled_; }
  // The updates taken into the open round (or the async buffer) so far.
  const std::vector<AppliedUpdateRecord>& buffered() const { return buffer_info_; }
  // Sync: when the open round closes, on the caller's clock.
  double deadline() const { return deadline_; }
  const std::vector<Tensor>& model() const { return model_; }
  const std::vector<std::string>& names() const { return names_; }
  int64_t parameter_count() const { return parameter_count_; }
  ServerOptimizer& server_optimizer() { return *server_; }
  // Server steps the model took (at most version(): a version can also
  // restore an earlier model, see step_past_quarantine).
  int64_t server_steps() const { return server_->steps_taken(); }

  // Sync: opens round `round() + 1` for a seeded sample of `available`.
  Status start_round(const std::vector<std::string>& available, double now);
  // Checks and folds in one update. Returns the server step's record when
  // this update completed an asynchronous buffer; nullopt otherwise. A
  // refused update leaves everything unchanged; the message says why.
  Result<std::optional<RoundRecord>> submit(SiteUpdate update, double now);
  // What submit() checks of an update's round, base version and site, without
  // its values: the aggregator asks before it stores and acknowledges one.
  Status admissible(const SiteUpdate& update) const;
  // Sync: takes `site` out of the open round's sample (its key was revoked):
  // the round then waits only for the others. An update it sent before is
  // kept (it was signed by a member). False if it was not sampled.
  bool drop_from_sample(const std::string& site);
  // Sync: whether the round may close now: every site still sampled has
  // reported, or the deadline passed.
  bool ready_to_close(double now) const;
  // Sync: aggregates, applies the server step, and returns the record.
  Result<RoundRecord> close_round(double now);
  // Sync, private mode: closes the round with an aggregate computed outside
  // (secure aggregation's mean of `contributors`' updates, which the manager
  // never sees one by one): checked like an update (length, finite), then
  // applied by the server optimizer. Refused unless the round is open and
  // nothing was submitted to it.
  Result<RoundRecord> close_round_with_mean(std::vector<float> mean, const std::vector<std::string>& contributors);

  // Between rounds (nothing open or buffered): the state to checkpoint, and
  // its restoration into a manager created with the same options and a model
  // of the same shapes. Restore the model's values through mutable_model()
  // and the server optimizer's through server_optimizer().state_tensors()
  // first: restore() refuses a model that does not hash to state.link.
  Result<RoundManagerState> state() const;
  Status restore(const RoundManagerState& state);
  std::vector<Tensor>& mutable_model() { return model_; }

  // A server step that failed after it began to change the model (a stored
  // update that could not be read back, or read back damaged): the model in
  // memory is then neither the old version nor the new one, so every later
  // call is refused with this error, and the owner restarts from its store.
  const Status& failed_step() const { return failed_step_; }

  // Update values (floats) the manager holds for the open round or buffer:
  // none for the mean family, which folds each update into one exact sum as
  // it arrives; every buffered update's for median, trimmed mean and Krum,
  // which must see the round's updates together.
  int64_t held_update_values() const;

  // Counters for metrics.
  int64_t accepted() const { return accepted_; }
  int64_t refused() const { return refused_; }

 private:
  RoundManager(RoundOptions options, std::vector<std::string> names, std::vector<Tensor> model);
  // Checks an update's values (read from `stored` when delta is empty):
  // its norm, and its largest magnitude after the norm bound's scaling.
  Status check(SiteUpdate& update, double& norm, float& largest) const;
  Result<RoundRecord> apply_buffer(bool closed_by_deadline);
  // Whether the rule folds updates into accumulator_ as they arrive.
  bool streaming() const;
  // Takes an accepted update into the round (or async buffer); refused, with
  // nothing changed, when the exact sum cannot take it.
  Status take(SiteUpdate update, AppliedUpdateRecord info, float largest);
  // The factor the norm bound scales an update of this norm by (1: none).
  double norm_factor(double norm) const;
  // The mean family's server step, slice by slice: the folded sum's slice
  // plus each stored update's, their mean, and the step on that range.
  Status step_in_slices();
  void clear_buffer();

  RoundOptions options_;
  std::vector<std::string> names_;
  std::vector<Tensor> model_;
  int64_t parameter_count_ = 0;
  std::unique_ptr<ServerOptimizer> server_;
  Rng rng_;
  int64_t version_ = 0, round_ = 0;
  bool round_open_ = false;
  double deadline_ = 0.0;
  std::vector<std::string> sampled_;
  std::vector<SiteUpdate> buffer_;               // updates of the round (or async buffer); values dropped when streaming
  std::unique_ptr<federation::ExactAccumulator> accumulator_;  // streaming rules: the sum of updates given in memory
  double stored_bound_ = 0.0;  // the exact sum's bound the buffered stored updates will take
  Status failed_step_;
  std::vector<AppliedUpdateRecord> buffer_info_;  // their weights and norms
  std::vector<std::string> applied_ids_;          // ids ever applied (the store keeps them durably)
  federation::ChainLink link_;
  int64_t accepted_ = 0, refused_ = 0;
};

}  // namespace fedmesh::aggregator
