package cluster_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/stream"
)

// Block tokens (issue 13): each attack an attacker on the network could
// make on a datanode's data port, refused.

func startWith(t *testing.T, keys scm.SecretKeyConfig) *cluster.Cluster {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := cluster.Start(ctx, cluster.Config{Dir: t.TempDir(), Datanodes: 3,
		HeartbeatInterval: 200 * time.Millisecond, TickInterval: 50 * time.Millisecond,
		BlockSize: 16 << 20, ContainerSize: 512 << 20, SecretKeys: keys})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	rawDial = c.DatanodeDialOption()
	return c
}

// rawDial authenticates rawDN to the datanodes of the cluster startWith
// started last (with a client certificate: only the block token is missing).
var rawDial grpc.DialOption

func rawDN(t *testing.T, addr string) datanodepb.DatanodeClient {
	t.Helper()
	cc, err := grpc.NewClient(addr, rawDial)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return datanodepb.NewDatanodeClient(cc)
}

// denied fails the test unless err is PERMISSION_DENIED of kind want.
func denied(t *testing.T, what string, err error, want datanodepb.Error_Kind) {
	t.Helper()
	st, _ := status.FromError(err)
	var kind datanodepb.Error_Kind
	for _, d := range st.Details() {
		if e, ok := d.(*datanodepb.Error); ok {
			kind = e.GetKind()
		}
	}
	if st.Code() != codes.PermissionDenied || kind != want {
		t.Fatalf("%s: got %v (kind %v), want PERMISSION_DENIED %v", what, err, kind, want)
	}
	t.Logf("%s: refused: %s", what, st.Message())
}

func readBlock(ctx context.Context, dn datanodepb.DatanodeClient, id *metapb.BlockID) ([]byte, error) {
	st, err := dn.ReadBlock(ctx, &datanodepb.ReadBlockRequest{Block: &datanodepb.BlockID{ContainerId: id.GetContainerId(), LocalId: id.GetLocalId()}})
	if err != nil {
		return nil, err
	}
	var out []byte
	for {
		m, err := st.Recv()
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		out = append(out, m.GetData()...)
	}
}

func smallReq(pipeline uint64, cid, lid uint64, data []byte) *datanodepb.PutSmallFileRequest {
	sum := storage.DefaultChecksum.Compute(data)
	return &datanodepb.PutSmallFileRequest{PipelineId: pipeline, WaitTimeoutMs: 10000, Data: data,
		Block: &datanodepb.BlockData{Id: &datanodepb.BlockID{ContainerId: cid, LocalId: lid}, Length: uint64(len(data)),
			Chunks: []*datanodepb.ChunkInfo{{Offset: 0, Length: uint64(len(data)), Checksum: &datanodepb.ChecksumData{
				Type: datanodepb.ChecksumType(sum.Type), BytesPerChecksum: sum.BytesPerChecksum, Sums: sum.Sums}}}}}
}

