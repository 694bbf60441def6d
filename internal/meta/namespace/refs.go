package namespace

import (
	"errors"
	"fmt"

	"github.com/cockroachdb/pebble/v2"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// Block references.
//
// A block is written for one key or part; CopyKey makes more keys and
// parts hold it. A holder is one entry of a key's or a part's block list,
// so a key listing a block twice holds it twice. Rows exist only for
// blocks with more than one holder:
//
//	r/<container id><local id>   number of holders (≥ 2), uint64 big-endian
//
// so a block held once, the common case, costs no row, and releasing it
// costs one point lookup that misses. Open keys' allocated blocks are held
// by the open-key row alone until commit, when the used ones pass to the
// key; completing a multipart upload passes the listed parts' holds to the
// object. Every path that drops blocks (delete, overwrite, directory
// reclaim, open-key expiry, part replace, upload abort and complete) goes
// through release, which hands a block to SCM only when its last holder
// goes.
var pfxRef = []byte("r/")

func refKey(id *metapb.BlockID) []byte {
	return cat(pfxRef, store.U64(id.GetContainerId()), store.U64(id.GetLocalId()))
}

// holders returns the stored count of id's holders: 0 when there is no row
// (one holder, or none).
func (t *tx) holders(id *metapb.BlockID) uint64 {
	n, err := readHolders(t.b, id)
	if err != nil {
		panic(err)
	}
	return n
}

// hold adds one holder to each block, which must be held already (the
// caller read it from a key or part in the same batch).
func (t *tx) hold(blocks []*metapb.BlockID) {
	for _, id := range blocks {
		n := max(t.holders(id), 1)
		if err := t.b.Set(refKey(id), store.U64(n+1), nil); err != nil {
			panic(err)
		}
	}
}

// release drops one holder of each block; blocks left with none go to the
// deleted queue (one DeletedRow) for SCM.
func (t *tx) release(blocks []*metapb.BlockID, reason string) {
	var free []*metapb.BlockID
	for _, id := range blocks {
		switch n := t.holders(id); {
		case n == 0:
			free = append(free, id)
		case n == 2:
			t.del(refKey(id))
		case n > 2:
			if err := t.b.Set(refKey(id), store.U64(n-1), nil); err != nil {
				panic(err)
			}
		default:
			panic(fmt.Sprintf("namespace: block %d/%d has a reference row of %d holders; rows exist only for 2 or more", id.GetContainerId(), id.GetLocalId(), n))
		}
	}
	if len(free) == 0 {
		return
	}
	seq := t.id()
	t.put(u64Key(pfxDeleted, seq), &metapb.DeletedRow{Seq: seq, Blocks: free, Reason: reason})
}

// BlockHolders returns how many keys and parts hold a shared block: 0 when
// the block has no reference row (it is held once, or not at all).
func (s *State) BlockHolders(id *metapb.BlockID) (uint64, error) {
	var n uint64
	err := s.view(func(r pebble.Reader) (err error) {
		n, err = readHolders(r, id)
		return err
	})
	return n, err
}

func readHolders(r pebble.Reader, id *metapb.BlockID) (uint64, error) {
	v, closer, err := r.Get(refKey(id))
	if errors.Is(err, pebble.ErrNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	defer closer.Close()
	return decodeU64(v), nil
}
