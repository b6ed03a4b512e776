// `fedmesh tokenizer train`: a byte-level BPE tokenizer trained on a text
// corpus (train/data/bpe_tokenizer.h), written to a file that `fedmesh train
// --model gpt-* --tokenizer FILE` uses instead of the byte tokenizer.
#pragma once

#include <CLI/CLI.hpp>

namespace fedmesh::cli {

void add_tokenizer_command(CLI::App& app, int& exit_code);

}  // namespace fedmesh::cli
