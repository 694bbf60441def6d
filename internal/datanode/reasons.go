package datanode

import "maps"

// maxLeftReasons bounds leftReasons: past it, the oldest reason goes
// (its container's report then says UnknownUnhealthyReason).
const maxLeftReasons = 4096

// leftReasons keeps why a pipeline's state machine marked containers
// UNHEALTHY after the pipeline is left (SCM closes the pipeline of a
// replica it records unhealthy, and leaving drops the state machine and
// its sick file), so the container reports keep the real cause. In memory
// only: after a restart the reports say UnknownUnhealthyReason and SCM's
// Raft record keeps the cause. An entry goes when a full report finds its
// container no longer UNHEALTHY here (deleted, replaced, healthy again),
// or when the container is deleted. Guarded by Datanode.mu.
type leftReasons struct {
	seq uint64
	m   map[uint64]leftReason
}

type leftReason struct {
	why string
	seq uint64 // when it was handed over
}

// add hands over a dropped state machine's reasons (an older reason for
// the same container is replaced).
func (l *leftReasons) add(sick map[uint64]string) {
	if len(sick) == 0 {
		return
	}
	if l.m == nil {
		l.m = map[uint64]leftReason{}
	}
	l.seq++
	for cid, why := range sick {
		if _, ok := l.m[cid]; !ok && len(l.m) >= maxLeftReasons {
			l.evictOldest()
		}
		l.m[cid] = leftReason{why, l.seq}
	}
}

func (l *leftReasons) evictOldest() {
	var old uint64
	first := true
	for cid, r := range l.m {
		if first || r.seq < l.m[old].seq {
			old, first = cid, false
		}
	}
	delete(l.m, old)
}

// snapshot copies the reasons by container.
func (l *leftReasons) snapshot() map[uint64]string {
	out := make(map[uint64]string, len(l.m))
	for cid, r := range l.m {
		out[cid] = r.why
	}
	return out
}

// drop forgets cid's reason (its replica was deleted).
func (l *leftReasons) drop(cid uint64) { delete(l.m, cid) }

// prune drops every reason handed over by mark (l.seq read before a
// report listed storage) whose container that list did not show
// UNHEALTHY; one handed over later waits for the next report.
func (l *leftReasons) prune(mark uint64, unhealthy map[uint64]bool) {
	for cid, r := range l.m {
		if r.seq <= mark && !unhealthy[cid] {
			delete(l.m, cid)
		}
	}
}

// sickReasons copies why the state machine marked its containers
// UNHEALTHY (its sick map).
func (sm *containerSM) sickReasons() map[uint64]string {
	sm.mu.Lock()
	defer sm.mu.Unlock()
	return maps.Clone(sm.sick)
}
