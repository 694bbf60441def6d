package client

import (
	"bytes"
	"context"
	"io"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/stream"
)

// TestV2RollingUpgradeStreamVersions: V2 writes through a cluster in the
// middle of a rolling upgrade. Real cluster (3 datanodes, TLS, records);
// a datanode with StreamOnlyVersion 4 is one of the previous release on
// the wire (refuses a version 5 header as it did; registers without
// stream_version). Every PUT reads back intact and no datanode, pipeline
// or container is excluded.
//
//   - advertised: datanodes 0 and 2 old; the client opens every stream
//     at version 4 from their registrations (no refusal, no pool).
//   - stale: the same, but the old datanodes registered as version 5 (an
//     old binary under a registration not yet updated): the first stream is
//     refused by an old datanode, first hop or further down, and opened
//     again at 4 without blame; the client remembers that datanode, so
//     the later streams (every route of the one pipeline has it) open
//     at 4 at once.
//   - old client: every datanode new, the client opens at 4 (the
//     previous release's client): each datanode serves it at 4.
func TestV2RollingUpgradeStreamVersions(t *testing.T) {
	for _, tc := range []struct {
		name  string
		old   map[int]bool      // datanodes of the previous release
		force func(uint8) uint8 // the version the client's dials use, given its choice (nil: its choice)
		stale bool              // the old datanodes registered as version 5
		down  uint64            // streams downgraded after a refusal
	}{
		{name: "advertised", old: map[int]bool{0: true, 2: true}},
		{name: "stale", old: map[int]bool{0: true, 2: true}, stale: true, down: 1},
		{name: "old client", force: func(uint8) uint8 { return stream.MinVersion }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			cc := cluster.Config{Datanodes: 3, BlockSize: 4 << 20, ContainerSize: 512 << 20, Dir: t.TempDir(),
				DatanodeConfig: func(i int, c *datanode.Config) {
					if tc.old[i] {
						c.StreamOnlyVersion = 4
						if tc.stale {
							c.StreamAdvertiseVersion = stream.Version
						}
					}
				}}
			cc.HeartbeatInterval, cc.TickInterval = 200*time.Millisecond, 50*time.Millisecond
			c, err := cluster.Start(ctx, cc)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			if err := c.WaitWritable(ctx); err != nil {
				t.Fatal(err)
			}
			var streams atomic.Uint64
			cl, err := New(Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: c.ClientCredentials(), Location: "/dc1/rack1",
				ChunkSize: 1 << 20, MaxBufferBytes: 8 << 20, MaxBlockRetries: 3, RPCTimeout: 20 * time.Second, WaitAllTimeout: 10 * time.Second,
				AllocateWait: 3 * time.Second, StreamTimeout: 5 * time.Second,
				OnStream: func(StreamInfo) { streams.Add(1) }})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { cl.Close() })
			if cl.streamTLS == nil {
				t.Fatal("the cluster's streams are not secured")
			}
			if _, err := cl.CreateVolume(ctx, "vol", ""); err != nil {
				t.Fatal(err)
			}
			if _, err := cl.CreateBucket(ctx, "vol", "bkt", BucketOptions{}); err != nil {
				t.Fatal(err)
			}
			if tc.force != nil {
				orig := streamDial
				t.Cleanup(func() { streamDial = orig })
				streamDial = func(ctx context.Context, route []stream.Target, pipeline uint64, block stream.BlockID, opts stream.Options) (*stream.Writer, error) {
					opts.Version = tc.force(opts.Version)
					return orig(ctx, route, pipeline, block, opts)
				}
			}
			rnd := rand.New(rand.NewPCG(5, 6))
			data := make([]byte, 2*(4<<20)+4321)
			for i := range data {
				data[i] = byte(rnd.Uint32())
			}
			for _, key := range []string{"a", "b"} {
				ki, err := cl.PutKey(ctx, "vol", "bkt", key, bytes.NewReader(data), PutOptions{Pipeline: PipelineV2})
				if err != nil {
					dns, ps, cs := cl.Excluded()
					t.Fatalf("put %s: %v (excluded datanodes %v pipelines %v containers %v)", key, err, dns, ps, cs)
				}
				if ki.Pipeline != "v2" {
					t.Fatalf("put %s went %q", key, ki.Pipeline)
				}
				kr, err := cl.GetKey(ctx, "vol", "bkt", key)
				if err != nil {
					t.Fatal(err)
				}
				got, err := io.ReadAll(kr)
				kr.Close()
				if err != nil || !bytes.Equal(got, data) {
					t.Fatalf("%s read back %d bytes (err %v), differing", key, len(got), err)
				}
			}
			dns, ps, cs := cl.Excluded()
			if len(dns)+len(ps)+len(cs) != 0 {
				t.Fatalf("excluded datanodes %v pipelines %v containers %v", dns, ps, cs)
			}
			v4, down := cl.StreamVersionStats()
			n := streams.Load()
			pool := cl.StreamPoolStats()
			t.Logf("%d streams; v4 %d, downgraded %d; pool %+v", n, v4, down, pool)
			if n != 6 || v4 != n {
				t.Fatalf("%d of %d streams at version 4, want all", v4, n)
			}
			if down != tc.down {
				t.Fatalf("%d streams downgraded after a refusal, want %d", down, tc.down)
			}
			if pool.Idle != 0 || pool.Reuses != 0 {
				t.Fatalf("version 4 connections pooled: %+v", pool)
			}
			for i := range 3 {
				if st := c.Datanode(i).StreamStats(); st.V4Streams != n || st.Reused != 0 {
					t.Fatalf("datanode %d: %+v, want %d version 4 streams", i, st, n)
				}
			}
		})
	}
}
