package namespace

import (
	"context"
	"fmt"
	"math"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Batched writes: OpenKeys and CommitKeys carry many keys' OpenKey and
// CommitKey calls (a client's coalescer merges concurrent small PUTs into
// them, metaclient/write.go). Each key is validated and authorized on its
// own before anything enters the log; the keys that pass go into ONE
// Raft entry (OpenKeysOp, CommitKeysOp) whose apply runs each op as if it
// had been proposed alone, in order, with its own result: every op
// validates fully before its first write, so a refused op leaves nothing
// behind and the others go on. Apply reads nothing but the entry and the
// state, so a replay after a crash gives the same results and state.

const (
	// MaxWriteBatch bounds the keys of one OpenKeys or CommitKeys call
	// (and of one OpenKeysOp or CommitKeysOp entry).
	MaxWriteBatch = 256
	// MaxWriteBatchBytes bounds the encoded request of one OpenKeys or
	// CommitKeys call: the entry is about that size, and the answer (a
	// KeyInfo per commit, mostly the request's own blocks and meta; a few
	// locations per open) stays well under a client's 4 MiB receive limit.
	MaxWriteBatchBytes = 2 << 20
	// allocChunk is the most blocks one AllocateBlocks call asks for
	// (scm.MaxBlocksPerRequest).
	allocChunk = 64
	// MaxOpenKeysBlocks bounds the blocks one OpenKeys call allocates and
	// answers: each key's first block, and more up front for keys whose
	// size hint asks for them (as OpenKey) while they fit, in the order of
	// the request; a key beyond gets its first block only (and allocates
	// the rest with AllocateBlock as it writes, as any key bigger than its
	// open's blocks). Decided before anything is proposed.
	MaxOpenKeysBlocks = 2 * MaxWriteBatch
	// maxOpenKeysAnswerBytes bounds the estimated encoded OpenKeys answer
	// (half a client's 4 MiB receive limit) the same way: a block counts
	// its location's size plus openTokenAllowance for the token attached
	// after the apply.
	maxOpenKeysAnswerBytes = 2 << 20
	openTokenAllowance     = 1 << 10
)

// batchResult fills a per-key error as the server's interceptor would
// have returned it for method (code, message, and the whole status with
// its details when there are any).
func (s *Service) batchResult(method string, err error) (code uint32, msg string, st []byte) {
	if s.cfg.Translate != nil {
		err = s.cfg.Translate(method, err)
	}
	sts, _ := status.FromError(err)
	if len(sts.Details()) > 0 {
		st, _ = proto.Marshal(sts.Proto())
	}
	return uint32(sts.Code()), sts.Message(), st
}

// openGroup is the opens that one AllocateBlocks call can serve: the same
// replication, client location and exclude list, and the same charge
// class (chargeClass of the size hint), so that SCM charges each block
// against its container what a single OpenKey of that key would.
type openGroup struct {
	req      *metapb.OpenKeyRequest // the first (replication, location, exclude)
	idx      []int
	expected uint64 // the keys' charge class, sent as ExpectedBytes
}

// chargeClass is a size hint rounded as SCM rounds ExpectedBytes when it
// charges a block (scm.chargeFor: up to 4 KiB, whole blocks for 0 or a
// hint of a block or more): keys of one class are charged alike, so one
// AllocateBlocks call with the class as ExpectedBytes charges each key's
// block as OpenKey with its own hint would (for a block size that is a
// multiple of 4 KiB, as SCM's are).
func chargeClass(hint uint64) uint64 {
	if hint > math.MaxUint64-4095 {
		return hint
	}
	return (hint + 4095) &^ 4095
}

// OpenKeys opens many keys: one read barrier, each key validated and
// authorized on its own, the first blocks of the keys that share a
// replication, location and exclude list allocated by one SCM call, and
// one Raft entry for all the opens.
func (s *Service) OpenKeys(ctx context.Context, req *metapb.OpenKeysRequest) (*metapb.OpenKeysResponse, error) {
	if err := s.checkLayout(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_OpenKeys{}}); err != nil {
		return nil, err
	}
	n := len(req.Requests)
	if n > MaxWriteBatch {
		return nil, invalid("OpenKeys of %d keys: at most %d per call", n, MaxWriteBatch)
	}
	if sz := proto.Size(req); sz > MaxWriteBatchBytes {
		return nil, invalid("OpenKeys request of %d bytes: at most %d", sz, MaxWriteBatchBytes)
	}
	errs := make([]error, n)
	reqs := make([]*metapb.OpenKeyRequest, n)
	for i, r := range req.Requests {
		if r == nil {
			errs[i] = invalid("OpenKeys: request %d is empty", i)
			continue
		}
		errs[i] = checkOpenKey(r)
	}
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	az := s.authz(ctx)
	for i, r := range req.Requests {
		if errs[i] != nil {
			continue
		}
		b, err := s.st.cachedBucket(r.Volume, r.Bucket) // (read only)
		if err == nil {
			err = validateKeyFor(b, r.Key)
		}
		if err == nil {
			err = az.Write(r.Volume, r.Bucket, r.Key, "write")
		}
		if err != nil {
			errs[i] = err
			continue
		}
		r = proto.Clone(r).(*metapb.OpenKeyRequest)
		if r.Replication == metapb.Replication_REPLICATION_UNSPECIFIED {
			r.Replication = b.Replication
		}
		if r.ChecksumType == metapb.ChecksumType_CHECKSUM_TYPE_UNSPECIFIED {
			r.ChecksumType = metapb.ChecksumType_CRC32C
		}
		if r.BytesPerChecksum == 0 {
			r.BytesPerChecksum = s.cfg.DefaultBytesPerChecksum
		}
		reqs[i] = r
	}

	// First blocks: one AllocateBlocks per group (of at most allocChunk).
	blocks := make([][]*metapb.BlockLocation, n)
	blockSize := make([]uint64, n)
	var groups []*openGroup
	byKey := map[string]*openGroup{}
	for i, r := range reqs {
		if r == nil {
			continue
		}
		ex, _ := proto.MarshalOptions{Deterministic: true}.Marshal(r.Exclude)
		class := chargeClass(r.SizeHint)
		k := fmt.Sprintf("%d\x00%d\x00%d\x00%s\x00%s", r.Replication, class, len(r.ClientLocation), r.ClientLocation, ex)
		g := byKey[k]
		if g == nil || len(g.idx) == allocChunk {
			g = &openGroup{req: r, expected: class}
			byKey[k] = g
			groups = append(groups, g)
		}
		g.idx = append(g.idx, i)
	}
	for _, g := range groups {
		alloc, err := s.blocks.AllocateBlocks(ctx, &metapb.AllocateBlocksRequest{Count: uint32(len(g.idx)), Replication: g.req.Replication,
			Exclude: g.req.Exclude, ClientLocation: g.req.ClientLocation, ExpectedBytes: g.expected})
		if err == nil && len(alloc.Blocks) != len(g.idx) {
			err = status.Errorf(codes.Internal, "namespace: SCM allocated %d blocks for %d keys", len(alloc.Blocks), len(g.idx))
		}
		for j, i := range g.idx {
			if err != nil {
				errs[i], reqs[i] = err, nil
				continue
			}
			blocks[i], blockSize[i] = alloc.Blocks[j:j+1:j+1], alloc.BlockSize
		}
	}
	s.allocMore(ctx, reqs, blocks, blockSize, errs)

	op := &metapb.OpenKeysOp{}
	var at []int // op.Opens[j] is the key at[j]
	for i, r := range reqs {
		if r != nil {
			op.Opens = append(op.Opens, logOpen(r, blocks[i]))
			at = append(at, i)
		}
	}
	resp := &metapb.OpenKeysResponse{Results: make([]*metapb.OpenKeyResult, n)}
	if len(at) > 0 {
		res, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_OpenKeys{OpenKeys: op}})
		if err != nil {
			return nil, err
		}
		rs, ok := res.([]any)
		if !ok || len(rs) != len(at) {
			return nil, status.Errorf(codes.Internal, "namespace: OpenKeys entry of %d opens applied with result %T", len(at), res)
		}
		for j, i := range at {
			id, ok := rs[j].(uint64)
			if !ok {
				errs[i] = applyErr(rs[j])
				continue
			}
			if err := s.attachTokens(ctx, blocks[i], writeModes); err != nil {
				errs[i] = err
				continue
			}
			resp.Results[i] = &metapb.OpenKeyResult{Open: &metapb.OpenKeyResponse{OpenId: id, Blocks: blocks[i], BlockSize: blockSize[i]}}
		}
	}
	for i, err := range errs {
		if err == nil {
			continue
		}
		out := &metapb.OpenKeyResult{}
		out.Code, out.Message, out.Status = s.batchResult(metapb.Namespace_OpenKey_FullMethodName, err)
		resp.Results[i] = out
	}
	return resp, nil
}

