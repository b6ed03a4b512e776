// `fedmesh checkpoint list|show|verify|export DB`: an operator's view of a
// checkpoint store (store/checkpoint_store.h) without starting a run.
#pragma once

#include <CLI/CLI.hpp>

namespace fedmesh::cli {

void add_checkpoint_command(CLI::App& app, int& exit_code);

}  // namespace fedmesh::cli
