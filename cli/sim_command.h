// `fedmesh sim`: a whole federation in one process (sim/simulation.h).
#pragma once

#include <CLI/CLI.hpp>

namespace fedmesh::cli {

void add_sim_command(CLI::App& app, int& exit_code);

}  // namespace fedmesh::cli