// moreGroup is the extra blocks one AllocateBlocks call serves: keys of
// the same replication, client location and exclude list.
type moreGroup struct {
	req    *metapb.OpenKeyRequest
	idx    []int
	counts []int
	total  int
}

// allocMore gives the keys whose size hint asks for more than their first
// block more blocks up front, as OpenKey does (at most MaxOpenBlocks per
// key, charged as whole blocks), within the call's bounds
// (MaxOpenKeysBlocks, maxOpenKeysAnswerBytes; keys served in request
// order), with one AllocateBlocks call per group of keys that share a
// replication, location and exclude list (up to allocChunk blocks each).
// A key whose extra blocks could not be allocated fails, as its OpenKey
// would.
func (s *Service) allocMore(ctx context.Context, reqs []*metapb.OpenKeyRequest, blocks [][]*metapb.BlockLocation, blockSize []uint64, errs []error) {
	total, size := 0, 0
	for i, r := range reqs {
		if r != nil {
			total += len(blocks[i])
			for _, b := range blocks[i] {
				size += proto.Size(b) + openTokenAllowance
			}
		}
	}
	var groups []*moreGroup
	byKey := map[string]*moreGroup{}
	for i, r := range reqs {
		if r == nil || len(blocks[i]) == 0 {
			continue
		}
		m := int(min(r.SizeHint/max(blockSize[i], 1), MaxOpenBlocks-1))
		per := proto.Size(blocks[i][0]) + openTokenAllowance
		m = min(m, MaxOpenKeysBlocks-total, (maxOpenKeysAnswerBytes-size)/per)
		if m <= 0 {
			continue
		}
		total, size = total+m, size+m*per
		ex, _ := proto.MarshalOptions{Deterministic: true}.Marshal(r.Exclude)
		k := fmt.Sprintf("%d\x00%d\x00%s\x00%s", r.Replication, len(r.ClientLocation), r.ClientLocation, ex)
		g := byKey[k]
		if g == nil || g.total+m > allocChunk {
			g = &moreGroup{req: r}
			byKey[k] = g
			groups = append(groups, g)
		}
		g.idx, g.counts, g.total = append(g.idx, i), append(g.counts, m), g.total+m
	}
	for _, g := range groups {
		more, err := s.blocks.AllocateBlocks(ctx, &metapb.AllocateBlocksRequest{Count: uint32(g.total), Replication: g.req.Replication,
			Exclude: g.req.Exclude, ClientLocation: g.req.ClientLocation})
		if err == nil && len(more.Blocks) != g.total {
			err = status.Errorf(codes.Internal, "namespace: SCM allocated %d blocks for %d", len(more.Blocks), g.total)
		}
		off := 0
		for j, i := range g.idx {
			if err != nil {
				errs[i], reqs[i] = err, nil
				continue
			}
			blocks[i] = append(blocks[i], more.Blocks[off:off+g.counts[j]]...)
			off += g.counts[j]
		}
	}
}

