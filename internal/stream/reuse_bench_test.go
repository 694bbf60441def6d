package stream

import (
	"context"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/pki"
)

// BenchmarkReuseSecureChain: one stream after another (256 KiB blocks)
// through 3 TLS datanodes on pooled connections: the per-stream cost of
// reuse (next header, peeks, keys), with little payload.
func BenchmarkReuseSecureChain(b *testing.B) {
	c := newSecureCluster(b, 3)
	cfg := c.issue(b, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
	p := NewConnPool(0, 0)
	defer p.Close()
	data := payload(256<<10, 1)
	var i uint64
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		i++
		w, err := Dial(context.Background(), c.route(), 1, BlockID{1, i}, Options{TLS: cfg, Timeout: 5 * time.Second, Pool: p})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := w.Write(data); err != nil {
			b.Fatal(err)
		}
		if _, _, err := w.Close(); err != nil {
			b.Fatal(err)
		}
	}
	if ps := p.Stats(); ps.Dials != 1 {
		b.Fatalf("pool %+v", ps)
	}
}
