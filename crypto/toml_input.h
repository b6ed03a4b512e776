// The one way crypto/ reads TOML (key files, the roster): toml++ throws, so
// this adapter turns its errors into a Status naming the input, line and
// column, after refusing input shaped to overflow toml++'s stack.
#pragma once

#include <string_view>

#include <toml++/toml.h>

#include "base/status.h"

namespace fedmesh::crypto {

// `what` names the input in messages ("roster", a file path).
Result<toml::table> parse_toml(std::string_view text, std::string_view what);

}  // namespace fedmesh::crypto
