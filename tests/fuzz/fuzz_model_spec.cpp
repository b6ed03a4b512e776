// libFuzzer target for the model spec parser (train/model_spec.h): the input
// bytes are a spec file's text. How to build and run it: tests/fuzz/README.md.
//
// For every input, besides "no crash, no sanitizer report, no hang":
//   - a rejection is kInvalidArgument with a non-empty message;
//   - an accepted spec is within the limits the builder relies on: 1 to
//     kMaxSpecLayers layers of known types with values in range (or a GPT
//     whose width its heads divide), names unique, only the model's last
//     linear without out, residual bodies of 1 to kMaxSpecLayers layers
//     with no residual inside;
//   - parsing the same text again gives the same canonical text and
//     fingerprint, and so does parsing the spec written back as a file
//     (to_toml).
// A violation prints what was wrong and traps, which libFuzzer reports as a
// crash and saves the input.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <string_view>

#include "train/model_spec.h"

namespace {

namespace train = fedmesh::train;

[[noreturn]] void violated(const std::string& what) {
  std::fprintf(stderr, "fuzz_model_spec: invariant violated: %s\n", what.c_str());
  __builtin_trap();
}

void check_layer(const train::LayerSpec& l, bool last, bool in_residual) {
  static const std::set<std::string> types = {"linear", "conv2d", "maxpool", "avgpool", "global_avgpool", "flatten",
                                              "relu",   "gelu",   "silu",    "layernorm", "dropout",
                                              "groupnorm", "residual"};
  if (types.count(l.type) == 0) violated("accepted layer type '" + l.type + "'");
  if (l.type == "linear" && (l.out < 0 || (l.out == 0 && !last))) violated("a linear without out before the last");
  if (l.type == "conv2d" && (l.out < 1 || l.kernel < 1 || l.stride < 1 || l.padding < 0 || l.padding >= l.kernel)) {
    violated("a conv2d out of range");
  }
  if ((l.type == "maxpool" || l.type == "avgpool") && (l.kernel < 1 || l.stride < 1)) violated("a pool out of range");
  if (l.type == "dropout" && !(l.p >= 0.0 && l.p < 1.0)) violated("a dropout p out of [0, 1)");
  if (l.type == "groupnorm" && l.groups < 1) violated("a groupnorm without groups");
  if (l.type == "residual") {
    if (in_residual) violated("a residual inside a residual");
    if (l.body.empty() || l.body.size() > train::kMaxSpecLayers) violated("a residual body's size out of range");
    for (const train::LayerSpec& inner : l.body) check_layer(inner, false, true);
  } else if (!l.body.empty()) {
    violated("a body on a " + l.type);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(bytes), size);
  fedmesh::Result<train::ModelSpec> parsed = train::parse_model_spec(text, "fuzz.toml", "fuzz");
  if (!parsed.is_ok()) {
    if (parsed.status().code() != fedmesh::StatusCode::kInvalidArgument) violated("rejected with another code");
    if (parsed.status().message().empty()) violated("rejected with an empty message");
    return 0;
  }
  const train::ModelSpec& spec = parsed.value();
  if (spec.gpt) {
    if (!spec.layers.empty()) violated("a GPT with layers");
    const auto& c = *spec.gpt;
    if (c.layers < 1 || c.heads < 1 || c.width < 1 || c.context < 1 || c.width % c.heads != 0 || c.vocabulary < 2) {
      violated("a GPT out of range");
    }
  } else {
    if (spec.layers.empty() || spec.layers.size() > train::kMaxSpecLayers) violated("a layer count out of range");
    std::set<std::string> names;
    for (size_t i = 0; i < spec.layers.size(); ++i) {
      check_layer(spec.layers[i], i + 1 == spec.layers.size(), false);
      if (!spec.layers[i].name.empty() && !names.insert(spec.layers[i].name).second) violated("a name used twice");
    }
  }
  fedmesh::Result<train::ModelSpec> again = train::parse_model_spec(text, "fuzz.toml", "fuzz");
  if (!again.is_ok() || again.value().canonical() != spec.canonical() || again.value().fingerprint() != spec.fingerprint()) {
    violated("the same text parsed to another spec");
  }
  fedmesh::Result<train::ModelSpec> written = train::parse_model_spec(spec.to_toml(), "fuzz.toml", "fuzz");
  if (!written.is_ok()) violated("to_toml does not parse: " + written.status().message() + "\n" + spec.to_toml());
  if (written.value().canonical() != spec.canonical()) violated("to_toml parses to another spec:\n" + spec.to_toml());
  return 0;
}