// applyErr is an op's failed apply result as an error.
func applyErr(r any) error {
	if err, ok := r.(error); ok {
		return err
	}
	return status.Errorf(codes.Internal, "namespace: unexpected apply result %T", r)
}

// checkCommits checks and authorizes commit requests (CommitKey,
// CommitKeys) before the log: each request's error, nil for those that
// pass, or an error of the whole call (a failed barrier). An ordinary
// open key's write was authorized at OpenKey against current state (after
// a read barrier); a stale state here can at worst let through the commit
// of that already authorized write, or miss an open key committed a
// moment ago (a leader elected since): then it is checked again after a
// barrier. (The small-object path commits many keys: no barrier when none
// is needed.) A reservation's key is authorized here only: after a
// barrier first, as OpenKey's.
func (s *Service) checkCommits(ctx context.Context, reqs []*metapb.CommitKeyRequest) ([]error, error) {
	errs := make([]error, len(reqs))
	fresh := false
	for _, r := range reqs {
		if r != nil && s.reservedHere(r.OpenId) {
			fresh = true
			break
		}
	}
	if fresh {
		if err := s.current(ctx); err != nil {
			return nil, err
		}
	}
	az := s.authz(ctx)
	var again []int // refused on this replica's state: check after a barrier
	for i, r := range reqs {
		if r == nil {
			errs[i] = invalid("CommitKeys: request %d is empty", i)
			continue
		}
		if err := checkCommitKey(r); err != nil {
			errs[i] = err
			continue
		}
		if err := validateAcls(r.Acls, "commit"); err != nil {
			errs[i] = err
			continue
		}
		if err := s.checkCommitRow(az, r, "commit"); err != nil {
			if fresh {
				errs[i] = err
			} else {
				again = append(again, i)
			}
		}
	}
	if len(again) > 0 {
		if err := s.current(ctx); err != nil {
			return nil, err
		}
		az = s.authz(ctx)
		for _, i := range again {
			errs[i] = s.checkCommitRow(az, reqs[i], "commit")
		}
	}
	return errs, nil
}

