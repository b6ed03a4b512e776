// Where a long-running role's model-sized buffers go when freed. glibc maps
// an allocation apart from its heap (and unmaps it when freed) only above a
// threshold that starts at 128 KiB and rises to 32 MiB after the first large
// free; below it, what the heap frees it keeps. A process that allocates and
// frees model-sized buffers every round (updates being received, decoded
// values, store blobs, gradients) then holds on to its transient peak.
#pragma once

namespace fedmesh {

// Buffers of a megabyte or more are mapped apart and go back to the system
// when freed. Call once, early, from a role's command (aggregator, node).
void return_large_buffers_to_system();

}  // namespace fedmesh
