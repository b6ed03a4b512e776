// `fedmesh provision --federation federation.toml --out kits/`: from one
// description of a federation, the admin key (kits/admin/, made once and
// kept by the operator), the signed roster, and one startup kit per site and
// one for the aggregator: its own key pair and nobody else's secret, the
// signed roster, a ready config, a README for that institution's operator
// and start.sh. Running it again with sites added makes keys only for the
// new ones: every existing key (the admin's included) is kept, the roster is
// re-signed with the same admin key and every kit gets the new roster.
#pragma once

#include <CLI/CLI.hpp>

namespace fedmesh::cli {

void add_provision_command(CLI::App& app, int& exit_code);

}  // namespace fedmesh::cli