// TestBlockTokenAttacks: reads by block ID without a token, with another
// block's token, with a forged or an expired one; writes into containers
// SCM never allocated (container 0 included) or with a read token; V2
// stream headers without a token or with another block's: all refused
// with PERMISSION_DENIED, and nothing is created or served. The client
// itself, which passes the namespace's tokens, reads and writes as
// before.
func TestBlockTokenAttacks(t *testing.T) {
	c := startWith(t, scm.SecretKeyConfig{})
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	a, b := randData(1, 5000), randData(2, 7000)
	for k, d := range map[string][]byte{"a": a, "b": b} {
		if _, err := cl.PutKey(ctx, "vol", "bkt", k, bytes.NewReader(d), client.PutOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	mc, err := metaclient.New(metaclient.Config{Addrs: []string{c.MetaAddr()}, DialOptions: []grpc.DialOption{c.MetaDialOption()}})
	if err != nil {
		t.Fatal(err)
	}
	defer mc.Close()
	lookup := func(key string) *metapb.BlockLocation {
		ki, err := mc.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: key})
		if err != nil {
			t.Fatal(err)
		}
		l := ki.GetLocations()[0]
		if len(l.GetToken()) == 0 {
			t.Fatalf("LookupKey %s returned a location without a token", key)
		}
		return l
	}
	la, lb := lookup("a"), lookup("b")
	dn := rawDN(t, la.GetDatanodes()[0].GetDataAddr())
	before := c.Datanode(0).TokensRefused() + c.Datanode(1).TokensRefused() + c.Datanode(2).TokensRefused()

	// The genuine token reads the block.
	if got, err := readBlock(blocktoken.WithToken(ctx, la.GetToken()), dn, la.GetId()); err != nil || !bytes.Equal(got, a) {
		t.Fatalf("read with the namespace's token: %d bytes, %v", len(got), err)
	}
	// Read a block by ID without a token.
	_, err = readBlock(ctx, dn, la.GetId())
	denied(t, "ReadBlock without a token", err, datanodepb.Error_TOKEN_INVALID)
	_, err = dn.GetBlock(ctx, &datanodepb.GetBlockRequest{Block: &datanodepb.BlockID{ContainerId: la.GetId().GetContainerId(), LocalId: la.GetId().GetLocalId()}})
	denied(t, "GetBlock without a token", err, datanodepb.Error_TOKEN_INVALID)
	// Block A's token for block B.
	if dnb := rawDN(t, lb.GetDatanodes()[0].GetDataAddr()); true {
		_, err = readBlock(blocktoken.WithToken(ctx, la.GetToken()), dnb, lb.GetId())
		denied(t, "block A's token used for block B", err, datanodepb.Error_TOKEN_INVALID)
	}
	// A forged token: the right claims under a key SCM never made.
	forger, _ := blocktoken.NewKeySet([]blocktoken.Key{{ID: 1, Secret: bytes.Repeat([]byte{1}, blocktoken.SecretSize)}})
	claims, _ := blocktoken.Decode(la.GetToken())
	forged, _ := forger.Issue(time.Now(), blocktoken.Claims{Block: claims.Block, Modes: blocktoken.Read | blocktoken.Write, ExpiryUnixMs: time.Now().Add(time.Hour).UnixMilli()})
	_, err = readBlock(blocktoken.WithToken(ctx, forged), dn, la.GetId())
	denied(t, "forged token", err, datanodepb.Error_TOKEN_INVALID)
	// An expired token, genuinely signed (with the cluster's keys, as the
	// namespace would have an hour ago).
	keys := c.Datanode(0).TokenKeys()
	expired, err := keys.Issue(time.Now(), blocktoken.Claims{Block: claims.Block, Modes: blocktoken.Read, ExpiryUnixMs: time.Now().Add(-time.Second).UnixMilli()})
	if err != nil {
		t.Fatal(err)
	}
	_, err = readBlock(blocktoken.WithToken(ctx, expired), dn, la.GetId())
	denied(t, "expired token", err, datanodepb.Error_TOKEN_EXPIRED)

	// Copy a whole container out (replication's ExportContainer) without
	// SCM's container token, or with a block's token.
	// A client certificate may not call it at all (mTLS role check); a
	// datanode's certificate still needs SCM's container token.
	if st, err := dn.ExportContainer(ctx, &datanodepb.ExportContainerRequest{ContainerId: la.GetId().GetContainerId()}); err == nil {
		if _, err = st.Recv(); status.Code(err) != codes.PermissionDenied {
			t.Fatalf("ExportContainer with a client certificate: %v, want PERMISSION_DENIED", err)
		}
	} else if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("ExportContainer with a client certificate: %v, want PERMISSION_DENIED", err)
	}
	peerCreds, err := c.Credentials(pki.Identity{Role: pki.RoleDatanode, ID: "token-test-peer"})
	if err != nil {
		t.Fatal(err)
	}
	pcc, err := grpc.NewClient(la.GetDatanodes()[0].GetDataAddr(), peerCreds.GRPCDialOption(pki.RoleDatanode))
	if err != nil {
		t.Fatal(err)
	}
	defer pcc.Close()
	peer := datanodepb.NewDatanodeClient(pcc)
	for _, tok := range [][]byte{nil, la.GetToken()} {
		st, err := peer.ExportContainer(ctx, &datanodepb.ExportContainerRequest{ContainerId: la.GetId().GetContainerId(), Token: tok})
		if err == nil {
			_, err = st.Recv()
		}
		denied(t, fmt.Sprintf("ExportContainer with token of %d bytes", len(tok)), err, datanodepb.Error_TOKEN_INVALID)
	}

	// Writes: into an unallocated container, container 0 included, with
	// no token or a forged one; into block A's container with A's read
	// token (for A, and for a block next to it).
	pipeline := la.GetPipelineId()
	var leader datanodepb.DatanodeClient
	for i := range c.Datanodes {
		if d := c.Datanode(i); d != nil && d.IsPipelineLeader(pipeline) {
			leader = rawDN(t, d.Addr())
		}
	}
	if leader == nil {
		t.Fatalf("no leader for pipeline %d", pipeline)
	}
	data := randData(3, 4096)
	for _, cid := range []uint64{0, 999_999} {
		_, err = leader.PutSmallFile(ctx, smallReq(pipeline, cid, 1, data))
		if cid == 0 {
			// Container 0 is refused as a bad request before the token is
			// even looked at; either way nothing is created.
			if status.Code(err) != codes.InvalidArgument && status.Code(err) != codes.PermissionDenied {
				t.Fatalf("PutSmallFile into container 0: %v", err)
			}
		} else {
			denied(t, fmt.Sprintf("PutSmallFile into container %d without a token", cid), err, datanodepb.Error_TOKEN_INVALID)
		}
		wc := &datanodepb.WriteChunkRequest{PipelineId: pipeline, Block: &datanodepb.BlockID{ContainerId: cid, LocalId: 1},
			Chunk: smallReq(pipeline, cid, 1, data).GetBlock().GetChunks()[0], Data: data}
		_, err = leader.WriteChunk(blocktoken.WithToken(ctx, forged), wc)
		if cid != 0 {
			denied(t, fmt.Sprintf("WriteChunk into container %d with a forged token", cid), err, datanodepb.Error_TOKEN_INVALID)
		} else if err == nil {
			t.Fatal("WriteChunk into container 0 accepted")
		}
		for i := range c.Datanodes {
			if _, err := c.Datanode(i).Store().Container(storage.ContainerID(cid)); !errors.Is(err, storage.ErrContainerNotFound) {
				t.Fatalf("datanode %d has container %d after refused writes: %v", i, cid, err)
			}
		}
	}
	_, err = leader.PutSmallFile(blocktoken.WithToken(ctx, la.GetToken()), smallReq(pipeline, la.GetId().GetContainerId(), la.GetId().GetLocalId()+1000, data))
	denied(t, "read token of A used to write a block next to A", err, datanodepb.Error_TOKEN_INVALID)
	_, err = leader.PutBlock(blocktoken.WithToken(ctx, la.GetToken()), &datanodepb.PutBlockRequest{PipelineId: pipeline, WaitAll: true,
		Block: &datanodepb.BlockData{Id: &datanodepb.BlockID{ContainerId: la.GetId().GetContainerId(), LocalId: la.GetId().GetLocalId()}}})
	denied(t, "read token of A used to rewrite A", err, datanodepb.Error_TOKEN_INVALID)

	// V2 stream headers: no token, and another block's write token.
	open, err := mc.Namespace.OpenKey(ctx, &metapb.OpenKeyRequest{Volume: "vol", Bucket: "bkt", Key: "v2", ClientLocation: "/dc1/rack1"})
	if err != nil {
		t.Fatal(err)
	}
	ob := open.GetBlocks()[0]
	route, err := stream.Route(ob.GetDatanodes(), "/dc1/rack1")
	if err != nil {
		t.Fatal(err)
	}
	sid := stream.BlockID{Container: ob.GetId().GetContainerId(), Local: ob.GetId().GetLocalId()}
	other := stream.BlockID{Container: sid.Container, Local: sid.Local + 77}
	for _, tc := range []struct {
		name string
		blk  stream.BlockID
		tok  []byte
	}{{"stream header without a token", sid, nil}, {"stream header with another block's token", other, ob.GetToken()}} {
		var se *stream.Error
		_, err := stream.Dial(ctx, route, ob.GetPipelineId(), tc.blk, stream.Options{Token: tc.tok, TLS: c.ClientCredentials().ClientTLS(pki.RoleDatanode)})
		if !errors.As(err, &se) || se.Code != stream.CodePermissionDenied || se.Datanode != route[0].ID {
			t.Fatalf("%s: %v, want permission denied by datanode %d", tc.name, err, route[0].ID)
		}
		t.Logf("%s: refused: %v", tc.name, err)
	}
	// With the right token every hop accepts it.
	w, err := stream.Dial(ctx, route, ob.GetPipelineId(), sid, stream.Options{Token: ob.GetToken(), TLS: c.ClientCredentials().ClientTLS(pki.RoleDatanode)})
	if err != nil {
		t.Fatalf("stream with the namespace's token: %v", err)
	}
	w.Abort()

	after := c.Datanode(0).TokensRefused() + c.Datanode(1).TokensRefused() + c.Datanode(2).TokensRefused()
	if after-before < 12 {
		t.Fatalf("datanodes counted %d token refusals, want at least 12", after-before)
	}
	// The client, which passes the namespace's tokens, still reads.
	r, err := cl.GetKey(ctx, "vol", "bkt", "b")
	if err != nil {
		t.Fatal(err)
	}
	if got, err := io.ReadAll(r); err != nil || !bytes.Equal(got, b) {
		t.Fatalf("client read: %d bytes, %v", len(got), err)
	}
}

