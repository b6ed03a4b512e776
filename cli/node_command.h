// `fedmesh node --config site.toml`: one institution's site (node/site_runtime.h).
#pragma once

#include <CLI/CLI.hpp>

#include "node/site_runtime.h"

namespace fedmesh::cli {

// `faults`: only the command line built for tests passes any (cli/app.h).
void add_node_command(CLI::App& app, int& exit_code, const node::SecureUploadFaults& faults = {});

}  // namespace fedmesh::cli
