// How fast is update compression on the CPU, next to memcpy measured in the
// same run? (compress + decompress of a 100M-element fp32 tensor per
// method, in GB/s; target for int8 and top-k: at least 25 % of memcpy.)
//
//   memcpy       std::memcpy of the tensor's 4N bytes into a buffer already
//                faulted in, one thread (the ceiling the target is set against); the
//                same copy split over --threads is printed for reference
//   compress     UpdateCompressor::compress on one tensor {"w", {N}}: check
//                finite, a = e + delta, encode, decode the bytes again with
//                the codec and e <- a - D(C(a)) (error feedback included)
//   decompress   the receiver: decode_segment of every segment into its
//                staging buffer (zeroed outside the timing), one segment after
//                another as chunks arrive, each written on every core, as
//                UpdateReceiver does
//                (--parallel-decode splits the segments over --threads
//                instead; --accumulate adds each segment with weight 1 into
//                the buffer with accumulate_segment, as the simulator folds
//                PowerSGD's factors)
//
// GB/s = 4N bytes / seconds (1 GB = 1e9 bytes) whatever the method sends, so
// the columns compare directly; compress+decompress = 4N / (t_c + t_d).
// Every time is the best of --repeats runs (the compressor keeps its state:
// repeat r compresses the same delta in round r). The input: N seeded
// Gaussian values of scale 0.01.
//
// dct-sign runs on --slow-elements (default 10M) unless --skip-slow drops it;
// its GB/s use its own N. powersgd:R runs on a --powersgd-side x side matrix
// (default 10000 x 10000 = 100M) through begin / powersgd_p / the
// aggregator's orthonormalization of P (one site: the mean is its own P) /
// finish, with the shared Q warm-started from the last repeat's Q; its
// decompress is the receiver's accumulate of Q plus P Q^T. A plain program;
// see --help.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/random.h"
#include "kernels/compression_kernels.h"
#include "kernels/parallel.h"
#include "protocol/codec.h"
#include "protocol/compression_spec.h"
#include "protocol/compressor.h"

namespace {

using Clock = std::chrono::steady_clock;
using fedmesh::protocol::CompressedUpdate;
using fedmesh::protocol::EncodedSegment;
using fedmesh::protocol::TensorShape;

constexpr const char* kProgram = "bench_compression";
constexpr double kTargetFraction = 0.25;  // the target: int8 and top-k at >= 25 % of memcpy
constexpr const char* kDefaultMethods =
    "identity,fp16,bf16,int8,int4,int8:stochastic,topk:0.01+fp16,topk:0.01+int8,topk:0.001+int8,dct-sign:32,powersgd:4";

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

double peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

double median(std::vector<double> xs) {
  std::sort(xs.begin(), xs.end());
  const size_t n = xs.size();
  return n % 2 == 1 ? xs[n / 2] : 0.5 * (xs[n / 2 - 1] + xs[n / 2]);
}

double best(const std::vector<double>& xs) { return *std::min_element(xs.begin(), xs.end()); }

struct Options {
  int64_t elements = 100'000'000;
  int64_t slow_elements = 10'000'000;
  int64_t powersgd_side = 10'000;
  int repeats = 3;
  int threads = 0;  // 0: every core
  bool skip_slow = false;
  bool parallel_decode = false;
  bool accumulate = false;
  bool no_error_feedback = false;
  std::vector<std::string> methods;
};

void print_usage(std::FILE* out) {
  std::fprintf(out,
               "Usage: %s [options]\n"
               "\n"
               "Compress + decompress of one fp32 tensor per compression method on the CPU,\n"
               "in GB/s of fp32 input (4N bytes), next to memcpy of the same bytes in the same run.\n"
               "\n"
               "  --elements N        tensor size (default 100000000)\n"
               "  --repeats R         runs per measurement; the best is reported (default 3)\n"
               "  --methods LIST      comma-separated compression specs (default:\n"
               "                      %s)\n"
               "  --threads T         kernel threads (set_cpu_threads; default: every core)\n"
               "  --skip-slow         leave out dct-sign\n"
               "  --slow-elements M   tensor size for dct-sign (default 10000000)\n"
               "  --powersgd-side S   powersgd runs on an S x S matrix (default 10000)\n"
               "  --no-error-feedback compress is C(a) alone (the method's TensorCompressor), without\n"
               "                      forming a = e + delta and the new residual (not for powersgd)\n"
               "  --parallel-decode   decompress the segments on --threads threads instead of\n"
               "                      one after another as the receiver does\n"
               "  --accumulate        decompress adds into the target (accumulate_segment, weight 1)\n"
               "                      instead of decoding into it (decode_segment, the receiver's)\n"
               "  --help\n",
               kProgram, kDefaultMethods);
}

std::vector<std::string> split_list(std::string_view text) {
  std::vector<std::string> items;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    if (comma > start) items.emplace_back(text.substr(start, comma - start));
    start = comma + 1;
  }
  return items;
}

