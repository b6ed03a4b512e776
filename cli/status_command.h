// `fedmesh status --aggregator HOST:PORT`: the federation at a glance, read
// from the aggregator's /status endpoint.
#pragma once

#include <CLI/CLI.hpp>

namespace fedmesh::cli {

void add_status_command(CLI::App& app, int& exit_code);

}  // namespace fedmesh::cli
