package datanode_test

import (
	"bytes"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/vfs"
)

// TestDiskFullRefusedBeforeProposing: when the volumes fall below their
// reserve, PutSmallFile is refused by the leader with DISK_FULL
// (ResourceExhausted) before anything enters the pipeline's log; no
// datanode crashes, blocks written before stay readable on every replica,
// and writes succeed again once space returns.
func TestDiskFullRefusedBeforeProposing(t *testing.T) {
	ffs := vfs.NewFaultFS(vfs.Default)
	e := startEnvWith(t, func(c *cluster.Config) { c.Storage.FS = ffs })
	before := e.block()
	data := randBytes(4096, 1)
	if _, err := e.putSmall(before, smallBlock(before, data), data); err != nil {
		t.Fatal(err)
	}

	ffs.SetCapacity(&vfs.DiskUsage{TotalBytes: 1 << 30, AvailBytes: 1 << 20})
	// The cached free space is refreshed by every volume report (each
	// heartbeat); one now, so the test need not wait for them.
	e.refreshVolumes()
	b := e.block()
	d := randBytes(4096, 2)
	_, err := e.putSmall(b, smallBlock(b, d), d)
	if dnKind(err) != datanodepb.Error_DISK_FULL || status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("PutSmallFile on a full disk: %v, want ResourceExhausted DISK_FULL", err)
	}
	for i := range e.c.Datanodes {
		if e.c.Datanode(i) == nil {
			t.Fatalf("datanode %d is gone", i)
		}
	}
	for _, d := range before.GetDatanodes() {
		_, dn := e.byID(d.GetId())
		if got := readAll(t, dn.Addr(), bid(before)); !bytes.Equal(got, data) {
			t.Fatalf("datanode %d: block written before the disk filled reads %d bytes, differing", d.GetId(), len(got))
		}
	}

	ffs.SetCapacity(nil)
	e.refreshVolumes()
	d = randBytes(4096, 3)
	if _, err = e.putSmall(b, smallBlock(b, d), d); err != nil {
		t.Fatalf("PutSmallFile once space returned: %v", err)
	}
	for _, dn := range b.GetDatanodes() {
		_, n := e.byID(dn.GetId())
		if got := readAll(t, n.Addr(), bid(b)); !bytes.Equal(got, d) {
			t.Fatalf("datanode %d: block written after space returned reads %d bytes, differing", dn.GetId(), len(got))
		}
	}
}

// refreshVolumes has every datanode read its volumes' free space now.
func (e *env) refreshVolumes() {
	for i := range e.c.Datanodes {
		if dn := e.c.Datanode(i); dn != nil {
			dn.Store().Volumes()
		}
	}
}
