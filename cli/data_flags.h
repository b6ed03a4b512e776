// The flags that describe own data, the same in every command that reads
// it (`fedmesh train`, `fedmesh sim`, `fedmesh stats compute`): everything
// of a train::data::DataSource but --data itself, whose help says what each
// command takes.
#pragma once

#include <CLI/CLI.hpp>

#include "train/data/data_source.h"

namespace fedmesh::cli {

// --test-data, --test-fraction, --label, --task, --image-size, --channels.
void add_own_data_flags(CLI::App* cmd, train::data::DataSource& data);

}  // namespace fedmesh::cli
