package namespace

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"runtime"
	"slices"
	"sync/atomic"

	"github.com/cockroachdb/pebble/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// Pebble key layout of the namespace group (integers big-endian uint64):
//
//	v/<volume>                          Volume
//	b/<volume>\x00<bucket>              Bucket (\x00 cannot occur in names)
//	k/<bucket id><key>                  KeyInfo, object buckets
//	f/<bucket id><parent dir id><name>  FsEntry, fs buckets (root dir id 0)
//	o/<open id>                         OpenKeyRow, until commit or expiry
//	x/<seq>                             DeletedRow: blocks to hand to SCM
//	y/<seq>                             PendingDirRow: deleted directory whose
//	                                    children are still to be reclaimed
//	r/<container id><local id>          holders of a shared block (≥ 2; see
//	                                    refs.go)
//	m/next_bucket, m/next_open, m/next_id   counters (next_id: dir ids,
//	                                    object ids and seqs)
//
// Keys of one bucket share the prefix k/<bucket id>, so a listing page is
// one seek and a short scan, and a bucket deleted and re-created under the
// same name starts empty.
var (
	pfxVolume  = []byte("v/")
	pfxBucket  = []byte("b/")
	pfxKey     = []byte("k/")
	pfxFs      = []byte("f/")
	pfxOpen    = []byte("o/")
	pfxDeleted = []byte("x/")
	pfxPending = []byte("y/")
	keyNextBkt = []byte("m/next_bucket")
	keyNextOpn = []byte("m/next_open")
	keyNextID  = []byte("m/next_id")
	keyToken   = []byte("m/service_token")
)

