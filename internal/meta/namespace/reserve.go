package namespace

import (
	"context"
	"sync"
	"time"

	"github.com/cockroachdb/pebble/v2"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// Block reservations (issue 15): a small PUT without an OpenKey round.
//
// A writer of many small keys (a gateway) reserves blocks of a bucket
// ahead of need with ReserveBlocks: one SCM allocation and ONE Raft entry
// (ReserveBlocksOp) for up to MaxReserveBlocks blocks, each recorded as an
// open key of its own without a name (OpenKeyRow.reserved, with the
// caller's identity in reserved_by), the bucket-level checks of a write
// to that bucket by that caller made first, and write tokens issued for
// the blocks. The writer keeps them in a pool; a small PUT takes one,
// writes its data to the block, and commits with one CommitKey (or in a
// CommitKeys batch) that names the key (CommitKeyRequest.key, and the
// bucket it means): before the log, the caller must be the reserver and
// may write that key (the key-level checks OpenKey makes); in the apply,
// the commit is that of an ordinary open key of that name (the open row
// goes, so a reserved block commits once only; a row of another bucket
// is refused). Everything else of an open key holds: AllocateBlock adds
// blocks to it after a failed write, and a reservation never committed
// expires as an open key does (ExpireOpenKeysOp, its blocks released to
// the deleted table and handed to SCM), after ReservationExpiry rather
// than OpenKeyExpiry: a writer that crashes loses nothing committed and
// leaks nothing beyond the expiry.
//
// Ozone's OM preallocates blocks for a key at open (OpenKey with a size
// hint, as Basalt does); a reservation goes one step further and
// preallocates before the key is known.

const (
	// MaxReserveBlocks bounds one ReserveBlocks call (one AllocateBlocks
	// call's worth, allocChunk).
	MaxReserveBlocks = allocChunk
	// DefaultReservationExpiry is Config.ReservationExpiry's default:
	// well within a block token's lifetime (1 h), well beyond a writer's
	// use of its pool (metaclient keeps a reservation at most a minute).
	DefaultReservationExpiry = 10 * time.Minute
	// reserveScanRows bounds the open rows one expiry round reads
	// looking for expired reservations (the next round goes on from
	// there).
	reserveScanRows = 10000
)

// reserveScan is the leader-only progress of the reservations' expiry.
type reserveScan struct {
	mu   sync.Mutex
	next uint64 // the open ID the next round starts at
	rows int    // reserveScanRows (tests set fewer)
}

// reserverOf is who a reservation is for: the caller of ctx ("" for a
// trusted in-process call without one).
func reserverOf(ctx context.Context) string {
	c, ok := CallerOf(ctx)
	switch {
	case !ok:
		return ""
	case c.Anonymous:
		return "anonymous:"
	case c.Gateway:
		return "gateway:" + c.User
	default:
		return "user:" + c.User
	}
}

// ReserveBlocks reserves req.Count blocks of an object bucket for the
// caller (see above).
func (s *Service) ReserveBlocks(ctx context.Context, req *metapb.ReserveBlocksRequest) (*metapb.ReserveBlocksResponse, error) {
	if err := checkReserveBlocks(req); err != nil {
		return nil, err
	}
	// Before any allocation: a cluster not finalized at the reservations'
	// layout refuses them (the client falls back to OpenKey).
	if err := s.checkLayout(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_ReserveBlocks{}}); err != nil {
		return nil, err
	}
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	b, err := s.st.cachedBucket(req.Volume, req.Bucket) // (read only)
	if err != nil {
		return nil, err
	}
	if b.Layout != metapb.BucketLayout_OBJECT {
		return nil, status.Errorf(codes.FailedPrecondition, "reserve blocks: bucket %q is not an object bucket (open its keys one by one)", req.Bucket)
	}
	if err := s.authz(ctx).Write(req.Volume, req.Bucket, "", "reserve blocks to write"); err != nil {
		return nil, err
	}
	op := &metapb.ReserveBlocksOp{Volume: req.Volume, Bucket: req.Bucket, Replication: req.Replication,
		ChecksumType: req.ChecksumType, BytesPerChecksum: req.BytesPerChecksum, ReservedBy: reserverOf(ctx)}
	if op.Replication == metapb.Replication_REPLICATION_UNSPECIFIED {
		op.Replication = b.Replication
	}
	if op.ChecksumType == metapb.ChecksumType_CHECKSUM_TYPE_UNSPECIFIED {
		op.ChecksumType = metapb.ChecksumType_CRC32C
	}
	if op.BytesPerChecksum == 0 {
		op.BytesPerChecksum = s.cfg.DefaultBytesPerChecksum
	}
	alloc, err := s.blocks.AllocateBlocks(ctx, &metapb.AllocateBlocksRequest{Count: req.Count, Replication: op.Replication,
		Exclude: req.Exclude, ClientLocation: req.ClientLocation, ExpectedBytes: chargeClass(req.ExpectedBytes)})
	if err != nil {
		return nil, err
	}
	if len(alloc.Blocks) != int(req.Count) {
		return nil, status.Errorf(codes.Internal, "namespace: SCM allocated %d blocks for %d", len(alloc.Blocks), req.Count)
	}
	for _, bl := range alloc.Blocks {
		op.Blocks = append(op.Blocks, bl.Id)
	}
	now := s.cfg.Now()
	res, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_ReserveBlocks{ReserveBlocks: op}})
	if err != nil {
		return nil, err
	}
	first, ok := res.(uint64)
	if !ok {
		return nil, applyErr(res)
	}
	if err := s.attachTokens(ctx, alloc.Blocks, writeModes); err != nil {
		return nil, err
	}
	resp := &metapb.ReserveBlocksResponse{BlockSize: alloc.BlockSize, ExpiresUnixMs: now.Add(s.reservationLife()).UnixMilli()}
	for i, bl := range alloc.Blocks {
		resp.Blocks = append(resp.Blocks, &metapb.ReservedBlock{OpenId: first + uint64(i), Block: bl})
		// The promise is also no longer than the blocks' write tokens:
		// a pooled block whose token expired would be refused by its
		// datanodes (TestKeyRotationUnderWriteLoad).
		if c, err := blocktoken.Decode(bl.GetToken()); err == nil && c.ExpiryUnixMs > 0 && c.ExpiryUnixMs < resp.ExpiresUnixMs {
			resp.ExpiresUnixMs = c.ExpiryUnixMs
		}
	}
	return resp, nil
}

