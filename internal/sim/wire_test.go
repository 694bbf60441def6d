package sim

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/store"
	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/vfs"
)

// TestNodeCrash drives one node's state machines directly (as the raft
// host would: WriteData before the entry is acknowledged, then Apply),
// crashes its disk at a random point, reopens and checks that everything
// applied is still there and the applied index did not go back. No raft:
// this isolates storage, the container state machine and the metadata
// store under crashes.
func TestNodeCrash(t *testing.T) {
	discard := slog.New(slog.NewTextHandler(io.Discard, nil))
	for seed := uint64(1); seed <= 40; seed++ {
		r := rand.New(rand.NewPCG(seed, 1))
		direct := seed%2 == 0
		fs := vfs.NewMem(vfs.MemOptions{DirectIO: direct})
		mode := storage.DirectOff
		if direct {
			mode = storage.DirectAuto
		}
		open := func() (*storage.Store, raft.DataStateMachine, *store.Store) {
			st, err := storage.Open(storage.Options{Volumes: []string{"/vol"}, FS: fs, DirectIO: mode,
				ContainerSize: 64 << 20, KeepUncommitted: true, OutOfOrderWrites: true})
			if err != nil {
				t.Fatalf("seed %d: storage: %v\n%s", seed, err, fs)
			}
			sm, err := datanode.NewContainerStateMachine(100, st, fs, "/dn", discard)
			if err != nil {
				t.Fatalf("seed %d: sm: %v", seed, err)
			}
			kv, err := store.Open("/meta", store.Options{SyncInterval: -1, CacheBytes: 1 << 20, FS: fs, Logger: discard})
			if err != nil {
				t.Fatalf("seed %d: meta store: %v\n%s", seed, err, fs)
			}
			return st, sm, kv
		}
		st, sm, kv := open()
		type blk struct {
			cid, lid uint64
			data     []byte
		}
		var committed []blk
		puts := map[string]string{}
		index := uint64(1)
		var dnApplied, kvApplied uint64
		crashAt := 1 + r.IntN(30)
		for i := 0; i < 30; i++ {
			if i == crashAt {
				dnApplied, kvApplied = sm.AppliedIndex(), kv.DurableIndex()
				fs = fs.CrashClone(r)
				st.Close()
				kv.Close()
				st, sm, kv = open()
				if a := sm.AppliedIndex(); a < dnApplied {
					t.Errorf("seed %d: container state machine applied index went back %d -> %d", seed, dnApplied, a)
				}
				if a := kv.DurableIndex(); a < kvApplied {
					t.Errorf("seed %d: metadata store applied index went back %d -> %d", seed, kvApplied, a)
				}
				// Every block applied before the crash is there at once,
				// with no entry applied again: Apply made its commit
				// durable before it returned, whatever the persisted index.
				for _, b := range committed {
					if bd, err := st.GetBlock(storage.ContainerID(b.cid), storage.LocalID(b.lid)); err != nil || bd.Length != int64(len(b.data)) {
						t.Errorf("seed %d: block %d/%d applied before the crash (persisted applied index %d) lost in it: %v", seed, b.cid, b.lid, sm.AppliedIndex(), err)
					}
				}
				index = max(sm.AppliedIndex(), index) + 1
			}
			// One block: its chunks, then its PutBlock.
			b := blk{cid: uint64(1 + r.IntN(2)), lid: uint64(i + 1)}
			id := &datanodepb.BlockID{ContainerId: b.cid, LocalId: b.lid}
			var chunks []*datanodepb.ChunkInfo
			for c := 0; c < 1+r.IntN(3); c++ {
				size := 1 + r.IntN(9000)
				if r.IntN(2) == 0 {
					size = 4096 * (1 + r.IntN(2))
				}
				d := make([]byte, size)
				for j := range d {
					d[j] = byte(r.Uint32())
				}
				sum := storage.DefaultChecksum.Compute(d)
				ci := &datanodepb.ChunkInfo{Offset: uint64(len(b.data)), Length: uint64(size),
					Checksum: &datanodepb.ChecksumData{Type: datanodepb.ChecksumType(sum.Type), BytesPerChecksum: sum.BytesPerChecksum, Sums: sum.Sums}}
				meta, _ := proto.Marshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_WriteChunk{WriteChunk: &datanodepb.WriteChunkCmd{Block: id, Chunk: ci}}})
				if err := sm.WriteData(index, 1, meta, d); err != nil {
					t.Fatalf("seed %d: WriteData: %v", seed, err)
				}
				if err := sm.(raft.DataSyncer).SyncData(); err != nil {
					t.Fatalf("seed %d: SyncData: %v", seed, err)
				}
				if res := sm.Apply([]raft.Entry{{Index: index, Term: 1, Meta: meta, HasData: true}}); res[0] != nil {
					t.Fatalf("seed %d: apply WriteChunk: %v", seed, res[0])
				}
				index++
				chunks = append(chunks, ci)
				b.data = append(b.data, d...)
			}
			meta, _ := proto.Marshal(&datanodepb.ContainerCommand{Cmd: &datanodepb.ContainerCommand_PutBlock{PutBlock: &datanodepb.PutBlockCmd{
				Block: &datanodepb.BlockData{Id: id, Length: uint64(len(b.data)), Chunks: chunks}}}})
			if res := sm.Apply([]raft.Entry{{Index: index, Term: 1, Meta: meta}}); res[0] != nil {
				t.Fatalf("seed %d: apply PutBlock: %v", seed, res[0])
			}
			index++
			committed = append(committed, b)
			// One metadata put.
			k, v := fmt.Sprintf("k%d", r.IntN(5)), fmt.Sprintf("v%d", i)
			kvs := &kvSM{st: kv}
			if res := kvs.Apply([]raft.Entry{{Index: uint64(i + 1 + 100*boolInt(i >= crashAt)), Term: 1, Meta: kvCmd{op: kvPut, key: k, value: v}.encode()}}); res[0] != (kvResult{value: v, found: true}) {
				t.Fatalf("seed %d: kv apply: %v", seed, res[0])
			}
			puts[k] = v
		}
		for _, b := range committed {
			bd, err := st.GetBlock(storage.ContainerID(b.cid), storage.LocalID(b.lid))
			if err != nil {
				t.Errorf("seed %d: committed block %d/%d lost: %v", seed, b.cid, b.lid, err)
				continue
			}
			got := make([]byte, bd.Length)
			if _, err := st.ReadAt(storage.ContainerID(b.cid), storage.LocalID(b.lid), got, 0); err != nil || !bytes.Equal(got, b.data) {
				t.Errorf("seed %d: committed block %d/%d reads back wrong (len %d want %d, err %v)", seed, b.cid, b.lid, len(got), len(b.data), err)
			}
		}
		got, err := (&kvSM{st: kv}).dump()
		if err != nil || fmt.Sprint(got) != fmt.Sprint(puts) {
			t.Errorf("seed %d: metadata after crash %v, want %v (%v)", seed, got, puts, err)
		}
		st.Close()
		kv.Close()
	}
}