// nullopt to go on, else the exit code.
std::optional<int> parse_options(int argc, char** argv, Options& o) {
  std::string methods = kDefaultMethods;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--help") {
      print_usage(stdout);
      return 0;
    } else if (arg == "--elements" && has_value) {
      o.elements = std::atoll(argv[++i]);
    } else if (arg == "--slow-elements" && has_value) {
      o.slow_elements = std::atoll(argv[++i]);
    } else if (arg == "--powersgd-side" && has_value) {
      o.powersgd_side = std::atoll(argv[++i]);
    } else if (arg == "--repeats" && has_value) {
      o.repeats = std::atoi(argv[++i]);
    } else if (arg == "--threads" && has_value) {
      o.threads = std::atoi(argv[++i]);
    } else if (arg == "--methods" && has_value) {
      methods = argv[++i];
    } else if (arg == "--skip-slow") {
      o.skip_slow = true;
    } else if (arg == "--no-error-feedback") {
      o.no_error_feedback = true;
    } else if (arg == "--parallel-decode") {
      o.parallel_decode = true;
    } else if (arg == "--accumulate") {
      o.accumulate = true;
    } else {
      std::fprintf(stderr, "%s: unknown or incomplete option '%s'\n", kProgram, arg.c_str());
      print_usage(stderr);
      return 2;
    }
  }
  o.methods = split_list(methods);
  if (o.elements < 1 || o.slow_elements < 1 || o.powersgd_side < 1 || o.repeats < 1 || o.threads < 0 ||
      o.methods.empty()) {
    std::fprintf(stderr, "%s: --elements, --slow-elements, --powersgd-side and --repeats must be positive, "
                         "--threads >= 0, --methods not empty\n", kProgram);
    return 2;
  }
  return std::nullopt;
}

std::vector<float> gaussian(int64_t n, uint64_t seed) {
  std::vector<float> x(static_cast<size_t>(n));
  fedmesh::Rng rng(seed);
  for (float& v : x) v = static_cast<float>(rng.normal() * 0.01);
  return x;
}

// ---- the baseline ----------------------------------------------------------------

struct Baseline {
  double one_thread_gbs = 0.0;
  double threads_gbs = 0.0;
};

Baseline measure_memcpy(std::span<const float> source, std::span<float> destination, int repeats) {
  const size_t bytes = source.size() * sizeof(float);
  std::vector<double> one, many;
  for (int r = 0; r < repeats; ++r) {
    auto start = Clock::now();
    std::memcpy(destination.data(), source.data(), bytes);
    one.push_back(seconds_since(start));
    start = Clock::now();
    fedmesh::parallel_for(static_cast<int64_t>(source.size()), 1 << 16, [&](int64_t begin, int64_t end) {
      std::memcpy(destination.data() + begin, source.data() + begin, static_cast<size_t>(end - begin) * sizeof(float));
    });
    many.push_back(seconds_since(start));
  }
  volatile float keep = destination[destination.size() / 2];
  (void)keep;
  return {static_cast<double>(bytes) / best(one) / 1e9, static_cast<double>(bytes) / best(many) / 1e9};
}

// ---- one method ------------------------------------------------------------------

struct Row {
  std::string method;
  int64_t elements = 0;
  uint64_t bytes_sent = 0;
  std::vector<double> compress_s, decompress_s, total_s;
  std::string note;
};

