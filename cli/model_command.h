// `fedmesh model show`: what a model name or spec file (train/model_spec.h)
// builds for a data set, and the --model check every command shares.
#pragma once

#include <CLI/CLI.hpp>

namespace fedmesh::cli {

void add_model_command(CLI::App& app, int& exit_code);

// --model: a built-in model's name or a spec file NAME.toml.
CLI::Validator model_name_check();

}  // namespace fedmesh::cli
