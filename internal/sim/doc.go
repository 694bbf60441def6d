// Package sim is Basalt's deterministic simulator, in the manner of
// TigerBeetle's VOPR and etcd raft's rafttest: the replication core runs
// single-threaded under one seed, with time, the network and the disks
// simulated, and checkers judge every run. A failing seed replays exactly:
//
//	go test ./internal/sim -run 'TestSim$' -seed=12345 -steps=200 -v
//
// # The world
//
// 3 to 5 nodes. Each has its own disk, a vfs.MemFS, which keeps beside
// what programs see what a real disk would still hold after a power
// failure (synced data; directory entries only after their directory is
// synced). On it a node runs exactly the production code of the
// replication core: a raft.Host in manual mode (no goroutines: the
// simulator ticks it and runs its work with Host.Poll), the pipeline group
// whose state machine is the real container state machine
// (datanode.NewContainerStateMachine) over real block storage
// (internal/storage), and a metadata group whose state machine keeps a
// key-value map in the real metadata store (internal/meta/store, Pebble on
// the MemFS). Three of the nodes form the pipeline; the metadata group is
// every node (or three).
//
// # Determinism
//
// One seed drives everything, through named streams (network, faults,
// workload, crashes, setup), so that one concern drawing more often does
// not reshuffle the others. Simulated time is an event queue: message
// deliveries, ticks, client operations and faults are events; after each
// one every node polls until none has work. Nothing reads the wall clock
// or sleeps: slow disks charge simulated time through MemFS's latency
// callback. Disk faults are decided by a hash of (seed, path, operation
// count), not by a shared stream, and a crash's outcome for one file
// depends on the seed and that file alone (MemFS.CrashClone), so Pebble's
// own background goroutines cannot shift unrelated outcomes.
// TestSimDeterministic runs a seed twice and compares a hash of the
// whole trace.
//
// # Faults
//
//   - network: loss, duplication, latency (hence reordering), partitions;
//     messages to a crashed node are lost;
//   - crash: the node's disk becomes MemFS.CrashClone (all synced state
//     plus a seeded subset of unsynced writes, torn by sector, and of
//     unsynced directory changes); the node restarts from it later. Some
//     crashes are aimed just after a snapshot restore;
//   - disk: full (ENOSPC), EIO, torn writes, slow I/O, for a while. EIO
//     and torn writes are not injected into Pebble's own files, where
//     Pebble panics on its own goroutine by design (that would stop the
//     test binary, not a node).
//
// # Workload and checkers
//
// Block writes as a client does them: WriteChunk proposals carrying the
// data, then a PutBlock whose wait for all replicas (Group.AppliedAll,
// then every replica asked whether it failed the entry or holds the
// container UNHEALTHY, as the datanode's ApplyStatus does) acknowledges the
// block. Metadata puts and gets from three clients, through the log.
//
//   - a wait_all success means every replica holds the block committed,
//     byte for byte, at that moment;
//   - no acknowledged block is lost or changed after the faults stop and
//     the cluster heals (a replica may instead report the container
//     UNHEALTHY: under-replication that is reported, not silent);
//   - replicas of a committed block agree byte for byte;
//   - no state machine's applied index ever goes backwards, within a run
//     of a node or across its crashes, and entries are applied in order;
//   - metadata replicas at the same applied index hold the same map;
//   - after healing no group is stopped anywhere, and no node panicked
//     except by Pebble's fatal full-disk error; a node whose raft log
//     directory failed (internal/raft/logfatal.go: its groups stop, the
//     process stays up) is crashed and restarted later, as its
//     supervisor or operator would, and a failure not caused by a full
//     disk is a violation, as such a panic is;
//   - the metadata history (calls and returns in simulated time) is
//     linearizable (porcupine, a register per key); an operation whose
//     outcome the client could not learn may have happened at any point
//     after its call.
//
// A violation that a known, reported defect of the code under test
// explains is tagged "[known defect Dn]" (docs/SIMULATION.md); TestSim
// skips a seed whose every violation is known, -strict and make simulate
// do not.
package sim
