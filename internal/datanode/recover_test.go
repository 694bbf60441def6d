package datanode

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// putBlockVia writes block lid of cid (one 64 KiB chunk: a block file,
// not inline) through pipeline g: WriteChunk, then PutBlock.
func putBlockVia(ctx context.Context, g *raft.Group, cid, lid uint64) ([]byte, error) {
	data := randBytes(cid<<16|lid, 64<<10)
	if _, err := g.Propose(ctx, writeChunkEntry(0, cid, lid, 0, data).Meta, data); err != nil {
		return nil, err
	}
	if _, err := g.Propose(ctx, putBlockEntry(0, cid, lid, data).Meta, nil); err != nil {
		return nil, err
	}
	return data, nil
}

func stateOf(t *testing.T, d *Datanode, cid uint64) storage.State {
	t.Helper()
	rep, err := d.store.Container(storage.ContainerID(cid))
	if err != nil {
		t.Fatal(err)
	}
	return rep.State
}

// TestRecoverContainerAfterApplyBug is the datanode's part of the operator
// path for a deterministic apply bug (recover.go). A pipeline writes three
// blocks into each of containers 3 and 4, then a bug makes every entry
// into them fail in apply (the guard marks both UNHEALTHY, the clients get
// errors); container 5 is UNHEALTHY for another cause (a chunk not
// stored). Then:
//   - while the pipeline is still here, recovery is refused (it could
//     still write the container);
//   - after the pipeline is left: container 5 is refused (not an apply
//     bug); container 4, one of whose block files was damaged, stays
//     UNHEALTHY and its error and reported reason name the block;
//     container 3 comes back CLOSED with its three blocks readable and
//     verified, and without the block of the entry that failed;
//   - a power loss right after the recovery returned, and a restart,
//     leave container 3 CLOSED (nothing marks it
//     again) and readable, container 4 still UNHEALTHY; with no cause
//     known any more, only SCM's record of an apply bug allows a try.
//
// Without recover.go and storage's RecoverUnhealthy nothing brings a
// container out of UNHEALTHY.
func TestRecoverContainerAfterApplyBug(t *testing.T) {
	fs := vfs.NewMem(vfs.MemOptions{})
	d := openMemDatanode(t, fs)
	defer func() { d.Close() }()
	const pid, c3, c4, c5 = 7, 3, 4, 5
	if err := d.joinPipeline(&metapb.Pipeline{Id: pid, Datanodes: []uint64{d.ID()}}, nil); err != nil {
		t.Fatal(err)
	}
	g, err := d.host.Group(pid)
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(20 * time.Second); !g.IsLeader(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("single-replica pipeline elected no leader")
		}
	}
	d.mu.Lock()
	sm := d.sms[pid]
	d.mu.Unlock()
	var bug atomic.Bool
	sm.applyHook = func(e raft.Entry, cmd *datanodepb.ContainerCommand) {
		if c := commandContainer(cmd); bug.Load() && (c == c3 || c == c4) {
			var none []int
			_ = none[e.Index] // runtime error: index out of range
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	blocks := map[uint64]map[uint64][]byte{c3: {}, c4: {}}
	for _, cid := range []uint64{c3, c4, c5} {
		for lid := uint64(1); lid <= 3; lid++ {
			data, err := putBlockVia(ctx, g, cid, lid)
			if err != nil {
				t.Fatalf("container %d block %d: %v", cid, lid, err)
			}
			if blocks[cid] != nil {
				blocks[cid][lid] = data
			}
		}
	}
	bug.Store(true)
	for _, cid := range []uint64{c3, c4} {
		if _, err := putBlockVia(ctx, g, cid, 9); err == nil {
			t.Fatalf("container %d: the write the bug hit was acknowledged", cid)
		}
	}
	sm.markUnhealthy(c5, sm.applied.Load(), fmt.Sprintf("entry %d: chunk at 0 of block 4 not stored: injected: disk full", sm.applied.Load()))
	for _, cid := range []uint64{c3, c4, c5} {
		if st := stateOf(t, d, cid); st != storage.StateUnhealthy {
			t.Fatalf("container %d is %v after the bug, want UNHEALTHY", cid, st)
		}
	}
	why := reportOf(d, c3).GetUnhealthyReason()
	if !recoverableReason(why) || !recoverableReason("datanode 2 reports its replica UNHEALTHY: "+why) {
		t.Fatalf("the guard's reason %q is not recognized as an apply bug", why)
	}

	// Still in its pipeline: refused.
	if _, err := d.RecoverContainer(c3, ""); !errors.Is(err, ErrRecoverRefused) || !strings.Contains(err.Error(), "still in pipeline 7") {
		t.Fatalf("recover while the pipeline is here: %v, want refused (still in pipeline 7)", err)
	}
	if st := stateOf(t, d, c3); st != storage.StateUnhealthy {
		t.Fatalf("refused recovery changed the state to %v", st)
	}
	if err := d.leavePipeline(pid); err != nil {
		t.Fatal(err)
	}

	// Another cause: refused.
	if _, err := d.RecoverContainer(c5, why); !errors.Is(err, ErrRecoverRefused) || !strings.Contains(err.Error(), "another cause") {
		t.Fatalf("recover of a replica that lacks a chunk: %v, want refused (another cause)", err)
	}

	// A damaged block: stays UNHEALTHY, the block named.
	vol := d.store.Volumes()[0].Path
	p := filepath.Join(vol, "basalt", "containers", "4", "2.block")
	f, err := fs.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	b := []byte{0}
	if _, err := f.ReadAt(b, 1000); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0x5a
	if _, err := f.WriteAt(b, 1000); err != nil {
		t.Fatal(err)
	}
	f.Close()
	d.recoverContainer(&metapb.RecoverContainerCommand{ContainerId: c4}) // as SCM sends it
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		d.recov.mu.Lock()
		running := d.recov.running[c4]
		d.recov.mu.Unlock()
		if !running {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("recovery of container 4 did not end")
		}
	}
	r4 := reportOf(d, c4)
	if r4.GetState() != metapb.ContainerState_CONTAINER_UNHEALTHY || !strings.Contains(r4.GetUnhealthyReason(), "block 2") ||
		!strings.Contains(r4.GetUnhealthyReason(), "failed in apply") {
		t.Fatalf("container 4 with a damaged block after recovery: %v, want UNHEALTHY naming block 2 and the original cause", r4)
	}
	t.Logf("container 4: %s", r4.GetUnhealthyReason())
	if _, err := d.RecoverContainer(c4, ""); !errors.Is(err, storage.ErrCorruption) || !strings.Contains(err.Error(), "block 2") {
		t.Fatalf("recover container 4: %v, want a corruption naming block 2", err)
	}

	// The replica the bug hit, intact: CLOSED, every block verified.
	st, err := d.RecoverContainer(c3, "")
	if err != nil {
		t.Fatal(err)
	}
	if st.Blocks != 3 || st.Bytes != 3*64<<10 {
		t.Fatalf("verified %+v, want 3 blocks of 64 KiB", st)
	}
	check := func(d *Datanode) {
		t.Helper()
		if st := stateOf(t, d, c3); st != storage.StateClosed {
			t.Fatalf("container 3 is %v, want CLOSED", st)
		}
		if missing := blocksThere(d, c3, blocks[c3]); len(missing) > 0 {
			t.Fatalf("container 3 lacks blocks %v", missing)
		}
		for lid := range blocks[c3] {
			if _, err := d.store.VerifyBlock(c3, storage.LocalID(lid), storage.VerifyOptions{}); err != nil {
				t.Fatalf("block %d: %v", lid, err)
			}
		}
		if _, err := d.store.GetBlock(c3, 9); !errors.Is(err, storage.ErrBlockNotFound) {
			t.Fatalf("the failed entry's block 9: %v, want not found", err)
		}
		if err := d.store.WriteChunk(c3, 10, 0, []byte("x"), storage.DefaultChecksum.Compute([]byte("x")), true); !errors.Is(err, storage.ErrContainerNotOpen) {
			t.Fatalf("a write into the recovered container: %v, want refused (not open)", err)
		}
	}
	// Durable before it returned: a power loss right now keeps it CLOSED.
	img := fs.Crash()
	d2 := openMemDatanode(t, img)
	check(d2)
	d2.Close()
	check(d)
	if r := reportOf(d, c3); r.GetState() != metapb.ContainerState_CONTAINER_CLOSED || r.GetBcsid() == 0 {
		t.Fatalf("report of container 3: %v, want CLOSED with its BCSID", r)
	}
	if _, err := d.RecoverContainer(c3, ""); err != nil {
		t.Fatalf("a repeat: %v", err)
	}

	// A restart: still CLOSED, nothing marks it again.
	d.Close()
	d = openMemDatanode(t, fs)
	check(d)
	if st := stateOf(t, d, c4); st != storage.StateUnhealthy {
		t.Fatalf("container 4 is %v after the restart, want UNHEALTHY", st)
	}
	// The cause is not known here any more: only SCM's record of an
	// apply bug allows a try (which still verifies every block).
	if _, err := d.RecoverContainer(c4, "datanode 1 reports its replica UNHEALTHY: entry 12: chunk at 0 of block 4 not stored: disk full"); !errors.Is(err, ErrRecoverRefused) {
		t.Fatalf("after a restart, with SCM's record of another cause: %v, want refused", err)
	}
	if _, err := d.RecoverContainer(c4, "datanode 1 reports its replica UNHEALTHY: "+why); !errors.Is(err, storage.ErrCorruption) {
		t.Fatalf("after a restart, with SCM's record of the bug: %v, want the damaged block found", err)
	}
	if !bytes.Contains([]byte(reportOf(d, c4).GetUnhealthyReason()), []byte(UnknownUnhealthyReason)) {
		t.Fatalf("container 4's reason after the restart: %q", reportOf(d, c4).GetUnhealthyReason())
	}
}

