#include "cli/doctor_command.h"

#include <cblas.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <thread>

#include "base/open_file_limit.h"
#include "cli/output.h"
#include "kernels/device_info.h"
#include "kernels/device_ops.h"
#include "train/data/fashion_mnist.h"

namespace fedmesh::cli {

namespace {

std::string version_string(int packed, int major_divisor, int minor_divisor) {
  if (packed <= 0) return "none";
  return std::to_string(packed / major_divisor) + "." + std::to_string((packed % major_divisor) / minor_divisor);
}

bool file_exists(const std::string& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0;
}

int run_doctor(bool json) {
  const CudaReport cuda = query_cuda();
  const std::string dataset_dir = train::data::kDefaultFashionMnistDir;
  const bool have_fashion = file_exists(dataset_dir + "/train-images-idx3-ubyte.gz") &&
                            file_exists(dataset_dir + "/t10k-images-idx3-ubyte.gz");
  const char* blas_config = openblas_get_config();
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  // (Raised to the hard limit at start; see base/open_file_limit.h.)
  Result<OpenFileLimit> files = open_file_limit();
  const auto limit_text = [](uint64_t value) {
    return value == UINT64_MAX ? std::string("unlimited") : std::to_string(value);
  };
  const std::string files_soft = files.is_ok() ? limit_text(files->soft) : "unknown";
  const std::string files_hard = files.is_ok() ? limit_text(files->hard) : "unknown";
  // The attention a GPT-2 (12 heads of 64) takes on the GPU in bf16: "flash"
  // (the fused kernels) or "gemm" (FEDMESH_ATTENTION=gemm, or a device they
  // do not run on); "none" without a GPU.
  const AttentionShape gpt2_heads{1, 1024, 12, 64};
  const std::string attention =
      cuda.gpus.empty() ? "none" : device::attention_path_name(device::attention_path(gpt2_heads, DType::kBF16));

  if (json) {
    nlohmann::json gpus = nlohmann::json::array();
    for (const GpuInfo& g : cuda.gpus) {
      gpus.push_back({{"index", g.index},
                      {"name", g.name},
                      {"compute_capability", std::to_string(g.compute_major) + "." + std::to_string(g.compute_minor)},
                      {"memory_bytes", g.memory_bytes}});
    }
    emit_json({{"event", "summary"},
               {"command", "doctor"},
               {"cpu_cores", cores},
               {"blas", std::string(blas_config)},
               {"cuda_compiled", cuda.compiled},
               {"cuda_runtime", version_string(cuda.runtime_version, 1000, 10)},
               {"cuda_driver", version_string(cuda.driver_version, 1000, 10)},
               {"cublas", version_string(cuda.cublas_version, 10000, 100)},
               {"nccl", version_string(cuda.nccl_version, 10000, 100)},
               {"gpu_count", cuda.gpus.size()},
               {"gpus", gpus},
               {"gpu_unavailable_reason", cuda.unavailable_reason},
               {"attention_path", attention},
               {"fashion_mnist", have_fashion ? dataset_dir : ""},
               {"open_files_soft", files_soft},
               {"open_files_hard", files_hard}});
    return 0;
  }
  std::printf("fedmesh doctor\n");
  std::printf("  CPU cores      %d\n", cores);
  std::printf("  BLAS           %s\n", blas_config);
  std::printf("  CUDA backend   %s\n", cuda.compiled ? "compiled" : "not compiled");
  if (cuda.compiled) {
    std::printf("  CUDA runtime   %s\n", version_string(cuda.runtime_version, 1000, 10).c_str());
    std::printf("  CUDA driver    %s\n", version_string(cuda.driver_version, 1000, 10).c_str());
    std::printf("  cuBLAS         %s\n", version_string(cuda.cublas_version, 10000, 100).c_str());
    std::printf("  NCCL           %s\n", version_string(cuda.nccl_version, 10000, 100).c_str());
  }
  std::printf("  GPUs           %zu\n", cuda.gpus.size());
  for (const GpuInfo& g : cuda.gpus) {
    std::printf("    [%d] %s, compute %d.%d, %.1f GiB\n", g.index, g.name.c_str(), g.compute_major, g.compute_minor,
                static_cast<double>(g.memory_bytes) / (1024.0 * 1024.0 * 1024.0));
  }
  if (cuda.gpus.empty()) std::printf("    (%s)\n", cuda.unavailable_reason.c_str());
  std::printf("  Attention      %s (GPT-2 heads in bf16 on the GPU; FEDMESH_ATTENTION=gemm forces the GEMM path)\n",
              attention.c_str());
  std::printf("  Fashion-MNIST  %s\n",
              have_fashion ? dataset_dir.c_str() : "missing: apt-get install dataset-fashion-mnist");
  std::printf("  Open files     %s (hard limit %s)\n", files_soft.c_str(), files_hard.c_str());
  return 0;
}

}  // namespace

void add_doctor_command(CLI::App& app, int& exit_code) {
  auto json = std::make_shared<bool>(false);
  CLI::App* cmd = app.add_subcommand("doctor", "Report what this build and this machine have: BLAS, CUDA, cuBLAS, "
                                               "NCCL, GPUs and data sets.");
  cmd->add_flag("--json", *json, "Print one JSON object");
  cmd->callback([json, &exit_code] { exit_code = run_doctor(*json); });
}

}  // namespace fedmesh::cli