// reservationLife is how long a reservation lives: the expiry expires
// a reserved open key at the earlier of its two cutoffs (expireCutoff),
// so at the shorter of ReservationExpiry and OpenKeyExpiry.
func (s *Service) reservationLife() time.Duration {
	return min(s.cfg.ReservationExpiry, s.cfg.OpenKeyExpiry)
}

// reserveBlocks applies a ReserveBlocksOp: a reserved open key per block.
func (t *tx) reserveBlocks(op *metapb.ReserveBlocksOp) any {
	if n := len(op.Blocks); n == 0 || n > MaxReserveBlocks {
		return invalid("reserve blocks: %d blocks, want 1..%d", n, MaxReserveBlocks)
	}
	b, err := t.bucketRO(op.Volume, op.Bucket)
	if err != nil {
		return err
	}
	if b.Layout != metapb.BucketLayout_OBJECT {
		return status.Errorf(codes.FailedPrecondition, "reserve blocks: bucket %q is not an object bucket", op.Bucket)
	}
	first := t.s.nextOpen
	for _, id := range op.Blocks {
		if id == nil {
			continue // (the proposer's blocks all have one)
		}
		row := &metapb.OpenKeyRow{
			OpenId: t.s.nextOpen, BucketId: b.Id, Volume: op.Volume, Bucket: op.Bucket,
			Replication: op.Replication, ChecksumType: op.ChecksumType, BytesPerChecksum: op.BytesPerChecksum,
			Blocks: []*metapb.BlockID{id}, CreatedUnixMs: t.now, Reserved: true, ReservedBy: op.ReservedBy,
		}
		t.s.nextOpen++
		t.put(u64Key(pfxOpen, row.OpenId), row)
	}
	return first
}

