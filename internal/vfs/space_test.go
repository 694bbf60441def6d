package vfs

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

func TestSpaceAdmitAndBallast(t *testing.T) {
	fs := NewMem(MemOptions{Capacity: 10 << 20})
	if err := fs.MkdirAll("/d/db", 0o755); err != nil {
		t.Fatal(err)
	}
	now := time.Unix(0, 0)
	opts := SpaceOptions{Reserve: 1 << 20, Ballast: 2 << 20, RefreshInterval: time.Second, Now: func() time.Time { return now }}
	sp, err := OpenSpace(fs, "/d/db", opts)
	if err != nil {
		t.Fatal(err)
	}
	if !sp.HasBallast() || fs.Used() != 2<<20 {
		t.Fatalf("ballast %v, used %d; want a 2 MiB ballast", sp.HasBallast(), fs.Used())
	}
	// 8 MiB free, 1 MiB reserved: 7 MiB admitted, then refusals.
	if err := sp.Admit(7 << 20); err != nil {
		t.Fatal(err)
	}
	f, err := fs.Create("/d/data", WriteCategory)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(make([]byte, 7<<20)); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if err := sp.Admit(1); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("Admit past the reserve = %v, want ErrNoSpace", err)
	}
	// Someone else fills the disk: the next refresh sees it.
	fs.SetCapacity(fs.Used())
	now = now.Add(2 * time.Second)
	if err := sp.Low(); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("Low on a full disk = %v, want ErrNoSpace", err)
	}
	// Reopen on the full disk: the ballast goes, the reserve is back.
	sp, err = OpenSpace(fs, "/d/db", opts)
	if err != nil {
		t.Fatal(err)
	}
	if sp.HasBallast() {
		t.Fatal("ballast kept on a full disk")
	}
	if ok, _ := Exists(fs, "/d/db.ballast"); ok {
		t.Fatal("ballast file still there")
	}
	if sp.Avail() != 2<<20 {
		t.Fatalf("avail %d after removing the ballast, want 2 MiB", sp.Avail())
	}
	// Space returns: a refresh recreates the ballast.
	fs.SetCapacity(100 << 20)
	if err := sp.Refresh(); err != nil {
		t.Fatal(err)
	}
	if !sp.HasBallast() {
		t.Fatal("ballast not recreated once space returned")
	}
	if fi, err := fs.Stat("/d/db.ballast"); err != nil || fi.Size() != 2<<20 {
		t.Fatalf("ballast %v %v", fi, err)
	}
}

// TestSpaceBallastGoesWhenOthersFillTheDisk: something other than the
// admitted data fills the disk while the database runs (the fault test's
// fallocated ballast; a runaway log). The next refresh must remove the
// emergency ballast, so the database's next WAL write has room: before,
// only a reopen did, and a datanode that marked a container UNHEALTHY
// after a refused chunk died of Pebble's fatal ENOSPC (make test-fault,
// seed 652514). Data stays refused; the ballast returns with the space.
func TestSpaceBallastGoesWhenOthersFillTheDisk(t *testing.T) {
	fs := NewMem(MemOptions{Capacity: 10 << 20})
	if err := fs.MkdirAll("/d/db", 0o755); err != nil {
		t.Fatal(err)
	}
	now := time.Unix(0, 0)
	var logs []string
	opts := SpaceOptions{Reserve: 1 << 20, Ballast: 2 << 20, RefreshInterval: time.Second, Now: func() time.Time { return now },
		Logf: func(f string, a ...any) { logs = append(logs, fmt.Sprintf(f, a...)) }}
	sp, err := OpenSpace(fs, "/d/db", opts)
	if err != nil {
		t.Fatal(err)
	}
	if !sp.HasBallast() {
		t.Fatal("no ballast on an empty disk")
	}
	// Another process takes every free byte.
	fs.SetCapacity(fs.Used())
	now = now.Add(2 * time.Second)
	if err := sp.Admit(4096); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("Admit on a full disk = %v, want ErrNoSpace", err)
	}
	if sp.HasBallast() {
		t.Fatal("ballast kept while the disk is full: the database's next write fails")
	}
	if ok, _ := Exists(fs, "/d/db.ballast"); ok {
		t.Fatal("ballast file still there")
	}
	// The database can write what the ballast held.
	f, err := fs.Create("/d/db/000001.log", WriteCategory)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(make([]byte, 1<<20)); err != nil {
		t.Fatalf("database write after the ballast went: %v", err)
	}
	f.Close()
	// Data is still refused (below the reserve), and nothing oscillates.
	now = now.Add(2 * time.Second)
	if err := sp.Admit(4096); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("Admit after the ballast went = %v, want ErrNoSpace", err)
	}
	if sp.HasBallast() {
		t.Fatal("ballast recreated on a full disk")
	}
	if n := len(logs); n != 2 || !strings.Contains(logs[1], "DISK FULL") {
		t.Fatalf("logs %q: want the creation and one DISK FULL line", logs)
	}
	// Space returns: the ballast is back.
	fs.SetCapacity(100 << 20)
	if err := sp.Refresh(); err != nil {
		t.Fatal(err)
	}
	if !sp.HasBallast() {
		t.Fatal("ballast not recreated once space returned")
	}
	if err := sp.Admit(4096); err != nil {
		t.Fatal(err)
	}
}