// TestRecoverableReason: the guard's three runtime-error reasons, alone
// or in SCM's record, are recognized; the other causes are not.
func TestRecoverableReason(t *testing.T) {
	for why, want := range map[string]bool{
		"entry 42 (PutBlock) failed in apply: runtime error: index out of range [3] with length 0":                            true,
		"datanode 4 reports its replica UNHEALTHY: entry 42 (CloseContainer) failed in apply: runtime error: nil pointer":     true,
		"entry 7 (WriteChunk): chunk of block 3 not stored: WriteData failed: runtime error: slice bounds out of range":       true,
		"entry 7: chunk at 4096 of block 3 not made durable: SyncData failed: runtime error: integer divide by zero":          true,
		"entry 10 (PutBlock) failed in apply: boom":                                                                           false,
		"entry 7: chunk at 0 of block 3 not stored: disk full":                                                                false,
		"entry 7: block 3 not committed here: chunk missing":                                                                  false,
		"volume /v failed: input/output error":                                                                                false,
		UnknownUnhealthyReason:                                                                                                false,
		"datanode 4 reports its replica UNHEALTHY: its datanode reports it failed its checksums: entry 1 (X) failed in apply": false,
		// Anchored (review nit 5): the guard's text after another prefix
		// is not the guard's record.
		"datanode 4 reports its replica UNHEALTHY: its datanode reports it failed its checksums: block 5: entry 1 (PutBlock) failed in apply: runtime error: x": false,
		"delete tx 9: Internal: entry 1 (PutBlock) failed in apply: runtime error: x":                                                                           false,
		"x: entry 42 (PutBlock) failed in apply: runtime error: index out of range":                                                                             false,
		// After a failed recovery's note (the reported reason SCM may
		// have recorded).
		"recover failed: block 2: checksum mismatch; was: entry 42 (PutBlock) failed in apply: runtime error: index out of range": true,
		// A failed raft log directory (logdirfail.go), alone or in SCM's
		// record; not after another prefix nor with more after it.
		"raft log directory /dn/raft failed; this replica's pipeline 7 stopped":                                       true,
		"datanode 2 reports its replica UNHEALTHY: raft log directory /d/r failed; this replica's pipeline 7 stopped": true,
		"x: raft log directory /d/r failed; this replica's pipeline 7 stopped":                                        false,
		"raft log directory /d/r failed; this replica's pipeline 7 stopped; and then a checksum mismatch":             false,
	} {
		if got := recoverableReason(why); got != want {
			t.Errorf("recoverableReason(%q) = %v, want %v", why, got, want)
		}
	}
}

// TestRecoverRetryClearsFailure (review should-fix 3): a new attempt
// clears the last failure's note at once (the report says "retrying", not
// the old failure, so SCM and --wait do not take the old failure for the
// retry's outcome) and asks for a full report.
func TestRecoverRetryClearsFailure(t *testing.T) {
	var r recoveries
	if !r.start(3) {
		t.Fatal("first start refused")
	}
	r.finish(3, errors.New("block 2: checksum mismatch"))
	if got := r.note(3, "bug"); !strings.HasPrefix(got, RecoverFailedPrefix) {
		t.Fatalf("after a failure the note is %q", got)
	}
	if !r.start(3) {
		t.Fatal("retry refused")
	}
	if got := r.note(3, "bug"); got != "bug" {
		t.Fatalf("while the retry runs the note is %q, want the plain reason", got)
	}
	if r.start(3) {
		t.Fatal("a repeat while the retry runs was started again")
	}
}