// The receiver: every segment accumulated, weight 1, into target (zeroed by the caller).
// One segment into the target: the receiver's decode (its parts written on
// every core, as UpdateReceiver passes parallel_each), or an accumulation.
fedmesh::Status apply_one(const EncodedSegment& segment, std::span<const TensorShape> manifest,
                          std::span<float> target, bool accumulate) {
  return accumulate ? fedmesh::protocol::accumulate_segment(segment.view(), manifest, 1.0f, target)
                    : fedmesh::protocol::decode_segment(segment.view(), manifest, target, fedmesh::parallel_each);
}

fedmesh::Status decompress_all(const std::vector<const EncodedSegment*>& segments,
                               std::span<const TensorShape> manifest, std::span<float> target, const Options& o) {
  if (!o.parallel_decode) {
    for (const EncodedSegment* segment : segments) {
      FEDMESH_RETURN_IF_ERROR(apply_one(*segment, manifest, target, o.accumulate));
    }
    return fedmesh::Status::ok();
  }
  // Segments of one tensor cover disjoint ranges: any split of them is safe.
  std::vector<fedmesh::Status> failures(segments.size(), fedmesh::Status::ok());
  fedmesh::parallel_for(static_cast<int64_t>(segments.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      failures[static_cast<size_t>(i)] = apply_one(*segments[static_cast<size_t>(i)], manifest, target, o.accumulate);
    }
  });
  for (const fedmesh::Status& status : failures) FEDMESH_RETURN_IF_ERROR(status);
  return fedmesh::Status::ok();
}

std::vector<const EncodedSegment*> segments_of(const CompressedUpdate& update) {
  std::vector<const EncodedSegment*> segments;
  for (const auto& tensor : update.tensors) {
    for (const EncodedSegment& segment : tensor.segments) segments.push_back(&segment);
  }
  return segments;
}

void zero(std::span<float> target) {
  fedmesh::parallel_for(static_cast<int64_t>(target.size()), 1 << 16, [&](int64_t begin, int64_t end) {
    std::memset(target.data() + begin, 0, static_cast<size_t>(end - begin) * sizeof(float));
  });
}

// Compresses delta `repeats` times with a fresh compressor; target is scratch of delta's size.
fedmesh::Result<Row> run_method(const std::string& method, std::span<const float> delta, std::span<float> target,
                                const Options& o) {
  Row row;
  row.method = method;
  row.elements = static_cast<int64_t>(delta.size());
  fedmesh::Result<fedmesh::protocol::CompressionPlan> plan = fedmesh::protocol::make_compression_plan(method, {}, 0);
  if (!plan.is_ok()) return plan.status();
  std::vector<TensorShape> manifest = {{"w", {static_cast<int64_t>(delta.size())}}};
  fedmesh::Result<fedmesh::protocol::UpdateCompressor> compressor = fedmesh::protocol::UpdateCompressor::create(
      *plan, manifest, /*seed=*/42, fedmesh::kernels::cpu_compression_kernels());
  if (!compressor.is_ok()) return compressor.status();
  const std::span<const float> spans[] = {delta};
  fedmesh::Result<std::unique_ptr<fedmesh::protocol::TensorCompressor>> alone =
      fedmesh::protocol::make_tensor_compressor(plan->default_spec, manifest[0],
                                                fedmesh::kernels::cpu_compression_kernels(),
                                                fedmesh::protocol::kDefaultChunkBytes);
  if (!alone.is_ok()) return alone.status();
  for (int r = 0; r < o.repeats; ++r) {
    auto start = Clock::now();
    fedmesh::Result<CompressedUpdate> compressed = fedmesh::invalid_argument("unreached");
    if (o.no_error_feedback) {  // C(a) alone
      fedmesh::Result<fedmesh::protocol::EncodedTensor> encoded = (*alone)->compress(0, delta, 0, 42);
      if (!encoded.is_ok()) return encoded.status();
      CompressedUpdate update;
      for (const EncodedSegment& segment : encoded->segments) update.payload_bytes += segment.payload_bytes();
      update.tensors.push_back(std::move(*encoded));
      compressed = std::move(update);
    } else {
      compressed = compressor->compress(spans, /*want_decoded=*/false);
    }
    const double t_c = seconds_since(start);
    if (!compressed.is_ok()) return compressed.status();
    compressed->decoded.clear();  // the sender's copy of D(C(a)): 4N bytes the receiver never sees
    compressed->decoded.shrink_to_fit();
    row.bytes_sent = compressed->payload_bytes;
    zero(target);
    const std::vector<const EncodedSegment*> segments = segments_of(*compressed);
    start = Clock::now();
    FEDMESH_RETURN_IF_ERROR(decompress_all(segments, manifest, target, o));
    const double t_d = seconds_since(start);
    row.compress_s.push_back(t_c);
    row.decompress_s.push_back(t_d);
    row.total_s.push_back(t_c + t_d);
  }
  return row;
}

