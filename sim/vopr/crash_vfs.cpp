#include "sim/vopr/crash_vfs.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <vector>

namespace fedmesh::sim::vopr {
namespace {

// A write or truncate since the file's last sync.
struct PendingWrite {
  bool truncate = false;
  int64_t offset = 0;  // truncate: the new size
  std::string data;
};

struct WatchedFile {
  int owner = 0;
  std::string synced;                 // the content at the last sync
  std::vector<PendingWrite> pending;  // since then, in order
};

struct State {
  std::mutex mutex;
  std::map<std::string, int> folders;  // folder (with a trailing '/') -> owner
  std::map<int, bool> dead;
  std::map<std::string, WatchedFile> files;
  std::function<FileFault(int, FileOperation, const std::string&)> hook;
  std::function<int64_t()> unix_ms;  // SQLite's clock ('now'); empty: the unix VFS's
  CrashVfsCounters counters;
  sqlite3_vfs* base = nullptr;
  sqlite3_vfs vfs{};
  sqlite3_io_methods methods{};
};

State& state() {
  static State s;
  return s;
}

struct SimFile {
  sqlite3_file base;   // must be first
  sqlite3_file* real;  // the unix VFS's file, allocated right after this struct
  std::string* path;   // watched files only
  int owner;
};

void apply_write(std::string& content, const PendingWrite& w) {
  if (w.truncate) {
    content.resize(static_cast<size_t>(w.offset));
    return;
  }
  const size_t end = static_cast<size_t>(w.offset) + w.data.size();
  if (content.size() < end) content.resize(end, '\0');
  std::memcpy(content.data() + w.offset, w.data.data(), w.data.size());
}

std::string read_whole(const std::string& path) {
  std::string content;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return content;
  char buffer[65536];
  ssize_t n;
  while ((n = ::read(fd, buffer, sizeof buffer)) > 0) content.append(buffer, static_cast<size_t>(n));
  ::close(fd);
  return content;
}

void write_whole(const std::string& path, const std::string& content) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return;
  size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  ::close(fd);
}

int owner_of(const std::string& path) {
  State& s = state();
  for (const auto& [folder, owner] : s.folders) {
    if (path.compare(0, folder.size(), folder) == 0) return owner;
  }
  return -1;
}

// The hook's answer, or a failure when the owner's disk is dead.
FileFault decide(int owner, FileOperation op, const std::string& path) {
  State& s = state();
  if (s.dead[owner]) return FileFault::kFail;
  if (!s.hook) return FileFault::kNone;
  const FileFault fault = s.hook(owner, op, path);
  if (fault == FileFault::kCrash) {
    s.dead[owner] = true;
    return FileFault::kFail;
  }
  return fault;
}

SimFile* sim(sqlite3_file* f) { return reinterpret_cast<SimFile*>(f); }

int x_close(sqlite3_file* f) {
  SimFile* file = sim(f);
  const int rc = file->real->pMethods != nullptr ? file->real->pMethods->xClose(file->real) : SQLITE_OK;
  delete file->path;
  file->path = nullptr;
  return rc;
}
int x_read(sqlite3_file* f, void* buffer, int amount, sqlite3_int64 offset) {
  return sim(f)->real->pMethods->xRead(sim(f)->real, buffer, amount, offset);
}
int x_write(sqlite3_file* f, const void* buffer, int amount, sqlite3_int64 offset) {
  SimFile* file = sim(f);
  if (file->path != nullptr) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    ++s.counters.writes;
    const FileFault fault = decide(file->owner, FileOperation::kWrite, *file->path);
    if (fault != FileFault::kNone) {
      ++s.counters.failed;
      return fault == FileFault::kDiskFull ? SQLITE_FULL : SQLITE_IOERR_WRITE;
    }
    s.files[*file->path].pending.push_back({false, offset, std::string(static_cast<const char*>(buffer), amount)});
  }
  return file->real->pMethods->xWrite(file->real, buffer, amount, offset);
}
int x_truncate(sqlite3_file* f, sqlite3_int64 size) {
  SimFile* file = sim(f);
  if (file->path != nullptr) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    if (decide(file->owner, FileOperation::kTruncate, *file->path) != FileFault::kNone) {
      ++s.counters.failed;
      return SQLITE_IOERR_TRUNCATE;
    }
    s.files[*file->path].pending.push_back({true, size, {}});
  }
  return file->real->pMethods->xTruncate(file->real, size);
}
int x_sync(sqlite3_file* f, int flags) {
  SimFile* file = sim(f);
  if (file->path != nullptr) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    ++s.counters.syncs;
    if (decide(file->owner, FileOperation::kSync, *file->path) != FileFault::kNone) {
      ++s.counters.failed;
      return SQLITE_IOERR_FSYNC;
    }
    WatchedFile& w = s.files[*file->path];
    for (const PendingWrite& p : w.pending) apply_write(w.synced, p);
    w.pending.clear();
  }
  return file->real->pMethods->xSync(file->real, flags);
}
int x_file_size(sqlite3_file* f, sqlite3_int64* size) { return sim(f)->real->pMethods->xFileSize(sim(f)->real, size); }
int x_lock(sqlite3_file* f, int level) { return sim(f)->real->pMethods->xLock(sim(f)->real, level); }
int x_unlock(sqlite3_file* f, int level) { return sim(f)->real->pMethods->xUnlock(sim(f)->real, level); }
int x_check_reserved(sqlite3_file* f, int* out) {
  return sim(f)->real->pMethods->xCheckReservedLock(sim(f)->real, out);
}
int x_file_control(sqlite3_file* f, int op, void* arg) {
  return sim(f)->real->pMethods->xFileControl(sim(f)->real, op, arg);
}
int x_sector_size(sqlite3_file* f) { return sim(f)->real->pMethods->xSectorSize(sim(f)->real); }
int x_device(sqlite3_file* f) { return sim(f)->real->pMethods->xDeviceCharacteristics(sim(f)->real); }
int x_shm_map(sqlite3_file* f, int page, int size, int extend, void volatile** out) {
  return sim(f)->real->pMethods->xShmMap(sim(f)->real, page, size, extend, out);
}
int x_shm_lock(sqlite3_file* f, int offset, int n, int flags) {
  return sim(f)->real->pMethods->xShmLock(sim(f)->real, offset, n, flags);
}
void x_shm_barrier(sqlite3_file* f) { sim(f)->real->pMethods->xShmBarrier(sim(f)->real); }
int x_shm_unmap(sqlite3_file* f, int delete_flag) {
  return sim(f)->real->pMethods->xShmUnmap(sim(f)->real, delete_flag);
}

