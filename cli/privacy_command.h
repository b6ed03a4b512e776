// `fedmesh privacy report DB`: the privacy budget a store's run has spent,
// round by round, from its ledger (store/checkpoint_store.h).
#pragma once

#include <CLI/CLI.hpp>

namespace fedmesh::cli {

void add_privacy_command(CLI::App& app, int& exit_code);

}  // namespace fedmesh::cli