// PowerSGD on a side x side matrix: P and Q both travel (n + m) r fp32.
fedmesh::Result<Row> run_powersgd(const std::string& method, std::span<const float> delta, std::span<float> target,
                                  int64_t side, const Options& o) {
  Row row;
  row.method = method;
  row.elements = side * side;
  fedmesh::Result<fedmesh::protocol::CompressionPlan> plan = fedmesh::protocol::make_compression_plan(method, {}, 0);
  if (!plan.is_ok()) return plan.status();
  const int64_t rows = side, cols = side, rank = plan->default_spec.rank;
  std::vector<TensorShape> manifest = {{"w", {rows, cols}}};
  fedmesh::kernels::CompressionKernels& kernels = fedmesh::kernels::cpu_compression_kernels();
  fedmesh::Result<fedmesh::protocol::UpdateCompressor> compressor =
      fedmesh::protocol::UpdateCompressor::create(*plan, manifest, /*seed=*/42, kernels);
  if (!compressor.is_ok()) return compressor.status();
  if (compressor->powersgd_tensors().size() != 1) {
    return fedmesh::invalid_argument(method + " did not make the tensor a PowerSGD tensor");
  }
  const std::vector<TensorShape> q_manifest = {{fedmesh::protocol::powersgd_factor_name("w", 'q'), {cols, rank}}};
  std::vector<std::vector<float>> shared_q = {gaussian(cols * rank, 99)};
  std::vector<float> q(static_cast<size_t>(cols * rank));
  const std::span<const float> spans[] = {delta.first(static_cast<size_t>(rows * cols))};
  for (int r = 0; r < o.repeats; ++r) {
    auto start = Clock::now();
    FEDMESH_RETURN_IF_ERROR(compressor->begin(spans));
    fedmesh::Result<std::vector<std::vector<float>>> p = compressor->powersgd_p(shared_q);
    if (!p.is_ok()) return p.status();
    kernels.orthonormalize_columns((*p)[0], rows, rank);  // the aggregator's step, for its one site
    fedmesh::Result<CompressedUpdate> compressed = compressor->finish(*p, /*want_decoded=*/false);
    const double t_c = seconds_since(start);
    if (!compressed.is_ok()) return compressed.status();
    compressed->decoded.clear();
    compressed->decoded.shrink_to_fit();
    row.bytes_sent = compressed->payload_bytes + static_cast<uint64_t>(rows * rank) * sizeof(float);  // + P_i
    zero(target);
    std::fill(q.begin(), q.end(), 0.0f);
    const std::vector<const EncodedSegment*> segments = segments_of(*compressed);
    start = Clock::now();
    for (const EncodedSegment* segment : segments) {
      EncodedSegment local = *segment;  // the Q factor is its own tensor 0 on the receiver's side
      local.tensor = 0;
      FEDMESH_RETURN_IF_ERROR(fedmesh::protocol::accumulate_segment(local.view(), q_manifest, 1.0f, q));
    }
    kernels.matmul(false, true, rows, cols, rank, (*p)[0], q, target.first(static_cast<size_t>(rows * cols)));
    const double t_d = seconds_since(start);
    shared_q[0] = q;  // warm start, as the aggregator does with the mean Q
    row.compress_s.push_back(t_c);
    row.decompress_s.push_back(t_d);
    row.total_s.push_back(t_c + t_d);
  }
  row.note = "P_i + Q_i sent; compress includes orthonormalizing P, decompress is Q's accumulate + P Q^T";
  return row;
}

