// libFuzzer target for the roster and .pub parsers (crypto/roster.h,
// crypto/keys.h): the input bytes are the file text. How to build and run
// it: tests/fuzz/README.md.
//
// For every input, besides "no crash, no sanitizer report, no unbounded
// allocation":
//   - a rejection has the code kCorrupt or kInvalidArgument and a message;
//   - an accepted roster is within its limits, formats to text that parses
//     back to an equal roster with the same canonical bytes, and
//     verify_roster runs on it (a fuzzed signature is almost surely bad, but
//     must be reported, not crash);
//   - an accepted .pub formats to text that parses back equal.
// A violation prints what was wrong and traps, which libFuzzer reports as a
// crash and saves the input.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include "crypto/keys.h"
#include "crypto/roster.h"

namespace {

using fedmesh::Status;
using fedmesh::StatusCode;
namespace crypto = fedmesh::crypto;

[[noreturn]] void violated(const std::string& what) {
  std::fprintf(stderr, "fuzz_roster: invariant violated: %s\n", what.c_str());
  __builtin_trap();
}

void check_rejection(const Status& status, const char* parser) {
  if (status.code() != StatusCode::kCorrupt && status.code() != StatusCode::kInvalidArgument) {
    violated(std::string(parser) + " rejected with code " + fedmesh::status_code_name(status.code()) + ": " +
             status.message());
  }
  if (status.message().empty()) violated(std::string(parser) + " rejected with an empty message");
}

bool same_roster(const crypto::Roster& a, const crypto::Roster& b) {
  return a.federation == b.federation && a.admin_public == b.admin_public && a.sites == b.sites &&
         a.signature == b.signature;
}

void check_roster(std::string_view text) {
  fedmesh::Result<crypto::Roster> parsed = crypto::parse_roster(text);
  if (!parsed.is_ok()) {
    check_rejection(parsed.status(), "parse_roster");
    return;
  }
  const crypto::Roster& roster = parsed.value();
  if (roster.sites.size() > crypto::kMaxRosterSites) violated("accepted more sites than kMaxRosterSites");
  for (const crypto::RosterEntry& site : roster.sites) {
    if (!crypto::check_site_name(site.identity.name).is_ok()) violated("accepted a bad site name");
    if (site.address.size() > crypto::kMaxAddressBytes) violated("accepted an address over kMaxAddressBytes");
  }
  const std::string formatted = crypto::format_roster(roster);
  fedmesh::Result<crypto::Roster> again = crypto::parse_roster(formatted);
  if (!again.is_ok()) violated("format_roster output does not parse: " + again.status().message() + "\n" + formatted);
  if (!same_roster(again.value(), roster)) violated("format_roster output parses to a different roster\n" + formatted);
  if (crypto::canonical_bytes(again.value()) != crypto::canonical_bytes(roster)) {
    violated("canonical bytes differ after a format/parse round trip");
  }
  // A random signature must be refused; only its verdict is not checked,
  // since an input may be a genuinely signed roster from the corpus.
  (void)crypto::verify_roster(roster, roster.admin_public).is_ok();
}

void check_public_identity(std::string_view text) {
  fedmesh::Result<crypto::PublicIdentity> parsed = crypto::parse_public_identity(text);
  if (!parsed.is_ok()) {
    check_rejection(parsed.status(), "parse_public_identity");
    return;
  }
  fedmesh::Result<crypto::PublicIdentity> again =
      crypto::parse_public_identity(crypto::format_public_identity(parsed.value()));
  if (!again.is_ok()) violated("format_public_identity output does not parse: " + again.status().message());
  if (!(again.value() == parsed.value())) violated("format_public_identity output parses to a different identity");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  check_roster(text);
  check_public_identity(text);
  return 0;
}
