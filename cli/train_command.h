// `fedmesh train`: local training of a built-in model on Fashion-MNIST.
#pragma once

#include <CLI/CLI.hpp>

namespace fedmesh::cli {

// Registers the subcommand on `app`; it runs from the app's callback.
void add_train_command(CLI::App& app, int& exit_code);

}  // namespace fedmesh::cli
