// `fedmesh stats`: the statistics a federation's nodes combine to normalize
// their own data the same way (train/data/data_stats.h).
#pragma once

#include <CLI/CLI.hpp>

namespace fedmesh::cli {

void add_stats_command(CLI::App& app, int& exit_code);

}  // namespace fedmesh::cli
