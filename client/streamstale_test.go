package client

import (
	"bytes"
	"context"
	"io"
	"math/rand/v2"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/stream"
)

// raceProxy forwards TCP to a datanode's stream port. Armed (arms > 0),
// it acts on the first bytes a client then sends on any of its
// connections:
//
//   - "drop": it closes the client's connection without forwarding them:
//     the datanode closed the idle connection as the header crossed
//     (it never saw the header);
//   - "cut": it forwards them, then closes the client's connection and
//     drops the answer: the datanode read the header (and may have opened
//     the stream) and the connection ended before its ack;
//   - "after": it forwards them and the answer, and closes the client's
//     connection on the next bytes (a packet): the datanode failed after
//     acking the header.
type raceProxy struct {
	lis  net.Listener
	mode string
	arms *atomic.Int32
}

func startRaceProxy(t *testing.T, to, mode string, arms *atomic.Int32) *raceProxy {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &raceProxy{lis: lis, mode: mode, arms: arms}
	t.Cleanup(func() { lis.Close() })
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			d, err := net.Dial("tcp", to)
			if err != nil {
				c.Close()
				continue
			}
			var cut atomic.Bool
			go func() {
				defer d.Close()
				buf := make([]byte, 64<<10)
				armed := false
				for {
					n, err := c.Read(buf)
					if n > 0 {
						if armed { // "after": the first packet
							c.Close()
							return
						}
						if p.arms.Load() > 0 && p.arms.Add(-1) >= 0 {
							switch p.mode {
							case "drop":
								c.Close()
								return
							case "cut":
								cut.Store(true)
								d.Write(buf[:n])
								c.Close()
								return
							default:
								armed = true
							}
						}
						d.Write(buf[:n])
					}
					if err != nil {
						return
					}
				}
			}()
			go func() {
				buf := make([]byte, 64<<10)
				for {
					n, err := d.Read(buf)
					if n > 0 && !cut.Load() {
						c.Write(buf[:n])
					}
					if err != nil {
						c.Close()
						return
					}
				}
			}()
		}
	}()
	return p
}

