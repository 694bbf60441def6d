package datanode

import (
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// TestUnhealthyReasonOutlivesPipelineClose: SCM closes the pipeline of a
// replica it records UNHEALTHY, and leaving it drops the state machine
// and its sick file; the container stays UNHEALTHY in storage and its
// report must keep the state machine's reason (handed to the datanode's
// leftSick), not a generic one. After a restart (leftSick is in memory
// only) the reason is the neutral UnknownUnhealthyReason; a container no
// longer UNHEALTHY here loses its kept reason. Without the hand-over the
// report after the leave says storage's generic text.
func TestUnhealthyReasonOutlivesPipelineClose(t *testing.T) {
	fs := vfs.NewMem(vfs.MemOptions{})
	d := openMemDatanode(t, fs)
	const pid, cid, other = 7, 5, 6
	if err := d.joinPipeline(&metapb.Pipeline{Id: pid, Datanodes: []uint64{d.ID()}}, nil); err != nil {
		d.Close()
		t.Fatal(err)
	}
	for _, c := range []storage.ContainerID{cid, other} {
		if _, err := d.store.CreateContainer(c, storage.CreateOptions{}); err != nil {
			d.Close()
			t.Fatal(err)
		}
	}
	d.mu.Lock()
	sm := d.sms[pid]
	d.mu.Unlock()
	why := "entry 9 (PutBlock) failed in apply: runtime error: index out of range [3] with length 0"
	sm.markUnhealthy(cid, 9, why)
	sm.markUnhealthy(other, 10, "entry 10 (PutBlock) failed in apply: boom")
	if r := reportOf(d, cid); r == nil || r.UnhealthyReason != why {
		d.Close()
		t.Fatalf("before the leave: %v, want reason %q", r, why)
	}
	if err := d.leavePipeline(pid); err != nil {
		d.Close()
		t.Fatal(err)
	}
	for range 2 { // and again: a report does not drop it
		if r := reportOf(d, cid); r == nil || r.State != metapb.ContainerState_CONTAINER_UNHEALTHY || r.UnhealthyReason != why {
			d.Close()
			t.Fatalf("after the pipeline closed: %v, want UNHEALTHY with %q", r, why)
		}
	}
	// The other replica deleted (SCM replaced it): its reason goes.
	if err := d.deleteContainer(&metapb.DeleteContainerCommand{ContainerId: other}); err != nil {
		d.Close()
		t.Fatal(err)
	}
	d.mu.Lock()
	_, kept := d.leftSick.m[other]
	n := len(d.leftSick.m)
	d.mu.Unlock()
	if kept || n != 1 {
		d.Close()
		t.Fatalf("after deleting %d: kept %v, %d reasons", other, kept, n)
	}
	d.Close()
	// After a restart the cause is not known here: neutral text.
	d2 := openAndClose(t, fs)
	r := reportOf(d2, cid)
	if r == nil || r.State != metapb.ContainerState_CONTAINER_UNHEALTHY || !strings.HasPrefix(r.UnhealthyReason, UnknownUnhealthyReason) ||
		strings.Contains(r.UnhealthyReason, "lost or damaged") {
		t.Fatalf("after a restart: %v, want the neutral %q...", r, UnknownUnhealthyReason)
	}
	t.Logf("after a restart: %s", r.UnhealthyReason)
}

// TestLeftReasonsBoundedAndPruned: the kept reasons are bounded (the
// oldest go), and a report drops those whose container it does not list
// UNHEALTHY, but not one handed over after its list.
func TestLeftReasonsBoundedAndPruned(t *testing.T) {
	var l leftReasons
	l.add(map[uint64]string{1: "a"})
	for i := range maxLeftReasons {
		l.add(map[uint64]string{uint64(100 + i): "b"})
	}
	if len(l.m) != maxLeftReasons {
		t.Fatalf("%d reasons kept, want %d", len(l.m), maxLeftReasons)
	}
	if _, ok := l.m[1]; ok {
		t.Fatal("the oldest reason was not evicted")
	}
	mark := l.seq
	l.add(map[uint64]string{2: "late"})
	l.prune(mark, map[uint64]bool{200: true}) // (100, the oldest, went for 2)
	if len(l.m) != 2 || l.m[200].why != "b" || l.m[2].why != "late" {
		t.Fatalf("after prune: %v", l.snapshot())
	}
}

// TestUnhealthyReasonVolumeFailedAfterScan: a full heartbeat scans the
// volumes before it lists the containers; a volume that fails between the
// two has its containers listed UNHEALTHY, and their reason must still
// name the volume's failure (SCM records the first reason it gets through
// Raft for good), not the unknown-cause text.
func TestUnhealthyReasonVolumeFailedAfterScan(t *testing.T) {
	dir := t.TempDir()
	ffs := vfs.NewFaultFS(vfs.Default)
	st, err := storage.Open(storage.Options{Volumes: []string{filepath.Join(dir, "vol")}, FS: ffs})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.CreateContainer(5, storage.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	d := &Datanode{store: st, sms: map[uint64]*containerSM{}}
	vols := st.Volumes() // the heartbeat's scan
	vol := vols[0].Path
	ffs.SetInject(func(op, path string) error {
		if strings.HasPrefix(path, vol+string(filepath.Separator)) && !strings.HasPrefix(path, filepath.Join(vol, "meta")) &&
			(op == "create" || op == "open" || op == "write" || op == "sync" || op == "mkdir") {
			return syscall.EIO
		}
		return nil
	})
	if res := st.CheckVolumes(0); len(res) != 1 || !res[0].NewlyFailed {
		t.Fatalf("health check: %+v", res)
	}
	var r *metapb.ContainerReport
	for _, c := range d.containerReports(vols) {
		if c.ContainerId == 5 {
			r = c
		}
	}
	if r == nil || r.State != metapb.ContainerState_CONTAINER_UNHEALTHY || !strings.Contains(r.UnhealthyReason, "volume "+vol+" failed") {
		t.Fatalf("container 5 on the volume that failed after the scan: %v", r)
	}
}
