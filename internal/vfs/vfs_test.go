package vfs

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

func TestWriteFileAtomicAndFaults(t *testing.T) {
	dir := t.TempDir()
	ff := NewFaultFS(Default)
	p := filepath.Join(dir, "x")
	if err := WriteFileAtomic(ff, p, []byte("one")); err != nil {
		t.Fatal(err)
	}
	ff.SetInject(func(op, path string) error {
		if op == "rename" {
			return unix.EIO
		}
		return nil
	})
	if err := WriteFileAtomic(ff, p, []byte("two")); !errors.Is(err, unix.EIO) {
		t.Fatalf("want EIO, got %v", err)
	}
	ff.SetInject(nil)
	b, err := ReadFile(ff, p)
	if err != nil || string(b) != "one" {
		t.Fatalf("after a failed replace: %q, %v", b, err)
	}
	if ok, _ := Exists(ff, p+".tmp"); ok {
		t.Fatal("temporary file left behind")
	}
	f, err := ff.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	ff.SetInject(func(op, path string) error {
		if op == "write" {
			return ErrTornWrite
		}
		return nil
	})
	n, err := f.WriteAt([]byte("abcd"), 0)
	if n != 2 || !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("torn write: n=%d err=%v", n, err)
	}
	f.Close()
	ents, err := ReadDir(ff, dir)
	if err != nil || len(ents) != 1 || ents[0].Name() != "x" {
		t.Fatalf("ReadDir: %v %v", ents, err)
	}
}
