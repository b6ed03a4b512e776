// The fedmesh command line: every subcommand on one CLI::App, run on argv.
#pragma once

#include "node/site_runtime.h"

namespace fedmesh::cli {

// Parses argv and runs the subcommand; returns the process's exit code.
// `faults` reach a private-mode site's upload: the shipped binary passes
// none, a build for tests passes what its own flags say
// (tests/support/fedmesh_with_faults.cpp).
int run_fedmesh(int argc, char** argv, const node::SecureUploadFaults& faults = {});

}  // namespace fedmesh::cli
