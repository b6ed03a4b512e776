// `fedmesh node --config site.toml`: one institution's site (node/site/site_runtime.h).
#pragma once

#include <CLI/CLI.hpp>

namespace fedmesh::cli {

void add_node_command(CLI::App& app, int& exit_code);

}  // namespace fedmesh::cli
