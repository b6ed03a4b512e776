#include "train/hf_gpt2.h"

#include <cctype>

namespace fedmesh::train {

namespace {

constexpr std::string_view kPrefix = "transformer.";

bool conv1d(std::string_view rest) {
  return rest == "attn.c_attn.weight" || rest == "attn.c_proj.weight" || rest == "mlp.c_fc.weight" ||
         rest == "mlp.c_proj.weight";
}

// The block number and the rest of "N.rest" (digits, a dot), or false.
bool split_block(std::string_view text, std::string_view& number, std::string_view& rest) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  if (digits == 0 || digits >= text.size() || text[digits] != '.') return false;
  number = text.substr(0, digits);
  rest = text.substr(digits + 1);
  return true;
}

}  // namespace

HfGpt2Name from_hf_gpt2(std::string_view hf_name) {
  std::string_view name = hf_name;
  if (name.starts_with(kPrefix)) name.remove_prefix(kPrefix.size());
  if (name == "lm_head.weight") return {};
  std::string_view number, rest;
  if (!name.starts_with("h.") || !split_block(name.substr(2), number, rest)) return {std::string(name), false};
  if (rest == "attn.bias" || rest == "attn.masked_bias") return {};
  std::string mapped = "h";
  mapped.append(number).append(".").append(rest);
  return {mapped, conv1d(rest)};
}

std::vector<HfGpt2Name> to_hf_gpt2(std::string_view fedmesh_name) {
  std::string_view number, rest;
  if (fedmesh_name.starts_with("h") && split_block(fedmesh_name.substr(1), number, rest)) {
    std::string mapped(kPrefix);
    mapped.append("h.").append(number).append(".").append(rest);
    return {{mapped, conv1d(rest)}};
  }
  std::string mapped(kPrefix);
  mapped.append(fedmesh_name);
  if (fedmesh_name == "wte.weight") return {{mapped, false}, {"lm_head.weight", false}};
  return {{mapped, false}};
}

}  // namespace fedmesh::train
