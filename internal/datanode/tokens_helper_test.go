package datanode_test

import (
	"context"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/stream"
)

// The tests' block tokens: e.block() records the token the namespace
// issued with each block it opens, and dnClient's calls carry the token
// of the block they name, as the client's do. Tests that write blocks
// no key was opened for (a made-up local ID in an allocated container)
// mint one with the cluster's keys, as the namespace would (e.mint).
var testTokens struct {
	sync.Mutex
	m map[stream.BlockID][]byte
}

func rememberToken(b *metapb.BlockLocation) {
	testTokens.Lock()
	defer testTokens.Unlock()
	if testTokens.m == nil {
		testTokens.m = map[stream.BlockID][]byte{}
	}
	testTokens.m[bid(b)] = b.GetToken()
}

func tokenOf(b stream.BlockID) []byte {
	testTokens.Lock()
	defer testTokens.Unlock()
	return testTokens.m[b]
}

// forgetTokens drops the tokens of a test's cluster (startEnv).
func forgetTokens() {
	testTokens.Lock()
	testTokens.m = nil
	testTokens.Unlock()
}

// mint signs a read+write token for any block, writable through
// pipeline, with the keys the datanodes hold, records it, and returns it.
func (e *env) mint(b stream.BlockID, pipeline uint64) []byte {
	e.t.Helper()
	var ks *blocktoken.KeySet
	for i := range e.c.Datanodes {
		if dn := e.c.Datanode(i); dn != nil && dn.TokenKeys().Len() > 0 {
			ks = dn.TokenKeys()
			break
		}
	}
	tok, err := ks.Issue(time.Now(), blocktoken.Claims{Block: blocktoken.Block{Container: b.Container, Local: b.Local},
		Modes: blocktoken.Read | blocktoken.Write, ExpiryUnixMs: time.Now().Add(time.Hour).UnixMilli(), Pipeline: pipeline})
	if err != nil {
		e.t.Fatal(err)
	}
	testTokens.Lock()
	testTokens.m[b] = tok
	testTokens.Unlock()
	return tok
}

// withTokenOf attaches the recorded token of the block a unary request
// names.
func withTokenOf(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	var id *datanodepb.BlockID
	switch r := req.(type) {
	case *datanodepb.WriteChunkRequest:
		id = r.GetBlock()
	case *datanodepb.PutBlockRequest:
		id = r.GetBlock().GetId()
	case *datanodepb.PutSmallFileRequest:
		id = r.GetBlock().GetId()
	case *datanodepb.GetBlockRequest:
		id = r.GetBlock()
	}
	if id != nil {
		ctx = blocktoken.WithToken(ctx, tokenOf(stream.BlockID{Container: id.GetContainerId(), Local: id.GetLocalId()}))
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}
