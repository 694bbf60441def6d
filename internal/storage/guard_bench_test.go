package storage

import (
	"testing"

	"github.com/cockroachdb/pebble/v2"

	"github.com/basalt-store/basalt/internal/vfs"
)

// BenchmarkVolumeCommit measures a guarded commit of a two-key batch into a
// volume's DB (the commit path of PutBlock, SyncCommits and the deferred-
// write flusher: fatal.go hands each to one of the DB's long-lived
// committer goroutines so that it escapes a wedge), NoSync and Sync (on a memory FS: no fsync cost, so the
// hand-off's share is at its largest), alone and from 8 goroutines per CPU
// (Pebble's group commit). Reads take no hand-off (BenchmarkVolumeGuard).
func BenchmarkVolumeCommit(b *testing.B) {
	s, err := Open(Options{Volumes: []string{"/vol"}, FS: vfs.NewMem(vfs.MemOptions{}), ContainerSize: 1 << 30})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	v := s.volumes[0]
	val := make([]byte, 64)
	one := func(b *testing.B, i uint64, wo *pebble.WriteOptions) {
		batch := v.db.NewBatch()
		batch.Set(makeKey(1, kindBlock, i), val, nil)
		batch.Set(makeKey(1, kindContainer, idCounters), val, nil)
		if err := v.commit(batch, wo); err != nil {
			b.Fatal(err)
		}
		batch.Close() // never wedged here
	}
	for _, c := range []struct {
		name string
		wo   *pebble.WriteOptions
	}{{"nosync", pebble.NoSync}, {"sync", pebble.Sync}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for i := range b.N {
				one(b, uint64(i%4096), c.wo)
			}
		})
		b.Run(c.name+"/parallel", func(b *testing.B) {
			b.ReportAllocs()
			b.SetParallelism(8)
			b.RunParallel(func(pb *testing.PB) {
				i := uint64(0)
				for pb.Next() {
					i++
					one(b, i%4096, c.wo)
				}
			})
		})
	}
}
