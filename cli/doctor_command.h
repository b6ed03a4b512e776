// `fedmesh doctor`: what this build and this machine have.
#pragma once

#include <CLI/CLI.hpp>

namespace fedmesh::cli {

void add_doctor_command(CLI::App& app, int& exit_code);

}  // namespace fedmesh::cli