// commitName is the name a commit gives the key of row: the request's
// for a reserved row (which has none), else the row's (a part of a
// multipart upload: the upload's key). The request's
// volume and bucket, when given, must be the row's. It sets row.Key to
// it (row is the apply's own decoded copy).
func commitName(row *metapb.OpenKeyRow, b *metapb.Bucket, req *metapb.CommitKeyRequest) error {
	if (req.Volume != "" || req.Bucket != "") && (req.Volume != row.Volume || req.Bucket != row.Bucket) {
		return status.Errorf(codes.PermissionDenied, "commit key: open key %d is of bucket %s/%s, not %s/%s", row.OpenId, row.Volume, row.Bucket, req.Volume, req.Bucket)
	}
	if !row.Reserved {
		if req.Key != "" && req.Key != row.Key {
			return invalid("commit key %q: open key %d is %q", req.Key, row.OpenId, row.Key)
		}
		return nil
	}
	if req.Key == "" {
		return invalid("commit key: open key %d is a block reservation: the commit must name the key", row.OpenId)
	}
	if err := validateKeyFor(b, req.Key); err != nil {
		return err
	}
	row.Key = req.Key
	return nil
}

// writeCommitRow checks a commit before the log (after
// Service.checkCommitRow's checks): the open key's own bucket and key
// (the key the request names for a reserved one), and that a reservation
// is the caller's.
func (a *Authorizer) writeCommitRow(row *metapb.OpenKeyRow, req *metapb.CommitKeyRequest, what string) error {
	if a.trusted {
		return nil
	}
	if err := a.reserver(row); err != nil {
		return err
	}
	if (req.Volume != "" || req.Bucket != "") && (req.Volume != row.Volume || req.Bucket != row.Bucket) {
		return a.deny("%s: open key %d is of bucket %s/%s, not %s/%s", what, row.OpenId, row.Volume, row.Bucket, req.Volume, req.Bucket)
	}
	key := row.Key
	if row.Reserved {
		key = req.Key
	}
	return a.Write(row.Volume, row.Bucket, key, what)
}

// checkCommitRow checks a commit before the log against its open key
// (read from this replica's state), for every caller, trusted ones too:
// what Apply's commitName refuses (another bucket, a reservation
// committed without a name or with one invalid in its bucket's layout,
// an ordinary open key renamed), then the caller's rights (az).
func (s *Service) checkCommitRow(az *Authorizer, req *metapb.CommitKeyRequest, what string) error {
	row, err := s.st.OpenKey(req.OpenId)
	if err != nil {
		return err
	}
	if (req.Volume != "" || req.Bucket != "") && (req.Volume != row.Volume || req.Bucket != row.Bucket) {
		return status.Errorf(codes.PermissionDenied, "%s: open key %d is of bucket %s/%s, not %s/%s", what, row.OpenId, row.Volume, row.Bucket, req.Volume, req.Bucket)
	}
	if !row.Reserved {
		if req.Key != "" && req.Key != row.Key {
			return invalid("%s %q: open key %d is %q", what, req.Key, row.OpenId, row.Key)
		}
	} else {
		if req.Key == "" {
			return invalid("%s: open key %d is a block reservation: the commit must name the key", what, row.OpenId)
		}
		b, err := s.st.cachedBucket(row.Volume, row.Bucket) // (read only)
		if err != nil {
			return err
		}
		if err := validateKeyFor(b, req.Key); err != nil {
			return err
		}
	}
	return az.writeCommitRow(row, req, what)
}

// reservedHere reports whether open key id is a reservation on this
// replica's state. A reservation's commit is authorized on the key only
// then (OpenKey authorized an ordinary open key's), so it is checked
// after a read barrier, as OpenKey is. (A reservation this replica has
// not applied yet is not found here: its check fails, and is made again
// after a barrier.)
func (s *Service) reservedHere(id uint64) bool {
	row, err := s.st.OpenKey(id)
	return err == nil && row.Reserved
}

