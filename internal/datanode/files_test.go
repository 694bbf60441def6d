package datanode

import (
	"io"
	"log/slog"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// recordFS records the mutating calls made through it.
type recordFS struct {
	*vfs.FaultFS
	mu  sync.Mutex
	ops []string // "op path"
}

func newRecordFS() *recordFS {
	r := &recordFS{FaultFS: vfs.NewFaultFS(vfs.Default)}
	r.SetInject(func(op, path string) error {
		r.mu.Lock()
		r.ops = append(r.ops, op+" "+path)
		r.mu.Unlock()
		return nil
	})
	return r
}

func (r *recordFS) saw(op, path string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Contains(r.ops, op+" "+path)
}

// TestDatanodeFilesThroughFS (scenario 11): the datanode's own files
// (identity, each pipeline's applied index and container list) are
// written through Config.FS, replaced atomically and made durable with a
// directory sync; storage's files go through the same FS. They used to be
// written with os.* directly, out of reach of a crashable FS.
func TestDatanodeFilesThroughFS(t *testing.T) {
	dir := t.TempDir()
	fs := newRecordFS()
	ca, err := pki.NewCA("test")
	if err != nil {
		t.Fatal(err)
	}
	creds, err := ca.Issue(pki.Identity{Role: pki.RoleDatanode, ID: "dn-files"}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	d, err := New(Config{DataDir: dir, MetaAddrs: []string{"127.0.0.1:1"}, FS: fs, TLS: creds,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	id := filepath.Join(dir, "datanode.json")
	for _, want := range [][2]string{{"create", id + ".tmp"}, {"sync", id + ".tmp"}, {"rename", id}, {"syncdir", dir}} {
		if !fs.saw(want[0], want[1]) {
			t.Errorf("identity file: no %s of %s through Config.FS", want[0], want[1])
		}
	}
	if !fs.saw("mkdir", filepath.Join(dir, "data")) && !fs.saw("mkdir", filepath.Join(dir, "data", "basalt")) {
		t.Errorf("storage's volume not created through Config.FS: %v", fs.ops)
	}

	pdir := filepath.Join(dir, "pipelines")
	sm, err := newContainerSM(1000, d.store, fs, pdir, &stats{}, d.log)
	if err != nil {
		t.Fatal(err)
	}
	if err := sm.ensureContainer(storage.ContainerID(3)); err != nil {
		t.Fatal(err)
	}
	sm.persist(9)
	for _, f := range []string{sm.contsFile, sm.file} {
		if !fs.saw("rename", f) {
			t.Errorf("%s not replaced atomically through the FS", f)
		}
	}
	if !fs.saw("syncdir", pdir) {
		t.Errorf("pipelines directory never synced: %v", fs.ops)
	}
}