func cat(parts ...[]byte) []byte {
	n := 0
	for _, p := range parts {
		n += len(p)
	}
	out := make([]byte, 0, n)
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

func volumeKey(v string) []byte        { return cat(pfxVolume, []byte(v)) }
func bucketKey(v, b string) []byte     { return cat(pfxBucket, []byte(v), []byte{0}, []byte(b)) }
func objPrefix(bucketID uint64) []byte { return cat(pfxKey, store.U64(bucketID)) }
func objKey(bucketID uint64, k string) []byte {
	return cat(pfxKey, store.U64(bucketID), []byte(k))
}
func fsPrefix(bucketID, parent uint64) []byte {
	return cat(pfxFs, store.U64(bucketID), store.U64(parent))
}
func fsKey(bucketID, parent uint64, name string) []byte {
	return cat(pfxFs, store.U64(bucketID), store.U64(parent), []byte(name))
}
func u64Key(pfx []byte, id uint64) []byte { return cat(pfx, store.U64(id)) }

// State is the namespace state machine. Apply runs on one goroutine;
// readers go straight to Pebble (committed state) and need no lock.
type State struct {
	st *store.Store
	// counters, touched only by Apply (and load).
	nextBucket, nextOpen, nextID uint64
	buckets                      bucketCache
	// applied caches rows Apply reads (applycache.go); Apply's own.
	applied applyCache
	// lookups caches encoded key records for the read path
	// (lookupcache.go); Apply keeps it exact.
	lookups *lookupCache
	// s3Gen changes after every applied change of an S3 key (and a
	// restore): caches of S3 keys (the user-token check) compare it.
	s3Gen atomic.Uint64
	// layout: versions and the apply halt (layout.go).
	layout layoutState
}

// Open opens the namespace state in dir.
func Open(dir string, opts store.Options) (*State, error) { return OpenSupporting(dir, opts, 0) }

// OpenSupporting is Open for a replica that supports layouts up to
// supported only (0: this binary's; SetSupportedLayout; tests: an older
// binary, from the load on).
func OpenSupporting(dir string, opts store.Options, supported uint32) (*State, error) {
	st, err := store.Open(dir, opts)
	if err != nil {
		return nil, err
	}
	s := &State{st: st, lookups: newLookupCache(0)}
	s.layout.supported.Store(supported)
	if err := s.openFresh(dir, opts.FS); err != nil {
		st.Close()
		return nil, err
	}
	if err := s.load(); err != nil {
		st.Close()
		return nil, err
	}
	return s, nil
}

func (s *State) load() error {
	if err := s.loadRows(); err != nil {
		return err
	}
	if s.layout.clearHalt {
		s.layout.clearHalt = false
		return s.clearHalt() // an older binary's halt (layout.go)
	}
	return nil
}

func (s *State) loadRows() error {
	s.nextBucket, s.nextOpen, s.nextID = 1, 1, 1
	return s.st.View(func(r pebble.Reader) error {
		if err := s.loadLayout(r); err != nil {
			return err
		}
		for _, c := range []struct {
			k   []byte
			dst *uint64
		}{{keyNextBkt, &s.nextBucket}, {keyNextOpn, &s.nextOpen}, {keyNextID, &s.nextID}} {
			v, closer, err := r.Get(c.k)
			if errors.Is(err, pebble.ErrNotFound) {
				continue
			}
			if err != nil {
				return err
			}
			*c.dst = decodeU64(v)
			closer.Close()
		}
		return nil
	})
}

func decodeU64(v []byte) uint64 {
	if len(v) != 8 {
		panic(fmt.Sprintf("namespace: 8-byte integer has %d bytes", len(v)))
	}
	var x uint64
	for _, c := range v {
		x = x<<8 | uint64(c)
	}
	return x
}

// Close closes the store.
func (s *State) Close() error { return s.st.Close() }

// Store exposes the underlying store.
func (s *State) Store() *store.Store { return s.st }

// AppliedIndex is the durable applied index (raft.StateMachine).
func (s *State) AppliedIndex() uint64 { return s.st.DurableIndex() }

// Snapshot returns a checkpoint stream (raft.StateMachine).
func (s *State) Snapshot() (uint64, io.ReadCloser, error) { return s.st.Snapshot() }

// Restore replaces the state (raft.StateMachine).
func (s *State) Restore(index uint64, r io.Reader) error {
	if h := s.Halted(); h != nil {
		// Its state may hold what this binary cannot read (layout.go).
		return fmt.Errorf("%w at entry %d: %s; a snapshot is not installed", ErrHalted, h.Index, h.Reason)
	}
	// This replica no longer applied the whole log itself (layout.go).
	if err := s.clearFresh(); err != nil {
		return err
	}
	defer s.lookups.end(s.lookups.beginAll())
	s.buckets.invalidate()
	defer s.buckets.invalidate()
	defer s.s3Gen.Add(1)
	s.applied.reset()
	if err := s.st.Restore(index, r); err != nil {
		return err
	}
	// The m/halt row is a replica's own: one the sender's state carried
	// (a halted replica can lead for a moment before it hands over) is
	// not this replica's, which applied nothing it could not.
	if err := s.clearHalt(); err != nil {
		return err
	}
	return s.load()
}

// tx is one Apply call's batch plus helpers.
type tx struct {
	b   *pebble.Batch
	now int64
	s   *State
	// bucketsChanged: a bucket row was written; the cache goes.
	bucketsChanged bool
	// secretsChanged: an S3 key was created or deleted (s3Gen moves
	// after the commit).
	secretsChanged bool
	// keysChanged: the Pebble keys of key records written or deleted
	// (the lookup cache drops them around the commit).
	keysChanged []string
	// layoutChanged: the finalized layout version written (layout.go).
	layoutChanged uint32
}

// Apply applies entries in one Pebble batch and returns one result each.
func (s *State) Apply(entries []store.Entry) []any {
	if len(entries) == 0 {
		return nil
	}
	if s.Halted() != nil {
		return haltedResults(entries)
	}
	t := &tx{b: s.st.NewBatch(), s: s}
	// Apply panics only where the process cannot go on; should one be
	// recovered, the cache must not keep writes the batch lost.
	committed := false
	defer func() {
		if !committed {
			s.applied.reset()
		}
	}()
	res := make([]any, len(entries))
	for i, e := range entries {
		if e.Cmd == nil {
			continue
		}
		cmd, h := s.decodeEntry(e)
		if h != nil {
			// Never past an entry this binary cannot apply (layout.go).
			s.halt(*h)
			copy(res[i:], haltedResults(entries[i:]))
			entries = entries[:i]
			defer s.persistHalt(*h) // after what came before commits
			break
		}
		if s.layout.fresh.Load() && usesNamespace(cmd) {
			// Before the commit: a crash in between leaves it cleared.
			if err := s.clearFresh(); err != nil {
				panic(err)
			}
		}
		t.now = cmd.NowUnixMs
		// A failed command must leave no partial writes: apply it to a
		// nested view by recording the batch length and truncating... Pebble
		// batches cannot be truncated, so every op validates fully before
		// its first write.
		var ph *Halt
		res[i], ph = t.applyGuarded(cmd, e.Index, entries[0].Index)
		if ph != nil {
			// A runtime error in an op's apply (a bug the leader's
			// validation let through): every replica meets it the same
			// way, so none may crash-loop on it or skip it. The batch may
			// hold part of that op, so nothing of this call commits; the
			// replica halts before its first entry, in memory only (a
			// restart with the same binary replays to it and halts again;
			// one with the bug fixed applies it).
			t.b.Close()
			committed = true // (s.applied reset below; nothing of the batch commits)
			s.applied.reset()
			s.buckets.invalidate()
			s.halt(*ph)
			return haltedResults(entries)
		}
	}
	s.putU64(t.b, keyNextBkt, s.nextBucket)
	s.putU64(t.b, keyNextOpn, s.nextOpen)
	s.putU64(t.b, keyNextID, s.nextID)
	if t.bucketsChanged {
		s.buckets.invalidate()
		defer s.buckets.invalidate()
	}
	if t.secretsChanged {
		defer s.s3Gen.Add(1)
	}
	if len(t.keysChanged) > 0 {
		// Before the commit: no reader may keep what it reads while the
		// batch commits (lookupcache.go).
		defer s.lookups.end(s.lookups.begin(t.keysChanged))
	}
	if len(entries) == 0 {
		t.b.Close()
		committed = true
		return res
	}
	if err := s.st.Commit(t.b, entries[len(entries)-1].Index); err != nil {
		panic(err)
	}
	committed = true
	if t.layoutChanged != 0 {
		s.layout.finalized.Store(t.layoutChanged)
	}
	return res
}

// applyGuarded applies cmd (entry index, in the call that starts at
// first), turning a runtime error (a nil message, an index out of range:
// what the command's content causes, the same on every replica) into a
// halt before first. Other panics (I/O failures: the process cannot go on)
// go on up.
func (t *tx) applyGuarded(cmd *metapb.NsCommand, index, first uint64) (res any, h *Halt) {
	defer func() {
		if r := recover(); r != nil {
			re, ok := r.(runtime.Error)
			if !ok {
				panic(r)
			}
			h = &Halt{Index: first, Op: int32(opNumber(cmd)), Reason: fmt.Sprintf("entry %d (op %d) failed in apply: %v (a bug: this binary cannot apply it; report it, and run a fixed binary)", index, opNumber(cmd), re)}
			res = nil
		}
	}()
	if testApplyHook != nil {
		testApplyHook(cmd)
	}
	return t.apply(cmd), nil
}

// testApplyHook, when set (tests), runs before each command's apply.
var testApplyHook func(*metapb.NsCommand)

func (s *State) putU64(b *pebble.Batch, k []byte, v uint64) {
	if err := b.Set(k, store.U64(v), nil); err != nil {
		panic(err)
	}
}

// noteKey records a write of a key record for the lookup cache. Every
// write of the k/ table goes through put or del.
func (t *tx) noteKey(k []byte) {
	if bytes.HasPrefix(k, pfxKey) {
		t.keysChanged = append(t.keysChanged, string(k))
	}
}

func (t *tx) put(k []byte, m proto.Message) {
	t.noteKey(k)
	v, err := proto.Marshal(m)
	if err != nil {
		panic(err)
	}
	if err := t.b.Set(k, v, nil); err != nil {
		panic(err)
	}
	t.s.applied.set(k, v)
}

func (t *tx) del(k []byte) {
	t.noteKey(k)
	if err := t.b.Delete(k, nil); err != nil {
		panic(err)
	}
	t.s.applied.del(k)
}

// get reads k into m; false if absent.
func get(r pebble.Reader, k []byte, m proto.Message) (bool, error) {
	v, closer, err := r.Get(k)
	if errors.Is(err, pebble.ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer closer.Close()
	return true, proto.Unmarshal(v, m)
}

// getSized is get that also returns the value's length (the read path's
// LookupKeys counts its answer's bytes with it).
func getSized(r pebble.Reader, k []byte, m proto.Message) (bool, int, error) {
	v, closer, err := r.Get(k)
	if errors.Is(err, pebble.ErrNotFound) {
		return false, 0, nil
	}
	if err != nil {
		return false, 0, err
	}
	defer closer.Close()
	return true, len(v), proto.Unmarshal(v, m)
}

// get reads k into m through the apply cache (applycache.go), which
// holds exactly what the batch would return; false if absent.
func (t *tx) get(k []byte, m proto.Message) bool {
	v, ok := t.s.applied.get(k)
	if !ok {
		var closer io.Closer
		var err error
		v, closer, err = t.b.Get(k)
		if errors.Is(err, pebble.ErrNotFound) {
			return false
		}
		if err != nil {
			panic(err)
		}
		defer closer.Close()
		t.s.applied.fill(k, v)
	}
	if err := proto.Unmarshal(v, m); err != nil {
		panic(err)
	}
	return true
}

// hasPrefix reports whether any key starts with pfx.
func hasPrefix(r pebble.Reader, pfx []byte) (bool, []byte, error) {
	it, err := r.NewIter(&pebble.IterOptions{LowerBound: pfx, UpperBound: store.PrefixEnd(pfx)})
	if err != nil {
		return false, nil, err
	}
	defer it.Close()
	if it.First() {
		return true, slices.Clone(it.Key()), nil
	}
	return false, nil, it.Error()
}

func (t *tx) id() uint64 {
	id := t.s.nextID
	t.s.nextID++
	return id
}

func notFound(format string, args ...any) error {
	return status.Errorf(codes.NotFound, format, args...)
}

func (t *tx) bucket(volume, name string) (*metapb.Bucket, error) {
	bk := &metapb.Bucket{}
	if !t.get(bucketKey(volume, name), bk) {
		if !t.get(volumeKey(volume), &metapb.Volume{}) {
			return nil, noSuchVolume(volume)
		}
		return nil, noSuchBucket(volume, name)
	}
	return bk, nil
}

// bucketRO is bucket for callers that do not change the row: it may be
// the apply cache's decoded row, shared (applycache.go).
func (t *tx) bucketRO(volume, name string) (*metapb.Bucket, error) {
	if b := t.s.applied.bucket(volume, name); b != nil {
		return b, nil
	}
	b, err := t.bucket(volume, name)
	if err == nil {
		t.s.applied.keepBucket(volume, name, b)
	}
	return b, err
}

func keyBlockIDs(k *metapb.KeyInfo) []*metapb.BlockID {
	out := make([]*metapb.BlockID, len(k.Blocks))
	for i, b := range k.Blocks {
		out[i] = b.Id
	}
	return out
}

func (t *tx) apply(cmd *metapb.NsCommand) any {
	switch op := cmd.Op.(type) {
	case *metapb.NsCommand_CreateVolume:
		return t.createVolume(op.CreateVolume)
	case *metapb.NsCommand_SetServiceToken:
		return t.setServiceToken(op.SetServiceToken)
	case *metapb.NsCommand_DeleteVolume:
		return t.deleteVolume(op.DeleteVolume)
	case *metapb.NsCommand_CreateBucket:
		return t.createBucket(op.CreateBucket)
	case *metapb.NsCommand_DeleteBucket:
		return t.deleteBucket(op.DeleteBucket)
	case *metapb.NsCommand_OpenKey:
		return t.openKey(op.OpenKey)
	case *metapb.NsCommand_AddBlock:
		row := &metapb.OpenKeyRow{}
		if !t.get(u64Key(pfxOpen, op.AddBlock.OpenId), row) {
			return notFound("open key %d not found (expired or already committed)", op.AddBlock.OpenId)
		}
		if len(row.Blocks) >= MaxBlocksPerKey {
			return status.Errorf(codes.ResourceExhausted, "open key %d (%s/%s/%s) already has %d blocks, the most a key may have", row.OpenId, row.Volume, row.Bucket, row.Key, len(row.Blocks))
		}
		row.Blocks = append(row.Blocks, op.AddBlock.Block.Id)
		t.put(u64Key(pfxOpen, row.OpenId), row)
		return nil
	case *metapb.NsCommand_CommitKey:
		return t.commitKey(op.CommitKey)
	case *metapb.NsCommand_RenameKey:
		return t.renameKey(op.RenameKey)
	case *metapb.NsCommand_DeleteKey:
		return t.deleteKey(op.DeleteKey)
	case *metapb.NsCommand_CreateDirectory:
		return t.createDirectory(op.CreateDirectory)
	case *metapb.NsCommand_ExpireOpenKeys:
		n := 0
		for _, id := range op.ExpireOpenKeys.OpenIds {
			row := &metapb.OpenKeyRow{}
			if t.get(u64Key(pfxOpen, id), row) && row.CreatedUnixMs < expireCutoff(row, op.ExpireOpenKeys) {
				t.del(u64Key(pfxOpen, id))
				t.release(row.Blocks, fmt.Sprintf("open key %d expired", id))
				n++
			}
		}
		return n
	case *metapb.NsCommand_PurgeDeleted:
		for _, seq := range op.PurgeDeleted.Seqs {
			t.del(u64Key(pfxDeleted, seq))
		}
		return nil
	case *metapb.NsCommand_ReclaimDir:
		return t.reclaimDir(op.ReclaimDir)
	case *metapb.NsCommand_SetKeyMeta:
		return t.setKeyMeta(op.SetKeyMeta)
	case *metapb.NsCommand_CreateMultipart:
		return t.createMultipart(op.CreateMultipart)
	case *metapb.NsCommand_CompleteMultipart:
		return t.completeMultipart(op.CompleteMultipart)
	case *metapb.NsCommand_AbortMultipart:
		return t.abortMultipart(op.AbortMultipart)
	case *metapb.NsCommand_CreateS3Secret:
		return t.createS3Secret(op.CreateS3Secret)
	case *metapb.NsCommand_DeleteS3Secret:
		return t.deleteS3Secret(op.DeleteS3Secret)
	case *metapb.NsCommand_CopyKey:
		return t.copyKey(op.CopyKey)
	case *metapb.NsCommand_SetFileAttrs:
		return t.setFileAttrs(op.SetFileAttrs)
	case *metapb.NsCommand_SetAcl:
		return t.setAcl(op.SetAcl)
	case *metapb.NsCommand_SetBucketPolicy:
		return t.setBucketPolicy(op.SetBucketPolicy)
	case *metapb.NsCommand_SetPublicAccessBlock:
		return t.setPublicAccessBlock(op.SetPublicAccessBlock)
	case *metapb.NsCommand_OpenKeys:
		return t.openKeys(op.OpenKeys)
	case *metapb.NsCommand_CommitKeys:
		return t.commitKeys(op.CommitKeys)
	case *metapb.NsCommand_ReserveBlocks:
		return t.reserveBlocks(op.ReserveBlocks)
	case *metapb.NsCommand_Layout:
		return t.applyLayout(op.Layout)
	default:
		return fmt.Errorf("namespace: unknown command %T", cmd.Op)
	}
}

func (t *tx) createVolume(req *metapb.CreateVolumeRequest) any {
	if err := ValidateBucketName("volume", req.Name); err != nil {
		return err
	}
	if len(req.Owner) > MaxOwnerBytes {
		return invalid("volume %q: owner is %d bytes, at most %d", req.Name, len(req.Owner), MaxOwnerBytes)
	}
	if err := validateAttrs(req.Attrs); err != nil {
		return err
	}
	if t.get(volumeKey(req.Name), &metapb.Volume{}) {
		return status.Errorf(codes.AlreadyExists, "volume %q already exists", req.Name)
	}
	v := &metapb.Volume{Name: req.Name, Owner: req.Owner, CreatedUnixMs: t.now, Attrs: req.Attrs}
	t.put(volumeKey(req.Name), v)
	return v
}

func (t *tx) deleteVolume(req *metapb.DeleteVolumeRequest) any {
	if !t.get(volumeKey(req.Name), &metapb.Volume{}) {
		return notFound("volume %q not found", req.Name)
	}
	ok, k, err := hasPrefix(t.b, bucketKey(req.Name, ""))
	if err != nil {
		panic(err)
	}
	if ok {
		first := string(k[len(bucketKey(req.Name, "")):])
		return status.Errorf(codes.FailedPrecondition, "volume %q is not empty: it has buckets (first: %q)", req.Name, first)
	}
	t.del(volumeKey(req.Name))
	return nil
}

func (t *tx) createBucket(req *metapb.CreateBucketRequest) any {
	if err := ValidateBucketName("bucket", req.Name); err != nil {
		return err
	}
	layout := req.Layout
	if layout == metapb.BucketLayout_BUCKET_LAYOUT_UNSPECIFIED {
		layout = metapb.BucketLayout_OBJECT
	}
	if layout != metapb.BucketLayout_OBJECT && layout != metapb.BucketLayout_FS {
		return invalid("bucket %q: layout %v, want OBJECT or FS", req.Name, req.Layout)
	}
	repl := req.Replication
	if repl == metapb.Replication_REPLICATION_UNSPECIFIED {
		repl = metapb.Replication_THREE
	}
	if repl != metapb.Replication_ONE && repl != metapb.Replication_THREE {
		return invalid("bucket %q: replication %v, want ONE or THREE", req.Name, req.Replication)
	}
	if len(req.Owner) > MaxOwnerBytes {
		return invalid("bucket %q: owner is %d bytes, at most %d", req.Name, len(req.Owner), MaxOwnerBytes)
	}
	if err := validateAttrs(req.Attrs); err != nil {
		return err
	}
	if err := validateAcls(req.Acls, "create bucket "+req.Name); err != nil {
		return err
	}
	if req.GetPublicAccessBlock().GetBlockPublicAcls() && publicAcl(req.Acls) {
		return status.Errorf(codes.PermissionDenied, "create bucket %q: its Block Public Access settings block public ACLs, and its ACL has WORLD or ANONYMOUS entries", req.Name)
	}
	if !t.get(volumeKey(req.Volume), &metapb.Volume{}) {
		return notFound("volume %q not found", req.Volume)
	}
	if t.get(bucketKey(req.Volume, req.Name), &metapb.Bucket{}) {
		return status.Errorf(codes.AlreadyExists, "bucket %q already exists in volume %q", req.Name, req.Volume)
	}
	b := &metapb.Bucket{Volume: req.Volume, Name: req.Name, Id: t.s.nextBucket, Layout: layout, Replication: repl, CreatedUnixMs: t.now,
		Owner: req.Owner, Attrs: req.Attrs, Acls: req.Acls}
	if req.PublicAccessBlock != nil && !proto.Equal(req.PublicAccessBlock, &metapb.PublicAccessBlock{}) {
		b.PublicAccessBlock = req.PublicAccessBlock
	}
	t.s.nextBucket++
	t.put(bucketKey(req.Volume, req.Name), b)
	t.bucketsChanged = true
	return b
}

func (t *tx) deleteBucket(req *metapb.DeleteBucketRequest) any {
	b, err := t.bucket(req.Volume, req.Name)
	if err != nil {
		return err
	}
	pfx := objPrefix(b.Id)
	if b.Layout == metapb.BucketLayout_FS {
		pfx = cat(pfxFs, store.U64(b.Id))
	}
	ok, k, err := hasPrefix(t.b, pfx)
	if err != nil {
		panic(err)
	}
	if ok {
		first := string(k[len(pfx):])
		if b.Layout == metapb.BucketLayout_FS {
			first = first[8:]
		}
		return status.Errorf(codes.FailedPrecondition, "bucket %q in volume %q is not empty (first entry: %q)", req.Name, req.Volume, first)
	}
	// Uploads in progress hold blocks; deleting the bucket would leak them.
	if ok, _, err := hasPrefix(t.b, cat(pfxUpload, store.U64(b.Id))); err != nil {
		panic(err)
	} else if ok {
		return status.Errorf(codes.FailedPrecondition, "bucket %q in volume %q is not empty: it has multipart uploads in progress", req.Name, req.Volume)
	}
	t.del(bucketKey(req.Volume, req.Name))
	t.bucketsChanged = true
	return nil
}

func (t *tx) openKey(op *metapb.OpenKeyOp) any {
	req := op.Request
	if req == nil {
		return invalid("open key: no request")
	}
	b, err := t.bucketRO(req.Volume, req.Bucket)
	if err != nil {
		return err
	}
	if err := validateKeyFor(b, req.Key); err != nil {
		return err
	}
	repl := req.Replication
	if repl == metapb.Replication_REPLICATION_UNSPECIFIED {
		repl = b.Replication
	}
	row := &metapb.OpenKeyRow{
		OpenId: t.s.nextOpen, BucketId: b.Id, Volume: req.Volume, Bucket: req.Bucket, Key: req.Key,
		Replication: repl, ChecksumType: req.ChecksumType, BytesPerChecksum: req.BytesPerChecksum,
		CreatedUnixMs: t.now,
	}
	for _, bl := range op.Blocks {
		if bl.GetId() != nil { // (the proposer's blocks all have one)
			row.Blocks = append(row.Blocks, bl.Id)
		}
	}
	t.s.nextOpen++
	t.put(u64Key(pfxOpen, row.OpenId), row)
	return row.OpenId
}

func validateKeyFor(b *metapb.Bucket, key string) error {
	if b.Layout == metapb.BucketLayout_FS {
		_, err := SplitPath(key, false)
		return err
	}
	return ValidateKey(key)
}

func (t *tx) commitKey(req *metapb.CommitKeyRequest) any {
	row := &metapb.OpenKeyRow{}
	if !t.get(u64Key(pfxOpen, req.OpenId), row) {
		return notFound("open key %d not found (expired or already committed)", req.OpenId)
	}
	b, err := t.bucketRO(row.Volume, row.Bucket)
	if err != nil {
		return err
	}
	if b.Id != row.BucketId {
		return notFound("bucket %q in volume %q was deleted while key %q was open", row.Bucket, row.Volume, row.Key)
	}
	if err := commitName(row, b, req); err != nil {
		return err
	}
	if len(req.Blocks) > MaxBlocksPerKey {
		return invalid("commit key %q: %d blocks, at most %d", row.Key, len(req.Blocks), MaxBlocksPerKey)
	}
	if req.Part != nil {
		return t.commitPart(req, row, b)
	}
	if err := validateMeta(req.Meta); err != nil {
		return err
	}
	if len(req.Acls) > 0 { // (no message built for the common case)
		if err := validateAcls(req.Acls, "commit key "+row.Key); err != nil {
			return err
		}
		if err := blockedPublicAcl(b, req.Acls, "commit key "+row.Key); err != nil {
			return err
		}
	}
	allocated := map[[2]uint64]bool{}
	for _, id := range row.Blocks {
		allocated[[2]uint64{id.ContainerId, id.LocalId}] = true
	}
	used := map[[2]uint64]bool{}
	var size uint64
	for _, kb := range req.Blocks {
		k := [2]uint64{kb.GetId().GetContainerId(), kb.GetId().GetLocalId()}
		if !allocated[k] {
			return invalid("commit key %q: block %d/%d was not allocated to open key %d", row.Key, k[0], k[1], req.OpenId)
		}
		if used[k] {
			return invalid("commit key %q: block %d/%d listed twice", row.Key, k[0], k[1])
		}
		used[k] = true
		size += kb.Length
	}
	ki := &metapb.KeyInfo{
		Volume: row.Volume, Bucket: row.Bucket, Name: row.Key, Size: size, Replication: row.Replication,
		ChecksumType: row.ChecksumType, BytesPerChecksum: row.BytesPerChecksum,
		CreatedUnixMs: t.now, ModifiedUnixMs: t.now, Blocks: req.Blocks, Meta: req.Meta, Acls: req.Acls,
	}
	old, err := t.keySlot(b, row.Key, "commit key")
	if err != nil {
		return err
	}
	if err := checkPrecondition(req.Precondition, row.Bucket, row.Key, old); err != nil {
		return err
	}
	// Released before the write, as before block sharing, so IDs are
	// drawn in the same order (the new blocks are the open key's own).
	if old != nil {
		t.release(keyBlockIDs(old), "overwritten: "+row.Key)
	}
	t.writeKey(b, row.Key, ki)
	var unused []*metapb.BlockID
	for _, id := range row.Blocks {
		if !used[[2]uint64{id.ContainerId, id.LocalId}] {
			unused = append(unused, id)
		}
	}
	if len(unused) > 0 {
		t.release(unused, "allocated but not committed: "+row.Key)
	}
	t.del(u64Key(pfxOpen, req.OpenId))
	return ki
}

// keySlot validates that a file may be written at key in b and returns
// the key it replaces (nil if none). It writes nothing, so a caller can
// fail after it and leave no partial change.
func (t *tx) keySlot(b *metapb.Bucket, key, op string) (*metapb.KeyInfo, error) {
	if b.Layout != metapb.BucketLayout_FS {
		old := &metapb.KeyInfo{}
		if t.get(objKey(b.Id, key), old) {
			return old, nil
		}
		return nil, nil
	}
	parts, err := SplitPath(key, false)
	if err != nil {
		return nil, err
	}
	parent := uint64(0)
	for i, p := range parts[:len(parts)-1] {
		e := &metapb.FsEntry{}
		if !t.get(fsKey(b.Id, parent, p), e) {
			return nil, nil // writeKey creates the rest of the path
		}
		if !e.IsDir {
			return nil, status.Errorf(codes.FailedPrecondition, "%q is a file, not a directory", joinPath(parts[:i+1]))
		}
		parent = e.DirId
	}
	old := &metapb.FsEntry{}
	if !t.get(fsKey(b.Id, parent, parts[len(parts)-1]), old) {
		return nil, nil
	}
	if old.IsDir {
		return nil, status.Errorf(codes.FailedPrecondition, "%s %q: it is a directory", op, key)
	}
	return old.File, nil
}

// writeKey stores ki at key with a new object ID, creating missing parent
// directories of an fs bucket. keySlot must have accepted key first.
func (t *tx) writeKey(b *metapb.Bucket, key string, ki *metapb.KeyInfo) {
	if b.Layout != metapb.BucketLayout_FS {
		ki.ObjectId = t.id()
		t.put(objKey(b.Id, key), ki)
		return
	}
	parts, err := SplitPath(key, false)
	if err != nil {
		panic(fmt.Sprintf("namespace: writeKey %q after keySlot accepted it: %v", key, err))
	}
	parent, err := t.mkdirs(b, parts[:len(parts)-1], true)
	if err != nil {
		panic(fmt.Sprintf("namespace: writeKey %q after keySlot accepted it: %v", key, err))
	}
	ki.ObjectId = t.id()
	t.put(fsKey(b.Id, parent, parts[len(parts)-1]), &metapb.FsEntry{File: ki, ModifiedUnixMs: t.now})
}

// resolve walks parts from the root. It returns the id of the directory
// holding the last component and that component's entry (nil if absent).
// Every component but the last must be an existing directory.
func resolve(r pebble.Reader, b *metapb.Bucket, parts []string, path string) (uint64, *metapb.FsEntry, error) {
	parent := uint64(0)
	for i, p := range parts {
		e := &metapb.FsEntry{}
		ok, err := get(r, fsKey(b.Id, parent, p), e)
		if err != nil {
			return 0, nil, err
		}
		if i == len(parts)-1 {
			if !ok {
				return parent, nil, nil
			}
			return parent, e, nil
		}
		if !ok {
			return 0, nil, notFound("%q not found in bucket %q: directory %q does not exist", path, b.Name, joinPath(parts[:i+1]))
		}
		if !e.IsDir {
			return 0, nil, status.Errorf(codes.FailedPrecondition, "%q: %q is a file, not a directory", path, joinPath(parts[:i+1]))
		}
		parent = e.DirId
	}
	return parent, nil, nil
}

func joinPath(parts []string) string {
	var buf bytes.Buffer
	for i, p := range parts {
		if i > 0 {
			buf.WriteByte('/')
		}
		buf.WriteString(p)
	}
	return buf.String()
}

// mkdirs makes sure parts is a directory path, creating missing
// directories if create, and returns the last one's id. It validates the
// whole path before its first write so a failure leaves no partial change.
func (t *tx) mkdirs(b *metapb.Bucket, parts []string, create bool) (uint64, error) {
	parent := uint64(0)
	i := 0
	for ; i < len(parts); i++ {
		e := &metapb.FsEntry{}
		if !t.get(fsKey(b.Id, parent, parts[i]), e) {
			break
		}
		if !e.IsDir {
			return 0, status.Errorf(codes.FailedPrecondition, "%q is a file, not a directory", joinPath(parts[:i+1]))
		}
		parent = e.DirId
	}
	if i < len(parts) && !create {
		return 0, notFound("directory %q not found", joinPath(parts[:i+1]))
	}
	for ; i < len(parts); i++ {
		id := t.id()
		t.put(fsKey(b.Id, parent, parts[i]), &metapb.FsEntry{IsDir: true, DirId: id, ModifiedUnixMs: t.now})
		parent = id
	}
	return parent, nil
}

func (t *tx) renameKey(req *metapb.RenameKeyRequest) any {
	b, err := t.bucket(req.Volume, req.Bucket)
	if err != nil {
		return err
	}
	if err := validateKeyFor(b, req.NewKey); err != nil {
		return err
	}
	if req.Key == req.NewKey {
		return invalid("rename %q: source and destination are the same", req.Key)
	}
	if b.Layout == metapb.BucketLayout_OBJECT {
		ki := &metapb.KeyInfo{}
		if !t.get(objKey(b.Id, req.Key), ki) {
			return notFound("key %q not found in bucket %q", req.Key, req.Bucket)
		}
		old := &metapb.KeyInfo{}
		if t.get(objKey(b.Id, req.NewKey), old) {
			if !req.Overwrite {
				return status.Errorf(codes.AlreadyExists, "rename %q: destination key %q exists in bucket %q", req.Key, req.NewKey, req.Bucket)
			}
			t.release(keyBlockIDs(old), "overwritten by rename: "+req.NewKey)
		}
		ki.Name = req.NewKey
		ki.ModifiedUnixMs = t.now
		t.del(objKey(b.Id, req.Key))
		t.put(objKey(b.Id, req.NewKey), ki)
		return nil
	}
	src, err := SplitPath(req.Key, false)
	if err != nil {
		return err
	}
	dst, _ := SplitPath(req.NewKey, false)
	if len(dst) > len(src) && slices.Equal(dst[:len(src)], src) {
		return invalid("rename %q to %q: a directory cannot move into itself", req.Key, req.NewKey)
	}
	sp, se, err := resolve(t.b, b, src, req.Key)
	if err != nil {
		return err
	}
	if se == nil {
		return notFound("%q not found in bucket %q", req.Key, req.Bucket)
	}
	dp, de, err := resolve(t.b, b, dst, req.NewKey)
	if err != nil {
		return err
	}
	if de != nil {
		if !req.Overwrite {
			return status.Errorf(codes.AlreadyExists, "rename %q: destination %q exists in bucket %q", req.Key, req.NewKey, req.Bucket)
		}
		if err := t.replaceForRename(b, req, se, de); err != nil {
			return err
		}
	}
	// A directory moves as one row: its children are keyed by its id.
	se.ModifiedUnixMs = t.now
	if se.File != nil {
		se.File.Name = req.NewKey
	}
	t.del(fsKey(b.Id, sp, src[len(src)-1]))
	t.put(fsKey(b.Id, dp, dst[len(dst)-1]), se)
	return nil
}

func (t *tx) deleteKey(req *metapb.DeleteKeyRequest) any {
	b, err := t.bucket(req.Volume, req.Bucket)
	if err != nil {
		return err
	}
	if b.Layout == metapb.BucketLayout_OBJECT {
		ki := &metapb.KeyInfo{}
		if !t.get(objKey(b.Id, req.Key), ki) {
			return notFound("key %q not found in bucket %q", req.Key, req.Bucket)
		}
		t.del(objKey(b.Id, req.Key))
		t.release(keyBlockIDs(ki), "deleted: "+req.Key)
		return nil
	}
	parts, err := SplitPath(req.Key, false)
	if err != nil {
		return err
	}
	parent, e, err := resolve(t.b, b, parts, req.Key)
	if err != nil {
		return err
	}
	if e == nil {
		return notFound("%q not found in bucket %q", req.Key, req.Bucket)
	}
	if !e.IsDir {
		t.del(fsKey(b.Id, parent, parts[len(parts)-1]))
		t.release(keyBlockIDs(e.File), "deleted: "+req.Key)
		return nil
	}
	nonEmpty, _, err := hasPrefix(t.b, fsPrefix(b.Id, e.DirId))
	if err != nil {
		panic(err)
	}
	if nonEmpty && !req.Recursive {
		return status.Errorf(codes.FailedPrecondition, "directory %q in bucket %q is not empty; delete it recursively", req.Key, req.Bucket)
	}
	t.del(fsKey(b.Id, parent, parts[len(parts)-1]))
	if nonEmpty {
		// The children become unreachable now (atomically, whatever their
		// number); the background service reclaims them in bounded steps.
		seq := t.id()
		t.put(u64Key(pfxPending, seq), &metapb.PendingDirRow{Seq: seq, BucketId: b.Id, DirId: e.DirId})
	}
	return nil
}

// reclaimDir moves up to max children of a deleted directory to the
// deleted tables (files) or the pending table (directories). It returns
// how many children it reclaimed; the directory's row goes when it has none.
func (t *tx) reclaimDir(op *metapb.ReclaimDirOp) any {
	row := &metapb.PendingDirRow{}
	if !t.get(u64Key(pfxPending, op.Seq), row) {
		return 0
	}
	limit := int(min(max(op.MaxChildren, 1), 10000))
	pfx := fsPrefix(row.BucketId, row.DirId)
	it, err := t.b.NewIter(&pebble.IterOptions{LowerBound: pfx, UpperBound: store.PrefixEnd(pfx)})
	if err != nil {
		panic(err)
	}
	var blocks []*metapb.BlockID
	var keys [][]byte
	var dirs []uint64
	for it.First(); it.Valid() && len(keys) < limit; it.Next() {
		e := &metapb.FsEntry{}
		if err := proto.Unmarshal(it.Value(), e); err != nil {
			panic(err)
		}
		keys = append(keys, slices.Clone(it.Key()))
		if e.IsDir {
			dirs = append(dirs, e.DirId)
		} else {
			blocks = append(blocks, keyBlockIDs(e.File)...)
		}
	}
	if err := it.Close(); err != nil {
		panic(err)
	}
	for _, k := range keys {
		t.del(k)
	}
	for _, d := range dirs {
		seq := t.id()
		t.put(u64Key(pfxPending, seq), &metapb.PendingDirRow{Seq: seq, BucketId: row.BucketId, DirId: d})
	}
	t.release(blocks, "deleted directory")
	if len(keys) < limit {
		t.del(u64Key(pfxPending, op.Seq))
	}
	return len(keys)
}

// BulkLoadObjectKeys writes committed object keys straight into Pebble,
// bypassing Raft, with exactly the rows CommitKey writes. Only for
// benchmark setup on a stopped single-node service (a million keys through
// Raft would take minutes on a small machine); never on a live replica.
func (s *State) BulkLoadObjectKeys(bucketID uint64, keys []*metapb.KeyInfo) error {
	defer s.lookups.end(s.lookups.beginAll())
	s.applied.reset()
	b := s.st.NewBatch()
	for _, k := range keys {
		v, err := proto.Marshal(k)
		if err != nil {
			return err
		}
		if err := b.Set(objKey(bucketID, k.Name), v, nil); err != nil {
			return err
		}
	}
	// Not Store.Commit: the rows take no log index (the applied index
	// must not move, nor may a batch commit at the one already applied).
	return b.Commit(pebble.Sync)
}

// setServiceToken records the cluster service token unless one is
// recorded: every meta node then serves the same token.
func (t *tx) setServiceToken(op *metapb.SetServiceTokenOp) any {
	v, closer, err := t.b.Get(keyToken)
	if err == nil {
		tok := string(v)
		closer.Close()
		return tok
	}
	if !errors.Is(err, pebble.ErrNotFound) {
		panic(err)
	}
	if len(op.Token) < 16 {
		return status.Errorf(codes.InvalidArgument, "service token of %d characters, want at least 16", len(op.Token))
	}
	if err := t.b.Set(keyToken, []byte(op.Token), nil); err != nil {
		panic(err)
	}
	return op.Token
}

// ServiceToken returns the replicated cluster service token, "" if none
// has been recorded yet.
func (s *State) ServiceToken() (string, error) {
	var tok string
	err := s.view(func(r pebble.Reader) error {
		v, closer, err := r.Get(keyToken)
		if errors.Is(err, pebble.ErrNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		tok = string(v)
		return closer.Close()
	})
	return tok, err
}