// WriteRow checks a block allocation for the open key row.
func (a *Authorizer) WriteRow(row *metapb.OpenKeyRow, what string) error {
	if a.trusted {
		return nil
	}
	if err := a.reserver(row); err != nil {
		return err
	}
	return a.Write(row.Volume, row.Bucket, row.Key, what)
}

// reserver refuses a reserved row to anyone but its reserver.
func (a *Authorizer) reserver(row *metapb.OpenKeyRow) error {
	if !row.Reserved || a.trusted {
		return nil
	}
	by := "user:" + a.c.User
	switch {
	case a.c.Anonymous:
		by = "anonymous:"
	case a.c.Gateway:
		by = "gateway:" + a.c.User
	}
	if row.ReservedBy != by {
		return a.deny("use block reservation %d of %s/%s (it is another requester's)", row.OpenId, row.Volume, row.Bucket)
	}
	return nil
}

// expireCutoff is the creation time before which op expires row.
func expireCutoff(row *metapb.OpenKeyRow, op *metapb.ExpireOpenKeysOp) int64 {
	if row.Reserved && op.ReservedOlderThanUnixMs > op.OlderThanUnixMs {
		return op.ReservedOlderThanUnixMs
	}
	return op.OlderThanUnixMs
}

// ExpiredReservations returns up to limit reserved open keys created
// before olderThan, reading at most maxRows open rows from open ID from:
// open IDs grow with time, so the scan stops at the first row (of any
// kind) created after it. next is the open ID to resume from (0: the walk
// is complete, start again from the first).
func (s *State) ExpiredReservations(olderThanUnixMs int64, from uint64, maxRows, limit int) (ids []uint64, next uint64, err error) {
	err = s.view(func(r pebble.Reader) error {
		it, err := r.NewIter(&pebble.IterOptions{LowerBound: u64Key(pfxOpen, from), UpperBound: store.PrefixEnd(pfxOpen)})
		if err != nil {
			return err
		}
		defer it.Close()
		n := 0
		for it.First(); it.Valid(); it.Next() {
			row := &metapb.OpenKeyRow{}
			if err := proto.Unmarshal(it.Value(), row); err != nil {
				return err
			}
			if row.CreatedUnixMs >= olderThanUnixMs {
				break // (the rest are younger)
			}
			if n == maxRows || len(ids) == limit {
				next = row.OpenId
				return it.Error()
			}
			n++
			if row.Reserved {
				ids = append(ids, row.OpenId)
			}
		}
		next = 0
		return it.Error()
	})
	return ids, next, err
}

// expiredOpens is the open keys one expiry round expires: those older
// than the open key expiry and the reservations older than theirs.
func (s *Service) expiredOpens() (*metapb.ExpireOpenKeysOp, error) {
	now := s.cfg.Now()
	op := &metapb.ExpireOpenKeysOp{OlderThanUnixMs: now.Add(-s.cfg.OpenKeyExpiry).UnixMilli(),
		ReservedOlderThanUnixMs: now.Add(-s.cfg.ReservationExpiry).UnixMilli()}
	ids, err := s.st.ExpiredOpenKeys(op.OlderThanUnixMs, s.cfg.ExpireBatch)
	if err != nil {
		return nil, err
	}
	// Resumed where the last round stopped, so that reservations behind
	// more than reserveScanRows older open keys are reached too.
	s.reserveScan.mu.Lock()
	rids, next, err := s.st.ExpiredReservations(op.ReservedOlderThanUnixMs, s.reserveScan.next, s.reserveScan.rows, s.cfg.ExpireBatch)
	if err == nil {
		s.reserveScan.next = next
	}
	s.reserveScan.mu.Unlock()
	if err != nil {
		return nil, err
	}
	seen := make(map[uint64]bool, len(ids))
	for _, id := range ids {
		seen[id] = true
	}
	op.OpenIds = ids
	for _, id := range rids {
		if !seen[id] {
			op.OpenIds = append(op.OpenIds, id)
		}
	}
	return op, nil
}
