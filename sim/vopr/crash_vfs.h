// An SQLite VFS for the fault simulator: SQLite's own unix VFS underneath,
// with every write, truncate and sync of the files under a registered folder
// watched. It keeps what each file held at its last successful sync, and
// what was written since, so that a simulated power cut can put the file
// back to its synced state plus a random part of the unsynced writes (some
// torn at sector size), as a disk may leave it. A hook decides, at each
// write and sync, whether the operation fails (fsync error, disk full) or
// the process crashes right there; a crashed process's file operations all
// fail from then on. The stores under simulation are the real schema and
// the real CheckpointStore code, reached through this VFS by name.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>

namespace fedmesh::sim::vopr {

inline constexpr const char* kCrashVfsName = "fedmesh-crash";

enum class FileOperation { kWrite, kTruncate, kSync, kDelete };

// What the hook answers for one operation on a watched file.
enum class FileFault {
  kNone,       // do it
  kFail,       // fail it (an I/O error; a sync: fsync failed, nothing more is durable)
  kDiskFull,   // fail a write with SQLITE_FULL
  kCrash,      // the process dies right here: this and every later operation of its files fail
};

// Registers the VFS with SQLite once (not as the default).
void register_crash_vfs();

// Files under `folder` belong to `owner` (any id the caller chooses).
void watch_folder(const std::string& folder, int owner);
// Whether `owner`'s files fail every operation (it has crashed): set by
// the simulator.
void set_disk_dead(int owner, bool dead);
// Asked before each write, truncate, sync and delete of a watched file (under
// the VFS's lock: the hook must not call back into this file's functions).
void set_fault_hook(std::function<FileFault(int owner, FileOperation op, const std::string& path)> hook);

// SQLite's clock for stores opened through this VFS (strftime('now'), the
// stores' commit times): milliseconds since the Unix epoch; empty: the
// real clock. The simulator sets virtual time, so a seed's stores and
// events replay bit for bit.
void set_time_source(std::function<int64_t()> unix_ms);

// A power cut for `owner`: each file goes back to what it held at its last
// sync, plus each unsynced write kept with probability `keep` (a kept one
// torn at a 512-byte boundary with probability `tear`); the shared-memory
// index (-shm) is removed, as it would not survive. Call only while none
// of the owner's connections is open.
void power_cut(int owner, std::mt19937_64& rng, double keep, double tear);
// A process crash without a power cut: the OS keeps every write, so what
// was written becomes what is on disk.
void keep_unsynced(int owner);
// Forgets every watched file and folder (between seeds).
void reset_crash_vfs();

// Counters for the report.
struct CrashVfsCounters {
  uint64_t writes = 0, syncs = 0, failed = 0, unsynced_lost = 0, torn = 0;
};
CrashVfsCounters crash_vfs_counters();

}  // namespace fedmesh::sim::vopr
