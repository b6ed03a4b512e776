#include "cli/app.h"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>

#include "base/open_file_limit.h"

#include "cli/aggregator_command.h"
#include "cli/checkpoint_command.h"
#include "cli/doctor_command.h"
#include "cli/generate_command.h"
#include "cli/keygen_command.h"
#include "cli/node_command.h"
#include "cli/privacy_command.h"
#include "cli/stats_command.h"
#include "cli/model_command.h"
#include "cli/provision_command.h"
#include "cli/roster_command.h"
#include "cli/sim_command.h"
#include "cli/status_command.h"
#include "cli/tokenizer_command.h"
#include "cli/train_command.h"

namespace fedmesh::cli {

namespace {

// The deepest subcommand the arguments reached, and its name from the top
// ("fedmesh", "fedmesh sim", "fedmesh roster add"), for the hint after an
// error.
const CLI::App* command_reached(const CLI::App& app, std::string& name) {
  name = app.get_name();
  const CLI::App* at = &app;
  for (;;) {
    const std::vector<const CLI::App*> parsed = at->get_subcommands([](const CLI::App* sub) { return sub->parsed(); });
    if (parsed.empty()) return at;
    at = parsed.front();
    name += " " + at->get_name();
  }
}

// Every argument error: one line on stderr and exit status 2 (help and
// --version exit 0 as CLI11 prints them).
int report_parse_error(CLI::App& app, const CLI::ParseError& error) {
  if (error.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(error);
  std::string message = error.what();
  std::string command;
  const CLI::App* at = command_reached(app, command);
  if (dynamic_cast<const CLI::RequiredError*>(&error) != nullptr && message.find("subcommand") != std::string::npos) {
    std::string names;
    for (const CLI::App* sub : at->get_subcommands([](const CLI::App*) { return true; })) {
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    const std::vector<std::string> rest = app.remaining();
    message = rest.empty() ? "a command is required (" + names + ")"
                           : "unknown command '" + rest.front() + "' (" + names + ")";
  }
  for (char& c : message) {
    if (c == '\n') c = ' ';
  }
  std::fprintf(stderr, "%s: error: %s (see `%s --help`)\n", command.c_str(), message.c_str(), command.c_str());
  return 2;
}

}  // namespace

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
  add_stats_command(app, exit_code);
  add_model_command(app, exit_code);
  add_provision_command(app, exit_code);
  add_tokenizer_command(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return report_parse_error(app, error);
  }
  return exit_code;
}

}  // namespace fedmesh::cli