// TestExpiredReadTokenIsRefreshed: a reader whose tokens expired (short
// lifetime) is refused once per block, looks the key up again for fresh
// tokens, and reads on.
func TestExpiredReadTokenIsRefreshed(t *testing.T) {
	c := startWith(t, scm.SecretKeyConfig{TokenLifetime: 1500 * time.Millisecond})
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	data := randData(4, 100_000)
	if _, err := cl.PutKey(ctx, "vol", "bkt", "k", bytes.NewReader(data), client.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	r, err := cl.GetKey(ctx, "vol", "bkt", "k")
	if err != nil {
		t.Fatal(err)
	}
	refused := func() uint64 {
		var n uint64
		for i := range c.Datanodes {
			n += c.Datanode(i).TokensRefused()
		}
		return n
	}
	before := refused()
	time.Sleep(2 * time.Second) // past the tokens' expiry
	got, err := io.ReadAll(r)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read after the tokens expired: %d bytes, %v", len(got), err)
	}
	if n := refused() - before; n != 1 {
		t.Fatalf("%d refusals, want exactly 1 (the expired token, then the refreshed one)", n)
	}
}

// TestKeyRotationUnderWriteLoad: SCM rotates its keys every 600 ms (each
// active 2 s (10 heartbeats) after it is recorded, tokens living 2 s)
// while writers and readers run; no datanode refuses a single token,
// several keys sign tokens, and retired keys are dropped.
func TestKeyRotationUnderWriteLoad(t *testing.T) {
	kc := scm.SecretKeyConfig{Rotation: 600 * time.Millisecond, ActivationDelay: 2 * time.Second, TokenLifetime: 2 * time.Second}
	c := startWith(t, kc)
	cl := newClient(t, c, "/dc1/rack1")
	makeBucket(t, cl, "vol", "bkt")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	mc, err := metaclient.New(metaclient.Config{Addrs: []string{c.MetaAddr()}, DialOptions: []grpc.DialOption{c.MetaDialOption()}})
	if err != nil {
		t.Fatal(err)
	}
	defer mc.Close()
	var ops atomic.Int64
	signers := map[uint64]bool{}
	var mu sync.Mutex
	errc := make(chan error, 8)
	deadline := time.Now().Add(6 * time.Second)
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; time.Now().Before(deadline); i++ {
				key := fmt.Sprintf("w%d-%d", w, i)
				data := randData(int64(w*100000+i), 2000+(i%7)*30000)
				if _, err := cl.PutKey(ctx, "vol", "bkt", key, bytes.NewReader(data), client.PutOptions{}); err != nil {
					errc <- fmt.Errorf("put %s: %w", key, err)
					return
				}
				r, err := cl.GetKey(ctx, "vol", "bkt", key)
				if err != nil {
					errc <- err
					return
				}
				if got, err := io.ReadAll(r); err != nil || !bytes.Equal(got, data) {
					errc <- fmt.Errorf("read %s: %d bytes, %v", key, len(got), err)
					return
				}
				ops.Add(1)
				// Which key signed the namespace's tokens now.
				ki, err := mc.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{Volume: "vol", Bucket: "bkt", Key: key})
				if err != nil {
					errc <- err
					return
				}
				claims, err := blocktoken.Decode(ki.GetLocations()[0].GetToken())
				if err != nil {
					errc <- err
					return
				}
				mu.Lock()
				signers[claims.KeyID] = true
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
	// Rotation must not make a datanode refuse a token (unknown or
	// retired key). A token that expired is another matter: on a loaded
	// machine a 2 s token can expire between the lookup and a read, and
	// the client renews it (a refusal counted, the read succeeds: every
	// operation above did).
	var refused, expired uint64
	for i := range c.Datanodes {
		refused += c.Datanode(i).TokensRefused()
		expired += c.Datanode(i).TokensExpired()
	}
	held := c.Datanode(0).TokenKeys().Len()
	t.Logf("%d writes+reads; keys that signed tokens %d, held at the end %d; refusals %d (of which expired %d)", ops.Load(), len(signers), held, refused, expired)
	if refused != expired {
		t.Fatalf("%d token refusals during rotation that were not expiries, want 0", refused-expired)
	}
	if expired > uint64(ops.Load())/10 {
		t.Fatalf("%d expired-token refusals in %d operations: tokens are not renewed", expired, ops.Load())
	}
	if len(signers) < 4 {
		t.Fatalf("only %d keys signed tokens in 6 s of 600 ms rotation", len(signers))
	}
	// A key lives about ActivationDelay + Rotation (until the next one
	// signs) + TokenLifetime + ActivationDelay: retired keys go.
	if bound := int((2*kc.ActivationDelay+kc.TokenLifetime+kc.Rotation)/kc.Rotation) + 2; held > bound {
		t.Fatalf("datanodes hold %d keys, more than the %d rotation keeps; retired keys are not dropped", held, bound)
	}
}