// CommitKeys commits many open keys in one Raft entry. Each key is
// checked and authorized on its own (as CommitKey: against the open key,
// with a read barrier only when some key is refused or missing on this
// replica's state); the apply then commits each in order, and a missing
// open key, a stale block list or a failed precondition fails only its
// own key. An error of the whole call (the entry's outcome unknown, no
// leader) is every key's: the client settles each as it settles a
// CommitKey.
func (s *Service) CommitKeys(ctx context.Context, req *metapb.CommitKeysRequest) (*metapb.CommitKeysResponse, error) {
	if err := s.checkLayout(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_CommitKeys{}}); err != nil {
		return nil, err
	}
	n := len(req.Requests)
	if n > MaxWriteBatch {
		return nil, invalid("CommitKeys of %d keys: at most %d per call", n, MaxWriteBatch)
	}
	if sz := proto.Size(req); sz > MaxWriteBatchBytes {
		return nil, invalid("CommitKeys request of %d bytes: at most %d", sz, MaxWriteBatchBytes)
	}
	errs, err := s.checkCommits(ctx, req.Requests)
	if err != nil {
		return nil, err
	}
	op := &metapb.CommitKeysOp{}
	var at []int
	for i, r := range req.Requests {
		if errs[i] == nil {
			op.Commits = append(op.Commits, r)
			at = append(at, i)
		}
	}
	resp := &metapb.CommitKeysResponse{Results: make([]*metapb.CommitKeyResult, n)}
	if len(at) > 0 {
		res, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_CommitKeys{CommitKeys: op}})
		if err != nil {
			return nil, err
		}
		rs, ok := res.([]any)
		if !ok || len(rs) != len(at) {
			return nil, status.Errorf(codes.Internal, "namespace: CommitKeys entry of %d commits applied with result %T", len(at), res)
		}
		for j, i := range at {
			if ki, ok := rs[j].(*metapb.KeyInfo); ok {
				resp.Results[i] = &metapb.CommitKeyResult{Key: ki}
			} else {
				errs[i] = applyErr(rs[j])
			}
		}
	}
	for i, err := range errs {
		if err == nil {
			continue
		}
		out := &metapb.CommitKeyResult{}
		out.Code, out.Message, out.Status = s.batchResult(metapb.Namespace_CommitKey_FullMethodName, err)
		resp.Results[i] = out
	}
	return resp, nil
}

// openKeys applies an OpenKeysOp: each open as if proposed alone.
func (t *tx) openKeys(op *metapb.OpenKeysOp) any {
	if n := len(op.Opens); n > MaxWriteBatch {
		return invalid("open keys: %d in one entry, at most %d", n, MaxWriteBatch)
	}
	res := make([]any, len(op.Opens))
	for i, o := range op.Opens {
		if o.GetRequest() == nil {
			res[i] = invalid("open keys: op %d has no request", i)
			continue
		}
		res[i] = t.openKey(o)
	}
	return res
}

// commitKeys applies a CommitKeysOp: each commit as if proposed alone.
func (t *tx) commitKeys(op *metapb.CommitKeysOp) any {
	if n := len(op.Commits); n > MaxWriteBatch {
		return invalid("commit keys: %d in one entry, at most %d", n, MaxWriteBatch)
	}
	res := make([]any, len(op.Commits))
	for i, c := range op.Commits {
		if c == nil {
			res[i] = invalid("commit keys: op %d is empty", i)
			continue
		}
		res[i] = t.commitKey(c)
	}
	return res
}
