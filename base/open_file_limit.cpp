#include "base/open_file_limit.h"

#include <sys/resource.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

namespace fedmesh {
namespace {

uint64_t as_count(rlim_t value) { return value == RLIM_INFINITY ? UINT64_MAX : static_cast<uint64_t>(value); }

}  // namespace

Result<OpenFileLimit> open_file_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return unavailable(std::string("cannot read the open-file limit: ") + std::strerror(errno));
  }
  return OpenFileLimit{as_count(limit.rlim_cur), as_count(limit.rlim_max)};
}

Result<OpenFileLimit> raise_open_file_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return unavailable(std::string("cannot read the open-file limit: ") + std::strerror(errno));
  }
  if (limit.rlim_cur == RLIM_INFINITY || (limit.rlim_max != RLIM_INFINITY && limit.rlim_cur >= limit.rlim_max)) {
    return open_file_limit();
  }
  rlimit raised = limit;
  raised.rlim_cur = limit.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) return open_file_limit();
  const int error = errno;
  if (limit.rlim_max == RLIM_INFINITY) {
    // An unlimited hard limit is more than the kernel gives one process
    // (fs.nr_open): that cap is the most there is.
    std::ifstream nr_open("/proc/sys/fs/nr_open");
    uint64_t cap = 0;
    if (nr_open >> cap && cap > limit.rlim_cur) {
      raised.rlim_cur = static_cast<rlim_t>(cap);
      if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) return open_file_limit();
    }
  }
  return unavailable(std::string("cannot raise the open-file limit: ") + std::strerror(error));
}

}  // namespace fedmesh
