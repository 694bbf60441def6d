package datanode

import (
	"fmt"
	"io"
	"log/slog"
	"testing"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// BenchmarkContainerReports: building a full heartbeat's volume and
// container reports (fullReports) of 2000 containers, none or 20 of them UNHEALTHY
// (storage's mark) and 20 more lacking in a pipeline's sick map.
func BenchmarkContainerReports(b *testing.B) {
	for _, bad := range []int{0, 20} {
		b.Run(fmt.Sprintf("unhealthy=%d", bad), func(b *testing.B) {
			fs := vfs.NewMem(vfs.MemOptions{})
			st, err := storage.Open(storage.Options{Volumes: []string{"/vol"}, FS: fs, ContainerSize: 1 << 20})
			if err != nil {
				b.Fatal(err)
			}
			defer st.Close()
			for i := range 2000 {
				if _, err := st.CreateContainer(storage.ContainerID(i+1), storage.CreateOptions{}); err != nil {
					b.Fatal(err)
				}
			}
			sm, err := newContainerSM(1000, st, fs, "/sm", &stats{}, slog.New(slog.NewTextHandler(io.Discard, nil)))
			if err != nil {
				b.Fatal(err)
			}
			for i := range bad {
				if err := st.MarkUnhealthy(storage.ContainerID(i*50+1), "bench"); err != nil {
					b.Fatal(err)
				}
				sm.sick[uint64(5000+i)] = "entry 9: block 1 not committed here: chunk missing"
			}
			d := &Datanode{store: st, sms: map[uint64]*containerSM{1000: sm}}
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if n := len(fullReports(d)); n != 2000+bad {
					b.Fatalf("%d reports", n)
				}
			}
		})
	}
}

// fullReports is what a full heartbeat builds: volume and container
// reports.
func fullReports(d *Datanode) []*metapb.ContainerReport {
	_, cs := d.reports(true)
	return cs
}
