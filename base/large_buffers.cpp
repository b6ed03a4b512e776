#include "base/large_buffers.h"

#include <malloc.h>

namespace fedmesh {

void return_large_buffers_to_system() { mallopt(M_MMAP_THRESHOLD, 1 << 20); }

}  // namespace fedmesh
