#include "cli/data_flags.h"

namespace fedmesh::cli {

void add_own_data_flags(CLI::App* cmd, train::data::DataSource& data) {
  cmd->add_option("--test-data", data.test,
                  "Own data: the test set, in the same format (csv:FILE2, images:DIR2, arrays:FILE2); without it "
                  "--test-fraction of --data is held out");
  cmd->add_option("--test-fraction", data.test_fraction,
                  "Own data without --test-data: the share held out for testing (a seeded split)")
      ->capture_default_str();
  cmd->add_option("--label", data.label, "Tables: the label column's name");
  cmd->add_option("--task", data.task,
                  "classification (class ids, cross-entropy, accuracy) or regression (tables: the label column is "
                  "a number; squared error, reported as R², MAE and RMSE in its units)")
      ->capture_default_str();
  cmd->add_option("--image-size", data.image_size,
                  "Image folders: every image center-cropped to a square and resized to N x N")
      ->capture_default_str();
  cmd->add_option("--channels", data.channels, "Image folders: 1 (gray) or 3 (RGB)")->capture_default_str();
}

}  // namespace fedmesh::cli
