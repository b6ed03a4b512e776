// Hugging Face's GPT-2 state-dict layout against fedmesh's GPT names, both
// ways (`train --init-format hf-gpt2`, `checkpoint export --format
// hf-gpt2`). Hugging Face: `transformer.wte.weight`, `transformer.h.N.*`,
// `transformer.ln_f.*`, the four Conv1D weights per block stored (in, out),
// each block's causal-mask buffers `attn.bias` / `attn.masked_bias`, and
// `lm_head.weight` tied to wte. fedmesh: `wte.weight`, `hN.*`, `ln_f.*`,
// Linear weights (out, in), no buffers, the head tied.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace fedmesh::train {

struct HfGpt2Name {
  std::string name;
  bool transposed = false;  // a Conv1D weight: (in, out) there, (out, in) here
};

// The fedmesh parameter a Hugging Face array stands for ("" for the mask
// buffers and the tied head, which are no parameter here); names that are
// neither come back unchanged, to be refused by the caller.
HfGpt2Name from_hf_gpt2(std::string_view hf_name);

// The Hugging Face arrays a fedmesh parameter is written as: one, and for
// wte.weight also lm_head.weight (the tied head, which GPT2LMHeadModel's
// state dict holds). Names outside the GPT layout come back unchanged.
std::vector<HfGpt2Name> to_hf_gpt2(std::string_view fedmesh_name);

}  // namespace fedmesh::train
