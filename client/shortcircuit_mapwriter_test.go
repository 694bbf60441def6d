package client

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io"
	"net"
	"os"
	"os/exec"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

const pipeChildEnv = "BASALT_TEST_MAPPED_PIPE_CHILD"

// TestMappedPieceToPipeWriterSurvivesTruncation: a writer that hands the
// slice to another goroutine (io.PipeWriter, as HTTP/2's ResponseWriter
// does) must not be given the mapping: the fault on a truncated block
// file would happen outside the goroutine guarded by SetPanicOnFault and
// kill the process (fatal SIGBUS). The write runs in a child test process;
// it must end in an error, not a crash. Fails without the copy step.
func TestMappedPieceToPipeWriterSurvivesTruncation(t *testing.T) {
	if os.Getenv(pipeChildEnv) != "" {
		mappedPieceToPipeChild(t)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestMappedPieceToPipeWriterSurvivesTruncation$", "-test.count=1")
	cmd.Env = append(os.Environ(), pipeChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out[:min(len(out), 2000)])
	}
}

func mappedPieceToPipeChild(t *testing.T) {
	data := randBytes(7, 1<<20)
	f, bd := blockOnDisk(t, data)
	m := mapBlockFile(f, bd.Length)
	if m == nil {
		t.Fatal("not mapped")
	}
	bf := &scBlockFile{f: f, m: m, bd: bd}
	bf.refs.Store(2)
	if err := os.Truncate(f.Name(), 0); err != nil {
		t.Fatal(err)
	}
	pr, pw := io.Pipe()
	go io.Copy(io.Discard, pr)
	_, _, copied, err := (mappedPiece{bf: bf, off: 0, n: 1 << 20}).write(pw)
	if err == nil || !copied {
		t.Fatalf("pipe write from a truncated mapping: copied %v, err %v; want a copy that fails", copied, err)
	}
}

// TestWritesInPlace: only writers that read p in the calling goroutine or
// in the kernel are given a mapping.
func TestWritesInPlace(t *testing.T) {
	_, pw := io.Pipe()
	a, b := net.Pipe() // a net.Conn whose Write hands p to the reader's goroutine
	defer a.Close()
	defer b.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		if c, err := ln.Accept(); err == nil {
			c.Close()
		}
	}()
	tc, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close()
	for _, c := range []struct {
		name string
		w    io.Writer
		want bool
	}{{"discard", io.Discard, true}, {"file", os.Stderr, true}, {"tcp", tc, true}, {"sha256", sha256.New(), true},
		{"sync writer", syncTouchWriter{}, true}, {"bytes.Buffer", new(bytes.Buffer), true}, {"pipe", pw, false}, {"net.Pipe", a, false}, {"touch", touchWriter{}, false}} {
		if got := writesInPlace(c.w); got != c.want {
			t.Errorf("%s: writesInPlace = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestMapBlockFileChecksSize: a file shorter than the block's length is
// not mapped (the pages past its end would fault on every access).
func TestMapBlockFileChecksSize(t *testing.T) {
	f, bd := blockOnDisk(t, randBytes(3, 8192))
	if m := mapBlockFile(f, bd.Length+4096); m != nil {
		t.Fatalf("mapped %d bytes of an %d-byte file", len(m), bd.Length)
	}
	if m := mapBlockFile(f, bd.Length); m == nil {
		t.Fatal("the whole file not mapped")
	} else {
		_ = unix.Munmap(m)
	}
}

// TestMappedPieceToTCPFromTruncatedFile: a TCP connection is given the
// mapping itself; the kernel's copy from a truncated mapping is an error
// (EFAULT), not a signal.
func TestMappedPieceToTCPFromTruncatedFile(t *testing.T) {
	data := randBytes(7, 1<<20)
	f, bd := blockOnDisk(t, data)
	m := mapBlockFile(f, bd.Length)
	if m == nil {
		t.Fatal("not mapped")
	}
	bf := &scBlockFile{f: f, m: m, bd: bd}
	bf.refs.Store(2)
	defer func() { _ = unix.Munmap(m) }()
	if err := os.Truncate(f.Name(), 0); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		if c, err := ln.Accept(); err == nil {
			io.Copy(io.Discard, c)
			c.Close()
		}
	}()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(time.Minute))
	if _, _, copied, err := (mappedPiece{bf: bf, off: 0, n: 1 << 20}).write(c); err == nil || copied {
		t.Fatalf("TCP write from a truncated mapping: copied %v, err %v; want the mapping given and an error", copied, err)
	}
}
