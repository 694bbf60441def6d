package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

func TestPrintSlowDisks(t *testing.T) {
	var b bytes.Buffer
	ds := []*metapb.DatanodeStatus{{Details: &metapb.DatanodeDetails{Id: 1}},
		{Details: &metapb.DatanodeDetails{Id: 2}, SlowDisks: []*metapb.SlowDisk{{Path: "/d7/raft", Kind: "log", MedianFlushUs: 61234, PeersMedianUs: 6100, LimitUs: 20000}}}}
	if err := printSlowDisks(&b, ds[:1]); err != nil || b.Len() != 0 {
		t.Fatalf("no slow disks: %q %v", b.String(), err)
	}
	if err := printSlowDisks(&b, ds); err != nil {
		t.Fatal(err)
	}
	want := "datanode 2: log /d7/raft: median flush 61.2ms, peers 6.1ms, limit 20ms"
	if !strings.Contains(b.String(), want) {
		t.Fatalf("got %q, want a line %q", b.String(), want)
	}
	if j := slowDisksJSON(ds[1].SlowDisks); len(j) != 1 || j[0].Kind != "log" || j[0].MedianFlush != "61.234ms" {
		t.Fatalf("json %+v", j)
	}
}
