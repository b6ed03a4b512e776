// `fedmesh keygen`: a site identity (signing and transport key pairs) in
// NAME.key (secret, 0600) and NAME.pub (what goes on the roster).
#pragma once

#include <CLI/CLI.hpp>

namespace fedmesh::cli {

void add_keygen_command(CLI::App& app, int& exit_code);

}  // namespace fedmesh::cli