bool is_slow(const std::string& method) { return method.rfind("dct-sign", 0) == 0; }
bool is_powersgd(const std::string& method) { return method.rfind("powersgd", 0) == 0; }
bool in_target(const std::string& method) { return method == "int8" || method.rfind("topk", 0) == 0; }

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (const std::optional<int> exit_code = parse_options(argc, argv, o)) return *exit_code;
  fedmesh::set_cpu_threads(o.threads);
  const int64_t powersgd_elements = o.powersgd_side * o.powersgd_side;
  int64_t largest = o.elements;
  for (const std::string& method : o.methods) {
    if (is_powersgd(method)) largest = std::max(largest, powersgd_elements);
    if (is_slow(method) && !o.skip_slow) largest = std::max(largest, o.slow_elements);
  }

  const auto generate_start = Clock::now();
  const std::vector<float> delta = gaussian(largest, 7);
  std::vector<float> target(static_cast<size_t>(largest), 0.0f);  // faulted in: memcpy's destination, then decompress's
  const double generate_s = seconds_since(generate_start);
  const std::span<const float> main_delta(delta.data(), static_cast<size_t>(o.elements));

  const Baseline baseline =
      measure_memcpy(main_delta, std::span<float>(target.data(), main_delta.size()), o.repeats);
  const double n_bytes = static_cast<double>(o.elements) * 4.0;
  std::printf("%lld fp32 elements (%.0f MB), Gaussian scale 0.01 (generated in %.1f s), %d threads, best of %d "
              "runs, decompress %s\n",
              static_cast<long long>(o.elements), n_bytes / 1e6, generate_s, fedmesh::cpu_threads(), o.repeats,
              o.parallel_decode ? "with the segments split over the threads" : "one segment after another");
  std::printf("decompress: %s\n", o.accumulate ? "accumulate_segment into the target, weight 1 (--accumulate)"
                                                : "decode_segment into the receiver's staging buffer");
  std::printf("compress: %s\n", o.no_error_feedback ? "C(a) alone (--no-error-feedback)"
                                                     : "UpdateCompressor::compress: a = e + delta, C(a), the new residual");
  std::printf("memcpy of %.0f MB: %.2f GB/s on 1 thread (the baseline), %.2f GB/s on %d threads\n\n", n_bytes / 1e6,
              baseline.one_thread_gbs, baseline.threads_gbs, fedmesh::cpu_threads());
  std::printf("%-17s %11s %13s %9s %9s %9s %9s %8s %8s\n", "method", "elements", "bytes sent", "reduction",
              "compress", "decomp", "c+d GB/s", "c+d med", "vs memcpy");
  std::printf("%-17s %11s %13s %9s %9s %9s %9s %8s %8s\n", "", "", "", "vs 4N", "GB/s", "GB/s", "(best)", "GB/s",
              "(1 thr)");

  std::vector<Row> rows;
  for (const std::string& method : o.methods) {
    if (is_slow(method) && o.skip_slow) {
      std::printf("%-17s skipped (--skip-slow)\n", method.c_str());
      continue;
    }
    fedmesh::Result<Row> row = fedmesh::invalid_argument("unreached");
    if (is_powersgd(method) && o.no_error_feedback) {
      std::printf("%-17s skipped (--no-error-feedback: PowerSGD has no C(a) alone)\n", method.c_str());
      continue;
    }
    if (is_powersgd(method)) {
      row = run_powersgd(method, delta, target, o.powersgd_side, o);
    } else {
      const int64_t n = is_slow(method) ? o.slow_elements : o.elements;
      row = run_method(method, std::span<const float>(delta.data(), static_cast<size_t>(n)),
                       std::span<float>(target.data(), static_cast<size_t>(n)), o);
    }
    if (!row.is_ok()) {
      std::fprintf(stderr, "%s: %s: %s\n", kProgram, method.c_str(), row.status().to_string().c_str());
      return 1;
    }
    const double bytes = static_cast<double>(row->elements) * 4.0;
    const double c = bytes / best(row->compress_s) / 1e9;
    const double d = bytes / best(row->decompress_s) / 1e9;
    const double cd = bytes / best(row->total_s) / 1e9;
    const double cd_median = bytes / median(row->total_s) / 1e9;
    std::printf("%-17s %11lld %13llu %8.1fx %9.2f %9.2f %9.2f %8.2f %7.1f%%%s\n", method.c_str(),
                static_cast<long long>(row->elements), static_cast<unsigned long long>(row->bytes_sent),
                bytes / static_cast<double>(std::max<uint64_t>(row->bytes_sent, 1)), c, d, cd, cd_median,
                100.0 * cd / baseline.one_thread_gbs, row->elements != o.elements ? "  (own N)" : "");
    std::fflush(stdout);
    rows.push_back(std::move(*row));
  }

  std::printf("\ntimes (s), best of %d: compress / decompress\n", o.repeats);
  for (const Row& row : rows) {
    std::printf("  %-17s %8.3f / %8.3f%s%s\n", row.method.c_str(), best(row.compress_s), best(row.decompress_s),
                row.note.empty() ? "" : "   ", row.note.c_str());
  }
  // Block quantization's error-feedback step on its own: the fused pass
  // against the three passes it replaced (quantize, dequantize, subtract:
  // the backend's default), same input, same run.
  if (!o.no_error_feedback) {
    std::printf("\nerror feedback's block step on %lld elements (quantize, D(q), residual = a - D(q)), best of %d:\n",
                static_cast<long long>(o.elements), o.repeats);
    fedmesh::kernels::CompressionKernels& cpu = fedmesh::kernels::cpu_compression_kernels();
    std::vector<float> residual(main_delta.size()), scratch;
    for (const int bits : {8, 4}) {
      const fedmesh::kernels::BlockQuantization q{bits, 4096, fedmesh::kernels::Rounding::kNearest, 1};
      std::vector<uint8_t> packed(bits == 4 ? (main_delta.size() + 1) / 2 : main_delta.size());
      std::vector<float> scales((main_delta.size() + 4095) / 4096);
      std::vector<double> passes, fused;
      for (int r = 0; r < o.repeats; ++r) {
        auto start = Clock::now();
        cpu.CompressionKernels::quantize_blocks_with_residual(main_delta, q, packed, scales, residual, {}, scratch);
        passes.push_back(seconds_since(start));
        start = Clock::now();
        cpu.quantize_blocks_with_residual(main_delta, q, packed, scales, residual, {}, scratch);
        fused.push_back(seconds_since(start));
      }
      std::printf("  int%d: three passes %.3f s (%.2f GB/s, %.1f %% of memcpy), fused %.3f s (%.2f GB/s, %.1f %%): "
                  "%.2fx\n",
                  bits, best(passes), n_bytes / best(passes) / 1e9, 100.0 * n_bytes / best(passes) / 1e9 / baseline.one_thread_gbs,
                  best(fused), n_bytes / best(fused) / 1e9, 100.0 * n_bytes / best(fused) / 1e9 / baseline.one_thread_gbs,
                  best(passes) / best(fused));
    }
  }
  std::printf("peak RSS %.0f MB\n", peak_rss_mb());

  bool all_met = true, any = false;
  std::string verdict;
  for (const Row& row : rows) {
    if (!in_target(row.method)) continue;
    any = true;
    const double ratio = static_cast<double>(row.elements) * 4.0 / best(row.total_s) / 1e9 / baseline.one_thread_gbs;
    const bool met = ratio >= kTargetFraction;
    all_met = all_met && met;
    char piece[128];
    std::snprintf(piece, sizeof piece, "%s%s %.1f%% (%s)", verdict.empty() ? "" : ", ", row.method.c_str(),
                  100.0 * ratio, met ? "met" : "NOT met");
    verdict += piece;
  }
  if (any) {
    std::printf("target (int8 and top-k compress+decompress >= 25%% of 1-thread memcpy, %.2f GB/s): %s -> "
                "%s\n",
                baseline.one_thread_gbs, verdict.c_str(), all_met ? "MET" : "NOT MET");
  } else {
    std::printf("target: no int8 or top-k method was run\n");
  }
  return 0;
}
