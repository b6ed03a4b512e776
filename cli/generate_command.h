// `fedmesh generate`: samples text from a language model's checkpoint, so a
// person can see what it learned.
#pragma once

#include <CLI/CLI.hpp>

namespace fedmesh::cli {

void add_generate_command(CLI::App& app, int& exit_code);

}  // namespace fedmesh::cli