int x_open(sqlite3_vfs* vfs, const char* name, sqlite3_file* f, int flags, int* out_flags) {
  State& s = state();
  SimFile* file = sim(f);
  file->real = reinterpret_cast<sqlite3_file*>(reinterpret_cast<char*>(f) + sizeof(SimFile));
  file->path = nullptr;
  file->owner = -1;
  file->base.pMethods = nullptr;
  const int rc = s.base->xOpen(s.base, name, file->real, flags, out_flags);
  if (rc != SQLITE_OK) return rc;
  file->base.pMethods = &s.methods;
  if (name != nullptr) {
    std::lock_guard<std::mutex> lock(s.mutex);
    const std::string path = std::filesystem::absolute(name).lexically_normal().string();
    const int owner = owner_of(path);
    if (owner >= 0) {
      file->path = new std::string(path);
      file->owner = owner;
      if (s.files.find(path) == s.files.end()) {
        WatchedFile w;
        w.owner = owner;
        w.synced = read_whole(path);  // what it holds when first seen counts as durable
        s.files.emplace(path, std::move(w));
      }
    }
  }
  (void)vfs;
  return SQLITE_OK;
}

int x_delete(sqlite3_vfs* vfs, const char* name, int sync_dir) {
  State& s = state();
  if (name != nullptr) {
    std::lock_guard<std::mutex> lock(s.mutex);
    const std::string path = std::filesystem::absolute(name).lexically_normal().string();
    const int owner = owner_of(path);
    if (owner >= 0) {
      if (decide(owner, FileOperation::kDelete, path) != FileFault::kNone) {
        ++s.counters.failed;
        return SQLITE_IOERR_DELETE;
      }
      s.files.erase(path);
    }
  }
  (void)vfs;
  return s.base->xDelete(s.base, name, sync_dir);
}

