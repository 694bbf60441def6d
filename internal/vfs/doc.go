// Package vfs is the one file-system interface of every Basalt path that
// touches disk: block storage, the raft log store, the metadata store and
// the datanode's own files. Nothing on those paths calls os.* directly, so
// a test (or the deterministic simulator) can run a whole node on an
// in-memory file system that loses what was not synced when it "crashes",
// and inject ENOSPC, EIO, torn writes and slow I/O.
//
// FS is Pebble's vfs.FS, so Pebble databases run on it unchanged, plus
// OpenFile with os flags (block files want O_DIRECT and O_EXCL) and files
// that can be truncated. Default is the operating system.
//
// Durability rules every implementation follows (and the crashable
// in-memory FS enforces): file data is durable after File.Sync or
// File.SyncData; a created, renamed or removed directory entry is durable
// only after the parent directory is synced (SyncDir). WriteFileAtomic does
// all three for small files.
//
// MemFS is the crashable in-memory implementation: it keeps what a disk
// would hold after a power failure beside what programs see, and
// CrashClone returns one seeded possible post-crash state (everything
// synced plus a random subset of the rest, writes torn by sector). Crash
// tests and the deterministic simulator (internal/sim) run nodes on it.
package vfs
