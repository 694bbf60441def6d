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

// BenchmarkVersionSecureChain: BenchmarkReuseSecureChain's streams (256
// KiB blocks, 3 TLS datanodes, a pool) at each version a rolling upgrade
// runs: v5 (pooled), v4 (a route with an old datanode, advertised: a new
// connection and handshake per hop per stream), and fallback (the first
// datanode is old but the client was not told: a refused version 5
// header, then v4, per stream).
func BenchmarkVersionSecureChain(b *testing.B) {
	for _, bc := range []struct {
		name    string
		firstV4 bool
		version uint8
	}{
		{"v5", false, 0},
		{"v4", false, MinVersion},
		{"fallback", true, 0},
	} {
		b.Run(bc.name, func(b *testing.B) {
			c := newSecureCluster(b, 0)
			c.tweak = func(cfg *ServerConfig) {
				if bc.firstV4 && cfg.ID == 1 {
					cfg.OnlyVersion = MinVersion
				}
			}
			for i := range 3 {
				c.start(b, uint64(i+1))
			}
			cfg := c.issue(b, pki.RoleClient, "app").ClientTLS(pki.RoleDatanode)
			p := NewConnPool(0, 0)
			defer p.Close()
			data := payload(256<<10, 1)
			var i uint64
			b.SetBytes(int64(len(data)))
			for b.Loop() {
				i++
				w, err := Dial(context.Background(), c.route(), 1, BlockID{1, i}, Options{TLS: cfg, Timeout: 5 * time.Second, Pool: p, Version: bc.version})
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
		})
	}
}
