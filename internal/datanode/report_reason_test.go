package datanode

import (
	"io"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// reportOf is container cid's report in d's full report (nil: none).
func reportOf(d *Datanode, cid uint64) *metapb.ContainerReport {
	for _, c := range d.ContainerReports() {
		if c.ContainerId == cid {
			return c
		}
	}
	return nil
}

// TestContainerReportCarriesApplyPanicReason: a committed entry whose
// apply hits a runtime error marks its container UNHEALTHY here (the
// guard); the heartbeat's report of that container names why — the entry,
// its command and the panic, as the state machine recorded it — so SCM and
// `basalt admin container info` can show it. Healthy containers carry no
// reason.
func TestContainerReportCarriesApplyPanicReason(t *testing.T) {
	_, st, sm := guardReplica(t, io.Discard)
	d1, d2 := randBytes(31, 2000), randBytes(32, 2000)
	ents := []raft.Entry{smallFileEntry(1, 1, 10, d1), smallFileEntry(2, 2, 20, d2)} // entry 2 hits the runtime error
	for i, e := range ents {
		if err := sm.WriteData(e.Index, e.Term, e.Meta, [][]byte{d1, d2}[i]); err != nil {
			t.Fatal(err)
		}
	}
	if err := sm.SyncData(); err != nil {
		t.Fatal(err)
	}
	if res := sm.Apply(ents); res[0] != nil || res[1] == nil {
		t.Fatalf("apply results %v, want entry 1 applied and entry 2 failed", res)
	}
	r := &replica{t: t, store: st, sm: sm}
	d := r.onDatanode()
	bad := reportOf(d, 2)
	if bad == nil || bad.State != metapb.ContainerState_CONTAINER_UNHEALTHY {
		t.Fatalf("container 2 (apply panicked) reported %v, want UNHEALTHY", bad)
	}
	for _, want := range []string{"entry 2", "PutSmallFile", "failed in apply", "index out of range"} {
		if !strings.Contains(bad.UnhealthyReason, want) {
			t.Errorf("container 2's reason %q lacks %q", bad.UnhealthyReason, want)
		}
	}
	if good := reportOf(d, 1); good == nil || good.State == metapb.ContainerState_CONTAINER_UNHEALTHY || good.UnhealthyReason != "" {
		t.Errorf("container 1 (healthy) reported %v, want no reason", good)
	}
	t.Logf("container 2: %s: %s", bad.State, bad.UnhealthyReason)
}

// TestContainerReportReasonOtherMarks: a lacking container that could not
// even be created carries the state machine's reason; one storage marked
// on its own says its cause is not known here (storage logs the cause but
// does not keep it). (A
// failed volume's reason: TestAdminContainerInfoShowsUnhealthyReason in
// cmd/basalt.)
func TestContainerReportReasonOtherMarks(t *testing.T) {
	dir := t.TempDir()
	st, err := storage.Open(storage.Options{Volumes: []string{filepath.Join(dir, "vol")}})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.CreateContainer(5, storage.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	sm, err := newContainerSM(1000, st, vfs.Default, dir, &stats{}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	d := &Datanode{store: st, sms: map[uint64]*containerSM{1000: sm}}
	if r := reportOf(d, 5); r == nil || r.UnhealthyReason != "" {
		t.Fatalf("healthy container 5: %v", r)
	}
	// No storage record (as on a filled disk): recorded in the sick map
	// only.
	sm.recordSick(9, 7, "entry 7: block 3 not committed here: chunk missing")
	if r := reportOf(d, 9); r == nil || r.State != metapb.ContainerState_CONTAINER_UNHEALTHY ||
		!strings.Contains(r.UnhealthyReason, "block 3 not committed here") || !strings.Contains(r.UnhealthyReason, "not held here") {
		t.Fatalf("container 9 (lacking, uncreated): %v", r)
	}
	// Storage's own mark, whose cause storage does not keep.
	if err := st.MarkUnhealthy(5, "test"); err != nil {
		t.Fatal(err)
	}
	if r := reportOf(d, 5); r == nil || r.State != metapb.ContainerState_CONTAINER_UNHEALTHY || !strings.HasPrefix(r.UnhealthyReason, UnknownUnhealthyReason) {
		t.Fatalf("container 5 marked by storage: %v", r)
	}
}

// TestBoundReason: reasons are at most 256 bytes of valid UTF-8, cut with
// "…" when longer.
func TestBoundReason(t *testing.T) {
	for _, s := range []string{"", "short", strings.Repeat("é", 300), strings.Repeat("x", 255) + "\xff\xfe", strings.Repeat("a", 1000)} {
		got := boundReason(s)
		if len(got) > maxUnhealthyReason || !utf8.ValidString(got) {
			t.Errorf("boundReason(%d bytes) = %d bytes, valid %v", len(s), len(got), utf8.ValidString(got))
		}
		if len(s) > maxUnhealthyReason && !strings.HasSuffix(got, "…") {
			t.Errorf("boundReason(%d bytes) not marked as cut: %q", len(s), got)
		}
		if len(s) <= maxUnhealthyReason && utf8.ValidString(s) && got != s {
			t.Errorf("boundReason(%q) = %q", s, got)
		}
	}
}

// TestBoundReasonControlCharacters: a reason is one line on an operator's
// terminal: newlines (errors.Join), tabs, ESC and other control
// characters become spaces.
func TestBoundReasonControlCharacters(t *testing.T) {
	got := boundReason("sync failed\nsecond error\r\tx\x1b[2J\x00\u0085y")
	if want := "sync failed second error  x [2J  y"; got != want {
		t.Fatalf("boundReason = %q, want %q", got, want)
	}
}
