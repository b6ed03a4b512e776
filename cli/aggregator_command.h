// `fedmesh aggregator --config agg.toml`: the federation's central server
// (aggregator/server.h).
#pragma once

#include <CLI/CLI.hpp>

namespace fedmesh::cli {

void add_aggregator_command(CLI::App& app, int& exit_code);

}  // namespace fedmesh::cli
