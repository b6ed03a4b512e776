#include "cli/app.h"

#include <CLI/CLI.hpp>

#include "base/open_file_limit.h"

#include "cli/aggregator_command.h"
#include "cli/checkpoint_command.h"
#include "cli/doctor_command.h"
#include "cli/generate_command.h"
#include "cli/keygen_command.h"
#include "cli/node_command.h"
#include "cli/privacy_command.h"
#include "cli/provision_command.h"
#include "cli/roster_command.h"
#include "cli/sim_command.h"
#include "cli/status_command.h"
#include "cli/tokenizer_command.h"
#include "cli/train_command.h"

namespace fedmesh::cli {

int run_fedmesh(int argc, char** argv, const node::SecureUploadFaults& faults) {
  // Every role holds a descriptor per connection: take all the system
  // allows before any is opened (where it cannot be raised, the process
  // runs with what it has, and `fedmesh doctor` shows it).
  (void)raise_open_file_limit();
  CLI::App app{
      "fedmesh: federated and decentralized training. Each site trains on its own data and shares only "
      "compressed, signed, encrypted model updates.\n"
      "Start with `fedmesh train --model cnn` (local training on Fashion-MNIST) or `fedmesh doctor`.",
      "fedmesh"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "fedmesh 0.1.0");
  int exit_code = 0;
  add_train_command(app, exit_code);
  add_doctor_command(app, exit_code);
  add_keygen_command(app, exit_code);
  add_roster_command(app, exit_code);
  add_checkpoint_command(app, exit_code);
  add_sim_command(app, exit_code);
  add_aggregator_command(app, exit_code);
  add_node_command(app, exit_code, faults);
  add_status_command(app, exit_code);
  add_generate_command(app, exit_code);
  add_privacy_command(app, exit_code);
  add_provision_command(app, exit_code);
  add_tokenizer_command(app, exit_code);
  CLI11_PARSE(app, argc, argv);
  return exit_code;
}

}  // namespace fedmesh::cli
