// Where a node's data comes from, the one description every command takes
// (`--data` and friends on the command line, `data.*` in site and
// aggregator configs): the demo sets (Fashion-MNIST, a directory of IDX
// files, the text corpora) or the institution's own data:
//   csv:FILE     a table with a header row (train/data/table.h)
//   images:DIR   one folder of PNG/JPEG images per class (train/data/image_folder.h)
//   arrays:FILE  samples x and class ids y in a .npz, .npy or safetensors file (train/data/arrays.h)
//   tokens:FILE  llm.c / nanoGPT token shards, language models (train/data/token_shards.h)
//   jsonl:FILE   one JSON object with a "text" field per line, language models
// Own data is never split into demo shards: it is this node's data.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "base/status.h"
#include "base/toml_input.h"
#include "train/data/dataset.h"

namespace fedmesh::train::data {

struct DataSource {
  std::string source = "fashion-mnist";  // data.source / --data
  std::string test;                       // data.test / --test-data: csv:FILE or images:DIR ("": test_fraction of source)
  double test_fraction = 0.2;             // data.test_fraction / --test-fraction
  uint64_t seed = 0;                      // the split's seed (data.seed)
  // data.task / --task: "classification" (class ids, cross-entropy,
  // accuracy) or "regression" (a table's numeric label column, or arrays'
  // y, as a real-valued target: squared error, R² and MAE)
  std::string task = "classification";
  // Tables
  std::string label;                      // data.label / --label: the label column (regression: the target)
  std::map<std::string, std::vector<std::string>> categories;  // data.categories.COLUMN = [values]: one-hot, in this order
  std::vector<std::string> drop;          // data.drop: columns to ignore
  std::string missing = "refuse";         // data.missing: refuse | mean | zero
  // data.normalize: standard (this node's training part) | none (tables) |
  // stats:FILE (the federation's statistics, train/data/data_stats.h)
  std::string normalize = "standard";
  // Images
  int64_t image_size = 28;                // data.image_size / --image-size
  int64_t channels = 1;                   // data.channels / --channels: 1 or 3
  std::string cache;                      // data.cache: decoded images kept here ("": none)
  // Both: the class names in class-id order (data.classes); empty: sorted as found.
  std::vector<std::string> classes;

  // csv:... or images:...: the institution's own data.
  bool own() const;
  // The parts of the spec: "csv", "images" or "" (a demo set), and the path.
  std::string format() const;
  std::string path() const;
  bool regression() const { return task == "regression"; }
  Status validate() const;
};

// Whether a data spec names own data for the image and table models
// (csv:..., images:... or arrays:...), or pre-tokenized ids for the language models
// (tokens:FILE.bin, train/data/token_shards.h). jsonl:FILE is a text
// corpus (train/data/text_corpus.h).
bool is_own_data(const std::string& spec);
bool is_token_shard(const std::string& spec);

// Reads the data.* keys above (data.source included) into `source`.
void read_data_source(ConfigReader& reader, DataSource& source);

// Loads own data (own() must hold): the train and test parts, the schema
// and a description; train_limit / test_limit > 0 keep the first N samples.
// Every flaw in the files is a Status naming the file and the place.
Result<LoadedData> load_own_data(const DataSource& source, int64_t train_limit, int64_t test_limit);

}  // namespace fedmesh::train::data