// A kept stream connection that ends as the next block's header crosses
// it (the datanode closed it idle; or it read the header and the
// connection broke before the ack) must not exclude a healthy datanode:
// the PUT succeeds on the only pipeline of a 3-datanode cluster, the
// segment goes to a new block on a new connection, and the retry is
// counted; the key's later streams on that route open on new connections
// too. A datanode that fails after acking the header, or whose new
// connection then fails, is still excluded. Real cluster (TLS, records);
// the race is made exact by a proxy in front of the first hop.
func TestV2StaleKeptConnectionNotBlamed(t *testing.T) {
	for _, tc := range []struct {
		mode      string
		arms      int32
		stale     uint64 // retries counted
		blamed    bool   // the first hop excluded
		succeeds  bool
		newBlocks bool // the stream after the stale one is on a new block
	}{
		{mode: "drop", arms: 1, stale: 1, succeeds: true, newBlocks: true},
		{mode: "cut", arms: 1, stale: 1, succeeds: true, newBlocks: true},
		{mode: "after", arms: 1, blamed: true},
		// The proxy's second arm catches the retry's new connection's
		// first bytes (its TLS ClientHello) and closes it: a handshake
		// failure (CodeUnreachable), not a second stale (no stale can be
		// said on a new connection); blamed. A second CodeStale is
		// TestV2StaleBoundPerKey's.
		{mode: "drop", arms: 2, stale: 1, blamed: true},
	} {
		name := tc.mode
		if tc.arms > 1 {
			name += ", then the new connection fails"
		}
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			type opened struct {
				local uint64
				first uint64
			}
			var (
				mu      sync.Mutex
				streams []opened
			)
			cl := startBucket(t, ctx, cluster.Config{Datanodes: 3, BlockSize: 4 << 20, ContainerSize: 512 << 20},
				Config{ChunkSize: 1 << 20, MaxBufferBytes: 8 << 20, MaxBlockRetries: 3, RPCTimeout: 20 * time.Second, WaitAllTimeout: 10 * time.Second,
					AllocateWait:  3 * time.Second, // a blamed first hop leaves no pipeline: fail soon
					StreamTimeout: 3 * time.Second,
					OnStream: func(s StreamInfo) {
						mu.Lock()
						streams = append(streams, opened{local: s.LocalID, first: s.Route[0]})
						mu.Unlock()
					}})
			var arms atomic.Int32
			proxies := map[string]*raceProxy{}
			var calls atomic.Int32
			orig := streamDial
			t.Cleanup(func() { streamDial = orig })
			streamDial = func(ctx context.Context, route []stream.Target, pipeline uint64, block stream.BlockID, opts stream.Options) (*stream.Writer, error) {
				r := slices.Clone(route)
				mu.Lock()
				p := proxies[r[0].Addr]
				if p == nil {
					p = startRaceProxy(t, r[0].Addr, tc.mode, &arms)
					proxies[r[0].Addr] = p
				}
				mu.Unlock()
				r[0].Addr = p.lis.Addr().String()
				if calls.Add(1) == 2 {
					// The second block's stream: on the connection the
					// first one handed to the pool.
					arms.Store(tc.arms)
				}
				return orig(ctx, r, pipeline, block, opts)
			}
			rnd := rand.New(rand.NewPCG(3, 4))
			data := make([]byte, 3*(4<<20)+777)
			for i := range data {
				data[i] = byte(rnd.Uint32())
			}
			_, err := cl.PutKey(ctx, "vol", "bkt", "k", bytes.NewReader(data), PutOptions{Pipeline: PipelineV2})
			mu.Lock()
			ss := slices.Clone(streams)
			mu.Unlock()
			dns, _, _ := cl.Excluded()
			ps := cl.StreamPoolStats()
			t.Logf("put: %v; streams %v; excluded datanodes %v; pool %+v; stale retries %d", err, ss, dns, ps, cl.StreamStaleRetries())
			if len(ss) < 2 {
				t.Fatalf("%d streams opened", len(ss))
			}
			if got := cl.StreamStaleRetries(); got != tc.stale || ps.StaleHeaders != tc.stale {
				t.Fatalf("stale retries %d, pool %+v: want %d", got, ps, tc.stale)
			}
			if blamed := slices.Contains(dns, ss[1].first); blamed != tc.blamed {
				t.Fatalf("first hop %d excluded: %v, want %v (excluded %v)", ss[1].first, blamed, tc.blamed, dns)
			}
			if !tc.succeeds {
				return
			}
			if err != nil {
				t.Fatalf("put on a healthy cluster: %v", err)
			}
			if len(dns) != 0 {
				t.Fatalf("datanodes %v excluded on a healthy cluster", dns)
			}
			// 4 blocks (3 full, one of 777 bytes), one segment each, and
			// the abandoned stream.
			if len(ss) != 5 || ss[2].local == ss[1].local {
				t.Fatalf("streams %v: want 5, the abandoned stream's segment on a new block", ss)
			}
			if ps.Dials != 4 {
				t.Fatalf("pool %+v: want the retry and the key's 2 later streams on the route each on a new connection (4 dials)", ps)
			}
			kr, err := cl.GetKey(ctx, "vol", "bkt", "k")
			if err != nil {
				t.Fatal(err)
			}
			got, err := io.ReadAll(kr)
			kr.Close()
			if err != nil || !bytes.Equal(got, data) {
				t.Fatalf("read back %d bytes (err %v), differing", len(got), err)
			}
		})
	}
}

