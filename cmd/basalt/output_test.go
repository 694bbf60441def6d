package main

import (
	"errors"
	"testing"

	"github.com/basalt-store/basalt/client"
)

func TestParsePath(t *testing.T) {
	for _, c := range []struct {
		in    string
		depth int
		want  objPath
		ok    bool
	}{
		{"/vol", depthVolume, objPath{Volume: "vol"}, true},
		{"/vol/", depthVolume, objPath{Volume: "vol"}, true},
		{"vol", depthVolume, objPath{}, false},
		{"/", depthVolume, objPath{}, false},
		{"/vol/b", depthVolume, objPath{}, false},
		{"/vol/b", depthBucket, objPath{Volume: "vol", Bucket: "b"}, true},
		{"/vol", depthBucket, objPath{}, false},
		{"/vol//", depthBucket, objPath{}, false},
		{"/vol/b/k", depthBucket, objPath{}, false},
		{"/vol/b/dir/k", depthKey, objPath{Volume: "vol", Bucket: "b", Key: "dir/k"}, true},
		{"/vol/b/", depthKey, objPath{}, false},
		{"/vol//k", depthKey, objPath{}, false},
	} {
		got, err := parsePath(c.in, c.depth)
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("parsePath(%q, %d) = %+v, %v; want %+v ok=%v", c.in, c.depth, got, err, c.want, c.ok)
		}
		var ue *usageError
		if err != nil && (!errors.As(err, &ue) || exitCode(err) != exitUsage) {
			t.Errorf("parsePath(%q): %v is not a usage error", c.in, err)
		}
	}
}

func TestParseSizeAndExitCodes(t *testing.T) {
	for in, want := range map[string]int64{"0": 0, "4096": 4096, "4KiB": 4096, "64MiB": 64 << 20, "1G": 1 << 30, "2 GiB": 2 << 30} {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "-1", "1.5MiB", "MiB", "1PiB"} {
		if _, err := parseSize(bad); err == nil {
			t.Errorf("parseSize(%q) succeeded", bad)
		}
	}
	if exitCode(&client.Error{}) != exitError || exitCode(client.ErrNotFound) != exitNotFound || exitCode(client.ErrInvalidName) != exitInvalid {
		t.Error("exit codes")
	}
}

func TestPatternReaderDiffersPerKey(t *testing.T) {
	p := &pattern{buf: make([]byte, 1<<20)}
	for i := range p.buf {
		p.buf[i] = byte(i * 7)
	}
	if p.digest(1, 3<<20) == p.digest(2, 3<<20) {
		t.Fatal("keys 1 and 2 have the same data")
	}
	if p.digest(5, 3<<20) != p.digest(5, 3<<20) {
		t.Fatal("pattern is not deterministic")
	}
}