// SQLite's clock, in milliseconds since the Julian epoch (as xCurrentTimeInt64).
int x_current_time_int64(sqlite3_vfs*, sqlite3_int64* out) {
  State& s = state();
  std::function<int64_t()> unix_ms;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    unix_ms = s.unix_ms;
  }
  if (!unix_ms) return s.base->xCurrentTimeInt64(s.base, out);
  constexpr sqlite3_int64 kUnixEpochJulianMs = 210866760000000;
  *out = kUnixEpochJulianMs + unix_ms();
  return SQLITE_OK;
}

int x_current_time(sqlite3_vfs* vfs, double* out) {
  sqlite3_int64 ms = 0;
  const int rc = x_current_time_int64(vfs, &ms);
  *out = static_cast<double>(ms) / 86400000.0;
  return rc;
}

}  // namespace

void register_crash_vfs() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.base != nullptr) return;
  sqlite3_initialize();
  s.base = sqlite3_vfs_find(nullptr);
  s.vfs = *s.base;
  s.vfs.szOsFile = static_cast<int>(sizeof(SimFile)) + s.base->szOsFile;
  s.vfs.zName = kCrashVfsName;
  s.vfs.pNext = nullptr;
  s.vfs.xOpen = x_open;
  s.vfs.xDelete = x_delete;
  s.vfs.xCurrentTime = x_current_time;
  s.vfs.xCurrentTimeInt64 = x_current_time_int64;
  // Version 2: shared memory (WAL) yes, memory-mapped reads no (they would
  // bypass what this VFS watches).
  s.methods.iVersion = 2;
  s.methods.xClose = x_close;
  s.methods.xRead = x_read;
  s.methods.xWrite = x_write;
  s.methods.xTruncate = x_truncate;
  s.methods.xSync = x_sync;
  s.methods.xFileSize = x_file_size;
  s.methods.xLock = x_lock;
  s.methods.xUnlock = x_unlock;
  s.methods.xCheckReservedLock = x_check_reserved;
  s.methods.xFileControl = x_file_control;
  s.methods.xSectorSize = x_sector_size;
  s.methods.xDeviceCharacteristics = x_device;
  s.methods.xShmMap = x_shm_map;
  s.methods.xShmLock = x_shm_lock;
  s.methods.xShmBarrier = x_shm_barrier;
  s.methods.xShmUnmap = x_shm_unmap;
  sqlite3_vfs_register(&s.vfs, 0);
}

void watch_folder(const std::string& folder, int owner) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::string key = std::filesystem::absolute(folder).lexically_normal().string();
  if (key.empty() || key.back() != '/') key += '/';
  s.folders[key] = owner;
}

void set_disk_dead(int owner, bool dead) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.dead[owner] = dead;
}

void set_time_source(std::function<int64_t()> unix_ms) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.unix_ms = std::move(unix_ms);
}

void set_fault_hook(std::function<FileFault(int, FileOperation, const std::string&)> hook) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.hook = std::move(hook);
}

void power_cut(int owner, std::mt19937_64& rng, double keep, double tear) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (auto& [path, w] : s.files) {
    if (w.owner != owner) continue;
    std::string content = w.synced;
    for (PendingWrite& p : w.pending) {
      if (uniform(rng) >= keep) {
        ++s.counters.unsynced_lost;
        continue;
      }
      if (!p.truncate && p.data.size() > 512 && uniform(rng) < tear) {
        const size_t sectors = p.data.size() / 512;
        p.data.resize(512 * static_cast<size_t>(uniform(rng) * static_cast<double>(sectors)));
        ++s.counters.torn;
      }
      apply_write(content, p);
    }
    w.pending.clear();
    w.synced = content;
    write_whole(path, content);
  }
  for (const auto& [folder, folder_owner] : s.folders) {
    if (folder_owner != owner) continue;
    std::error_code error;
    for (const auto& entry : std::filesystem::directory_iterator(folder, error)) {
      const std::string name = entry.path().string();
      if (name.size() > 4 && name.compare(name.size() - 4, 4, "-shm") == 0) std::filesystem::remove(entry.path(), error);
    }
  }
}

void keep_unsynced(int owner) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (auto& [path, w] : s.files) {
    if (w.owner != owner) continue;
    for (const PendingWrite& p : w.pending) apply_write(w.synced, p);
    w.pending.clear();
  }
}

void reset_crash_vfs() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.folders.clear();
  s.dead.clear();
  s.files.clear();
  s.hook = nullptr;
}

CrashVfsCounters crash_vfs_counters() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.counters;
}

}  // namespace fedmesh::sim::vopr
