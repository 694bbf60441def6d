package sim

import (
	"bytes"
	"fmt"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/basalt-store/basalt/internal/raft"
	"github.com/basalt-store/basalt/internal/storage"
)

// finalReads reads every key once more through the log after the faults
// stopped: an acknowledged put that was lost shows up here as a
// linearizability violation.
func (s *Sim) finalReads() {
	c := &kvClient{id: len(s.clients)}
	for _, k := range kvKeys {
		for try := 0; try < 20; try++ {
			op := s.proposeKV(c, kvCmd{op: kvGet, key: k})
			s.loop(func() bool { return !op.pending })
			if !op.failed && !op.unknown {
				break
			}
			end := s.clk.now + 200*time.Millisecond
			s.loop(func() bool { return s.clk.now >= end })
		}
	}
}

// check runs the end-of-run checkers on the healed cluster.
func (s *Sim) check() {
	for _, n := range s.nodes {
		if !n.up {
			s.violate("node %d is still down after healing", n.id)
			return
		}
	}
	// Every group runs everywhere: a group that stopped itself (a fatal
	// error, a panic of etcd raft stepping a message) is a replica lost.
	for _, n := range s.nodes {
		for _, g := range []*raft.Group{n.dnG, n.kvG} {
			if g != nil && g.Stopped() {
				err := g.ProposeAsync(nil, nil, func(raft.Result, error) {})
				s.violate("group %d stopped on node %d after healing: %v", g.ID(), n.id, err)
			}
		}
	}
	// No acknowledged block lost or changed: every replica holds it, or
	// reports its container UNHEALTHY (under-replication is reported, not
	// silent).
	for _, op := range s.blocks {
		if !op.acked {
			continue
		}
		for _, id := range s.pipeline {
			n := s.node(id)
			why := s.replicaHas(n, op)
			if why == "" {
				continue
			}
			if rep, err := n.store.Container(storage.ContainerID(op.cid)); err == nil && rep.State == storage.StateUnhealthy {
				s.rep.UnhealthyReplicas++
				s.logf("acked block %d/%d missing on %d, whose container is UNHEALTHY (reported): %s", op.cid, op.lid, id, why)
				continue
			}
			s.violate("acknowledged block %d/%d (PutBlock %d) lost on replica %d: %s", op.cid, op.lid, op.index, id, why)
		}
	}
	s.checkReplicasAgree()
	s.checkMetaReplicas()
	res, why := checkLinearizable(s.kvops, 10*time.Second)
	switch res {
	case porcupine.Illegal:
		s.violate("metadata history not linearizable: %s", why)
	case porcupine.Unknown:
		s.logf("linearizability check timed out")
	}
}

// checkReplicasAgree: a block committed on several replicas is the same
// block on each, byte for byte.
func (s *Sim) checkReplicasAgree() {
	type copyOf struct {
		node uint64
		bd   storage.BlockData
		data []byte
	}
	for cid := uint64(1); cid < s.nextCid; cid++ {
		seen := map[uint64][]copyOf{}
		for _, id := range s.pipeline {
			n := s.node(id)
			bds, err := n.store.ListBlocks(storage.ContainerID(cid), 0, 1<<20)
			if err != nil {
				continue // never written here
			}
			for _, bd := range bds {
				data := make([]byte, bd.Length)
				if _, err := n.store.ReadAt(storage.ContainerID(cid), bd.LocalID, data, 0); err != nil {
					s.violate("replica %d: committed block %d/%d unreadable: %v", id, cid, bd.LocalID, err)
					continue
				}
				seen[uint64(bd.LocalID)] = append(seen[uint64(bd.LocalID)], copyOf{id, bd, data})
			}
		}
		for lid, copies := range seen {
			for _, c := range copies[1:] {
				a := copies[0]
				if a.bd.Length != c.bd.Length || a.bd.BCSID != c.bd.BCSID || !bytes.Equal(a.data, c.data) {
					s.violate("block %d/%d differs between replicas %d (length %d, BCSID %d) and %d (length %d, BCSID %d); first differing byte %d",
						cid, lid, a.node, a.bd.Length, a.bd.BCSID, c.node, c.bd.Length, c.bd.BCSID, firstDiff(a.data, c.data))
				}
			}
		}
	}
}

// checkMetaReplicas: replicas that applied the same index hold the same
// keys and values.
func (s *Sim) checkMetaReplicas() {
	var ref map[string]string
	var refNode, refIdx uint64
	for _, id := range s.metaPeers {
		n := s.node(id)
		idx := n.kvst.AppliedIndex()
		m, err := n.kv.sm.(*kvSM).dump()
		if err != nil {
			s.violate("replica %d: metadata store unreadable: %v", id, err)
			continue
		}
		if ref == nil {
			ref, refNode, refIdx = m, id, idx
			continue
		}
		if idx != refIdx {
			s.logf("metadata replicas %d and %d at different indexes (%d, %d) after healing", refNode, id, refIdx, idx)
			continue
		}
		if fmt.Sprint(m) != fmt.Sprint(ref) {
			s.violate("metadata replicas %d and %d both at index %d differ: %v vs %v", refNode, id, idx, ref, m)
		}
	}
}
