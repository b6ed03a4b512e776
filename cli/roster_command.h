// `fedmesh roster init|add|sign|verify`: the signed list of who may take part
// in a federation, with their keys, roles and addresses.
#pragma once

#include <CLI/CLI.hpp>

namespace fedmesh::cli {

void add_roster_command(CLI::App& app, int& exit_code);

}  // namespace fedmesh::cli