// The stale retry's bounds, with a scripted streamDial (the named streams
// fail as scripted, without a connection; the others are real): at most
// one per segment, and one per datanode named per key; the retry and
// every later stream of the key on that route are Fresh. Each scripted
// failure is a stream.Error as Dial returns it (a CodeStale is returned
// even on a Fresh stream, as a datanode could not make the real Dial
// do: this tests the client's bounds alone).
func TestV2StaleBoundPerKey(t *testing.T) {
	stale := func(hop int) func([]stream.Target) error {
		return func(r []stream.Target) error {
			return &stream.Error{Code: stream.CodeStale, Datanode: r[hop].ID, Addr: r[hop].Addr, Reason: "scripted stale"}
		}
	}
	lost := func(r []stream.Target) error {
		return &stream.Error{Code: stream.CodeConnLost, Datanode: r[0].ID, Addr: r[0].Addr, Reason: "scripted connection lost"}
	}
	for _, tc := range []struct {
		name    string
		size    int                                 // 2 MiB segments, 4 MiB blocks
		script  map[int]func([]stream.Target) error // by stream, from 1
		retries uint64
		blamed  int // hop of the first route excluded; -1: none, the PUT succeeds
	}{
		// The retry of a segment says stale again (another datanode):
		// the segment's one stale retry is spent.
		{name: "stale twice in a segment", size: 1<<20 + 5, script: map[int]func([]stream.Target) error{1: stale(0), 2: stale(1)}, retries: 1, blamed: 1},
		// The retry's new connection fails: the datanode's failure.
		{name: "the fresh stream fails", size: 1<<20 + 5, script: map[int]func([]stream.Target) error{1: stale(0), 2: lost}, retries: 1, blamed: 0},
		// Segment 1 stale on datanode A (retried on a new block), segment
		// 2 stale on A again: blamed (a datanode closing every kept
		// connection as the header crosses is excluded once per key).
		{name: "same datanode again in the key", size: 3 << 20, script: map[int]func([]stream.Target) error{1: stale(0), 3: stale(0)}, retries: 1, blamed: 0},
		// One stale in each of two segments, naming different datanodes:
		// both retried (the segment's flag is reset at its commit),
		// nobody excluded.
		{name: "two segments, two datanodes", size: 3 << 20, script: map[int]func([]stream.Target) error{1: stale(0), 3: stale(1)}, retries: 2, blamed: -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			cl := startBucket(t, ctx, cluster.Config{Datanodes: 3, BlockSize: 4 << 20, ContainerSize: 512 << 20},
				Config{ChunkSize: 1 << 20, MaxBufferBytes: 2 << 20, MaxBlockRetries: 3, RPCTimeout: 20 * time.Second, WaitAllTimeout: 10 * time.Second,
					AllocateWait: 3 * time.Second, StreamTimeout: 3 * time.Second})
			type call struct {
				route string
				first []stream.Target
				fresh bool
			}
			var (
				mu    sync.Mutex
				calls []call
			)
			orig := streamDial
			t.Cleanup(func() { streamDial = orig })
			streamDial = func(ctx context.Context, route []stream.Target, pipeline uint64, block stream.BlockID, opts stream.Options) (*stream.Writer, error) {
				mu.Lock()
				calls = append(calls, call{route: routeKey(route), first: slices.Clone(route), fresh: opts.Fresh})
				n := len(calls)
				mu.Unlock()
				if f := tc.script[n]; f != nil {
					return nil, f(route)
				}
				return orig(ctx, route, pipeline, block, opts)
			}
			rnd := rand.New(rand.NewPCG(5, 6))
			data := make([]byte, tc.size)
			for i := range data {
				data[i] = byte(rnd.Uint32())
			}
			_, err := cl.PutKey(ctx, "vol", "bkt", "k", bytes.NewReader(data), PutOptions{Pipeline: PipelineV2})
			mu.Lock()
			cs := slices.Clone(calls)
			mu.Unlock()
			dns, _, _ := cl.Excluded()
			t.Logf("put: %v; %d streams; excluded datanodes %v; stale retries %d", err, len(cs), dns, cl.StreamStaleRetries())
			if len(cs) < 2 {
				t.Fatalf("%d streams", len(cs))
			}
			if got := cl.StreamStaleRetries(); got != tc.retries {
				t.Fatalf("stale retries %d, want %d", got, tc.retries)
			}
			// Every stream after the first stale one, on its route, is
			// Fresh.
			for i, c := range cs[1:] {
				if c.route == cs[0].route && !c.fresh {
					t.Fatalf("stream %d of the key on the stale route not Fresh", i+2)
				}
			}
			if tc.blamed < 0 {
				if err != nil || len(dns) != 0 {
					t.Fatalf("put %v, excluded %v: want success, nobody excluded", err, dns)
				}
				kr, err := cl.GetKey(ctx, "vol", "bkt", "k")
				if err != nil {
					t.Fatal(err)
				}
				got, err := io.ReadAll(kr)
				kr.Close()
				if err != nil || !bytes.Equal(got, data) {
					t.Fatalf("read back %d bytes (err %v), differing", len(got), err)
				}
				return
			}
			want := cs[0].first[tc.blamed].ID
			if !slices.Contains(dns, want) {
				t.Fatalf("excluded %v: want datanode %d", dns, want)
			}
			if tc.blamed == 1 && slices.Contains(dns, cs[0].first[0].ID) {
				t.Fatalf("excluded %v: the first stale's datanode %d blamed", dns, cs[0].first[0].ID)
			}
		})
	}
}
