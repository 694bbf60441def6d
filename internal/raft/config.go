package raft

import (
	"log/slog"
	"net"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/prometheus/client_golang/prometheus"
)

// HostConfig configures a Host. Zero values take the defaults noted.
type HostConfig struct {
	// ID is this host's replica ID in every group it hosts. Nonzero and
	// unique in the cluster; keep it across restarts.
	ID uint64
	// LogDirs are the log directories (one per disk). Each holds one log
	// store for all groups placed on it; a new group goes to the one with
	// the fewest groups.
	LogDirs []string
	// ListenAddr is the TCP address the transport listens on
	// ("127.0.0.1:0" picks a port; see Host.Addr). Ignored if Transport is set.
	ListenAddr string
	// Listener, if set, is the TCP transport's listener, already bound
	// (ListenAddr is then ignored): a caller that had to learn its port
	// before starting the host keeps it bound instead of closing it and
	// listening again, when another process may have taken it.
	Listener net.Listener
	// Resolve maps a peer host ID to its transport address. Required with
	// the TCP transport; called again on every reconnect, so addresses may
	// change.
	Resolve func(id uint64) (string, error)
	// Security authenticates the TCP transport's connections (see
	// Security; nil: plaintext, for tests of this package).
	Security *Security
	// Transport replaces the TCP transport (tests use an in-memory network).
	Transport Transport
	// Manual: see doc.go, "Manual mode". The host starts no goroutines;
	// the caller drives it with Tick and Poll.
	Manual bool
	// TickInterval is the Raft tick. 0 means 100ms; negative means ticks
	// are driven by calling Host.Tick (deterministic tests).
	TickInterval time.Duration
	// ElectionTicks (default 10) and HeartbeatTicks (default 1).
	ElectionTicks  int
	HeartbeatTicks int
	// MaxProposalBytes bounds one proposal's metadata+data (default 64 MiB).
	MaxProposalBytes int
	// MaxInflightBytes bounds the proposal bytes a group has proposed but
	// not yet applied on this host; Propose blocks beyond it (default 256 MiB).
	MaxInflightBytes int
	// CompactEvery: truncate a group's log once it holds this many applied
	// entries (default 2048), keeping CompactKeep (default 256) behind the
	// state machine's durable index for followers slightly behind.
	CompactEvery int
	CompactKeep  int
	// LogReserveBytes is the free space kept on each log directory's disk
	// for the log store's Pebble, which treats a failed WAL write as fatal:
	// Group.CheckLogSpace fails once less is left, so callers refuse new
	// writes first (default DefaultLogReserve; negative: none).
	LogReserveBytes int64
	// LogBallastBytes is the size of the emergency ballast file kept beside
	// each log directory (<dir>.ballast). NewHost removes it when the disk
	// is below the reserve, so the log store opens instead of hanging on a
	// full disk; it is recreated once there is room. 0: none.
	LogBallastBytes int64
	// FS is the file system for log stores (default: the OS). Tests pass an
	// in-memory or crash-simulating vfs.
	FS vfs.FS
	// Registerer receives the host's Prometheus metrics (default: none).
	Registerer prometheus.Registerer
	// Logger (default slog.Default()).
	Logger *slog.Logger
	// AvoidLogDir, if set, names log directories (as given in LogDirs) that
	// get no new group while another one does not (a slow disk,
	// internal/slowdisk). Groups already on them stay. Called under the
	// host's lock: it must be cheap and must not call back into the host.
	AvoidLogDir func(dir string) bool
	// OnLogDirFailed, if set, is called once per log directory that met a
	// fatal I/O error (logfatal.go), with the cause and the groups it
	// stopped, after they are stopped, on that directory's loop goroutine:
	// it may call the host (Group, StopGroup) but must not wait for the
	// loop (RemoveGroup).
	OnLogDirFailed func(dir string, err error, groups []uint64)
}

// DefaultLogReserve is HostConfig.LogReserveBytes's default.
const DefaultLogReserve = 64 << 20

// GroupConfig configures one group on a host.
type GroupConfig struct {
	// ID of the group, unique in the cluster, nonzero.
	ID uint64
	// Peers are the initial voters (host IDs, including this host) used the
	// first time the group is created. Every initial member must be given
	// the same list. Leave empty to join a group that exists elsewhere: the
	// host waits for the leader to add it (Group.AddMember) and send it a
	// snapshot or the log. Ignored when the group's state is already on disk
	// (restart).
	Peers []uint64
	// StateMachine receives committed entries. If it implements
	// DataStateMachine, proposals with data keep their data out of the log.
	StateMachine StateMachine
}
