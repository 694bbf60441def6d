package client

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/cluster"
)

// TestV2ReusesStreamConnections: a V2 key of several blocks on one
// pipeline opens one stream connection per route (the client's pool hands
// it from each block's stream to the next of the same route), and reads back intact; so does the
// next key. Real cluster (3 datanodes, TLS, records).
func TestV2ReusesStreamConnections(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	var (
		mu      sync.Mutex
		routes  = map[string]bool{} // the order of the route is the connection's
		streams uint64
	)
	cl := startBucket(t, ctx, cluster.Config{Datanodes: 3, BlockSize: 4 << 20, ContainerSize: 512 << 20},
		Config{ChunkSize: 1 << 20, MaxBufferBytes: 8 << 20, RPCTimeout: 20 * time.Second, WaitAllTimeout: 10 * time.Second, OnStream: func(s StreamInfo) {
			mu.Lock()
			routes[fmt.Sprint(s.Route)] = true
			streams++
			mu.Unlock()
		}})
	if cl.streamTLS == nil {
		t.Fatal("the cluster's streams are not secured")
	}
	rnd := rand.New(rand.NewPCG(7, 8))
	data := make([]byte, 4*(4<<20)+999)
	for i := range data {
		data[i] = byte(rnd.Uint32())
	}
	for _, key := range []string{"a", "b"} {
		ki, err := cl.PutKey(ctx, "vol", "bkt", key, bytes.NewReader(data), PutOptions{Pipeline: PipelineV2})
		if err != nil {
			t.Fatalf("put %s: %v", key, err)
		}
		if ki.Pipeline != "v2" || ki.Size != uint64(len(data)) {
			t.Fatalf("put %s: pipeline %q size %d", key, ki.Pipeline, ki.Size)
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
	// 2 keys × 5 blocks = 10 streams, on as many connections as routes
	// (the datanodes of the one pipeline, in the orders the metadata
	// service gave).
	ps := cl.StreamPoolStats()
	mu.Lock()
	defer mu.Unlock()
	t.Logf("pool: %+v; %d streams on routes %v", ps, streams, routes)
	if streams != 10 || ps.Dials != uint64(len(routes)) || ps.Reuses != streams-uint64(len(routes)) {
		t.Fatalf("pool %+v: want %d dials (one per route) and %d streams on kept connections", ps, len(routes), streams-uint64(len(routes)))
	}
}
