package sim

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/cockroachdb/pebble/v2"

	"github.com/basalt-store/basalt/internal/meta/store"
	"github.com/basalt-store/basalt/internal/raft"
)

// kvSM is the metadata group's state machine in the simulator: a
// key-value map kept in the REAL metadata store (internal/meta/store: one
// Pebble batch per Apply recording the applied index with the state,
// checkpoint snapshots), on the node's MemFS. Gets go through the log too,
// so a get's answer is linearizable by construction and checks both the
// log and the store.
type kvSM struct {
	st *store.Store
}

var kvPrefix = []byte("kv/")

const (
	kvPut byte = 'P'
	kvGet byte = 'G'
)

// kvCmd is one client operation as proposed.
type kvCmd struct {
	op         byte
	key, value string
}

func (c kvCmd) encode() []byte {
	b := []byte{c.op}
	b = binary.AppendUvarint(b, uint64(len(c.key)))
	b = append(b, c.key...)
	return append(b, c.value...)
}

func decodeKV(b []byte) (kvCmd, error) {
	if len(b) < 2 || (b[0] != kvPut && b[0] != kvGet) {
		return kvCmd{}, fmt.Errorf("sim: bad kv command %q", b)
	}
	n, k := binary.Uvarint(b[1:])
	if k <= 0 || uint64(len(b)-1-k) < n {
		return kvCmd{}, fmt.Errorf("sim: bad kv command %q", b)
	}
	rest := b[1+k:]
	return kvCmd{op: b[0], key: string(rest[:n]), value: string(rest[n:])}, nil
}

// kvResult is what an applied command returns to its proposer.
type kvResult struct {
	value string
	found bool
}

func (s *kvSM) Apply(ents []raft.Entry) []any {
	out := make([]any, len(ents))
	if len(ents) == 0 {
		return out
	}
	b := s.st.NewBatch()
	for i, e := range ents {
		if e.Kind != raft.EntryNormal || len(e.Meta) == 0 {
			continue
		}
		c, err := decodeKV(e.Meta)
		if err != nil {
			out[i] = err
			continue
		}
		k := append(append([]byte(nil), kvPrefix...), c.key...)
		switch c.op {
		case kvPut:
			if err := b.Set(k, []byte(c.value), nil); err != nil {
				out[i] = err
				continue
			}
			out[i] = kvResult{value: c.value, found: true}
		case kvGet:
			v, closer, err := b.Get(k)
			switch {
			case errors.Is(err, pebble.ErrNotFound):
				out[i] = kvResult{}
			case err != nil:
				out[i] = err
			default:
				out[i] = kvResult{value: string(v), found: true}
				closer.Close()
			}
		}
	}
	if err := s.st.Commit(b, ents[len(ents)-1].Index); err != nil {
		// The state did not change: every result is this error.
		for i := range out {
			out[i] = err
		}
	}
	return out
}

func (s *kvSM) AppliedIndex() uint64 { return s.st.DurableIndex() }

func (s *kvSM) Snapshot() (uint64, io.ReadCloser, error) { return s.st.Snapshot() }

func (s *kvSM) Restore(index uint64, r io.Reader) error { return s.st.Restore(index, r) }

// dump returns every key and value of the store, for replica agreement.
func (s *kvSM) dump() (map[string]string, error) {
	m := map[string]string{}
	err := s.st.View(func(r pebble.Reader) error {
		it, err := r.NewIter(&pebble.IterOptions{LowerBound: kvPrefix, UpperBound: store.PrefixEnd(kvPrefix)})
		if err != nil {
			return err
		}
		for it.First(); it.Valid(); it.Next() {
			m[string(it.Key()[len(kvPrefix):])] = string(it.Value())
		}
		return it.Close()
	})
	return m, err
}
