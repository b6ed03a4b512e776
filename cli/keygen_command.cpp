#include "cli/keygen_command.h"

#include <cstdio>
#include <memory>
#include <string>

#include "cli/output.h"
#include "crypto/keys.h"

namespace fedmesh::cli {

namespace {

struct KeygenFlags {
  std::string name;
  std::string out = ".";
  bool json = false;
};

int fail(const KeygenFlags& flags, const Status& status) {
  return report_failure("keygen", flags.json, status, 2);
}

int run_keygen(const KeygenFlags& flags) {
  Result<crypto::SiteKeys> keys = crypto::generate_site_keys(flags.name);
  if (!keys.is_ok()) return fail(flags, invalid_argument("--name: " + keys.status().message()));
  const std::filesystem::path dir = flags.out;
  if (Status s = crypto::write_site_keys(*keys, dir); !s.is_ok()) return fail(flags, s);
  const std::string key_file = (dir / (flags.name + ".key")).string();
  const std::string pub_file = (dir / (flags.name + ".pub")).string();
  const crypto::PublicIdentity& identity = keys->identity;
  if (flags.json) {
    emit_json({{"event", "summary"},
               {"command", "keygen"},
               {"name", identity.name},
               {"sign_public", crypto::to_hex(identity.sign_public)},
               {"box_public", crypto::to_hex(identity.box_public)},
               {"key_file", key_file},
               {"pub_file", pub_file}});
    return 0;
  }
  std::fprintf(stderr, "wrote %s (secret, mode 0600: keep it on this machine) and %s (public)\n", key_file.c_str(),
               pub_file.c_str());
  std::printf("%s", crypto::format_public_identity(identity).c_str());
  return 0;
}

}  // namespace

void add_keygen_command(CLI::App& app, int& exit_code) {
  auto flags = std::make_shared<KeygenFlags>();
  CLI::App* cmd = app.add_subcommand(
      "keygen",
      "Create a site identity: an Ed25519 pair that signs updates (and, for the admin, the roster) and a "
      "Curve25519 pair that encrypts transport (CurveZMQ). Writes DIR/NAME.key (secret, mode 0600, never "
      "overwritten) and DIR/NAME.pub (public: give it to the federation admin for the roster), and prints the "
      "public part.");
  cmd->add_option("--name", flags->name, "Site name: 1-64 of a-z 0-9 . _ -, starting with a letter or digit")
      ->required();
  cmd->add_option("--out", flags->out, "Directory for NAME.key and NAME.pub (created with mode 0700 if missing)")
      ->capture_default_str();
  cmd->add_flag("--json", flags->json, "Print one JSON object (name, sign_public, box_public, key_file, pub_file)");
  cmd->callback([flags, &exit_code] { exit_code = run_keygen(*flags); });
}

}  // namespace fedmesh::cli
