// The process's limit on open file descriptors. Every connection a peer or
// a stranger opens (ZeroMQ, HTTP) holds one until it is closed, as do the
// store's files; the common soft limit of 1024 is within reach of anyone
// who can open connections, and a store that cannot open a file stops the
// process. The soft limit may be raised to the hard one without privilege.
#pragma once

#include <cstdint>

#include "base/status.h"

namespace fedmesh {

struct OpenFileLimit {
  uint64_t soft = 0;  // RLIM_INFINITY reads as UINT64_MAX
  uint64_t hard = 0;
};

// The limit as it stands; kUnavailable if it cannot be read.
Result<OpenFileLimit> open_file_limit();

// Raises the soft limit to the hard one (never lowers it) and returns the
// limit in force afterwards; kUnavailable naming the failure otherwise, with
// the limit unchanged.
Result<OpenFileLimit> raise_open_file_limit();

}  // namespace fedmesh
