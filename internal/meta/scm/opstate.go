package scm

import (
	"cmp"
	"errors"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/cockroachdb/pebble/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// Replicated state beside datanodes, pipelines and containers:
//
//	o/<datanode id>                        NodeOpRow: operational state
//	r/<container id><local id><datanode>   CorruptReplica: a report
//	                                       against a replica (local id 0:
//	                                       why SCM recorded it unhealthy)
//
// Both are mirrored in memory. Reports are bounded (MaxReplicaReports in
// all, maxReasonBytes each) and go when their replica is dropped from
// its container.
var (
	pfxOpState = []byte("o/")
	pfxReport  = []byte("r/")
)

// Bounds of the replica reports.
const (
	// MaxReplicaReports bounds the stored reports; Apply records no new
	// one beyond it (repeats of a stored one still count).
	MaxReplicaReports = 10000
	// MaxReportsPerOp bounds one ReplicaReportsOp.
	MaxReportsPerOp = 1024
)

type repKey struct{ cid, lid, dn uint64 }

func reportKey(k repKey) []byte {
	b := append([]byte(nil), pfxReport...)
	b = append(b, store.U64(k.cid)...)
	b = append(b, store.U64(k.lid)...)
	return append(b, store.U64(k.dn)...)
}

// truncReason bounds a reason to maxReasonBytes of valid UTF-8 (a string
// cut inside a rune would not marshal).
func truncReason(s string) string {
	if len(s) > maxReasonBytes {
		s = s[:maxReasonBytes]
		for len(s) > 0 && !utf8.ValidString(s) {
			s = s[:len(s)-1]
		}
	}
	return strings.ToValidUTF8(s, "?")
}

// cleanReason is a reason from outside (a datanode's report, a client's
// corrupt-replica report) as SCM keeps and proposes it: valid UTF-8,
// control characters (newlines, tabs, ESC: a reason is one line on an
// operator's terminal) replaced by spaces, at most n bytes, cut at a
// rune boundary with "…", and a copy (not a substring keeping the whole
// decoded request alive). The leader cleans before proposing; apply keeps
// truncReason, so a log entry applies the same on every version.
func cleanReason(s string, n int) string {
	s = strings.ToValidUTF8(s, "?")
	s = strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, s)
	if len(s) > n {
		const ell = "…"
		s = s[:max(0, n-len(ell))]
		for len(s) > 0 && !utf8.ValidString(s) {
			s = s[:len(s)-1]
		}
		s += ell
	}
	return strings.Clone(s)
}

// loadExtra loads the operational states and reports (caller holds mu).
func (s *State) loadExtra(r pebble.Reader) error {
	s.opStates = map[uint64]*metapb.NodeOpRow{}
	s.reports = map[repKey]*metapb.CorruptReplica{}
	_, closer, err := r.Get(keySafeExit)
	switch {
	case err == nil:
		s.safeExit = true
		closer.Close()
	case errors.Is(err, pebble.ErrNotFound):
		s.safeExit = false
	default:
		return err
	}
	if err := store.Scan(r, pfxOpState, func(_, v []byte) error {
		o := &metapb.NodeOpRow{}
		if err := proto.Unmarshal(v, o); err != nil {
			return err
		}
		s.opStates[o.DatanodeId] = o
		return nil
	}); err != nil {
		return err
	}
	return store.Scan(r, pfxReport, func(_, v []byte) error {
		c := &metapb.CorruptReplica{}
		if err := proto.Unmarshal(v, c); err != nil {
			return err
		}
		s.reports[repKey{c.GetBlock().GetContainerId(), c.GetBlock().GetLocalId(), c.DatanodeId}] = c
		return nil
	})
}

func validOpState(st metapb.NodeOpState) bool {
	return st >= metapb.NodeOpState_IN_SERVICE && st <= metapb.NodeOpState_IN_MAINTENANCE
}

func (s *State) applySetNodeOpState(b *pebble.Batch, op *metapb.SetNodeOpStateOp, now int64) any {
	if s.datanodes[op.DatanodeId] == nil {
		return status.Errorf(codes.NotFound, "datanode %d not registered", op.DatanodeId)
	}
	if !validOpState(op.State) {
		return status.Errorf(codes.InvalidArgument, "datanode %d: operational state %v", op.DatanodeId, op.State)
	}
	cur := s.opStateLocked(op.DatanodeId)
	if len(op.Expect) > 0 && !slices.Contains(op.Expect, cur.State) {
		return proto.Clone(cur) // changed meanwhile: leave it
	}
	row := &metapb.NodeOpRow{DatanodeId: op.DatanodeId, State: op.State, MaintenanceEndUnixMs: op.MaintenanceEndUnixMs, SinceUnixMs: cur.SinceUnixMs}
	if op.State != metapb.NodeOpState_ENTERING_MAINTENANCE && op.State != metapb.NodeOpState_IN_MAINTENANCE {
		row.MaintenanceEndUnixMs = 0
	}
	if op.State != cur.State {
		row.SinceUnixMs = now
	}
	s.opStates[row.DatanodeId] = row
	s.put(b, key(pfxOpState, row.DatanodeId), row)
	return proto.Clone(row)
}

// opStateLocked returns a datanode's operational state (IN_SERVICE if none
// was ever set). Callers hold mu.
func (s *State) opStateLocked(dn uint64) *metapb.NodeOpRow {
	if o := s.opStates[dn]; o != nil {
		return o
	}
	return &metapb.NodeOpRow{DatanodeId: dn, State: metapb.NodeOpState_IN_SERVICE}
}

// applyReplicaReports records reports against replicas. A report naming
// an unknown container, or a datanode that is not its replica, is
// skipped. It returns how many were recorded (new or repeated).
func (s *State) applyReplicaReports(b *pebble.Batch, reps []*metapb.CorruptReplica, now int64) any {
	if len(reps) > MaxReportsPerOp {
		return status.Errorf(codes.InvalidArgument, "replica reports: %d in one command, at most %d", len(reps), MaxReportsPerOp)
	}
	n := 0
	for _, r := range reps {
		if s.recordReport(b, r.GetBlock().GetContainerId(), r.GetBlock().GetLocalId(), r.GetDatanodeId(), r.GetReason(), r.GetReporter(), now) {
			n++
		}
	}
	return n
}

// recordReport stores one report (caller holds mu). False: not recorded
// (unknown replica, or the store is full).
func (s *State) recordReport(b *pebble.Batch, cid, lid, dn uint64, reason, reporter string, now int64) bool {
	c := s.containers[cid]
	if c == nil || !slices.Contains(c.Replicas, dn) {
		return false
	}
	k := repKey{cid, lid, dn}
	old := s.reports[k]
	if old == nil && len(s.reports) >= MaxReplicaReports {
		return false
	}
	r := &metapb.CorruptReplica{Block: &metapb.BlockID{ContainerId: cid, LocalId: lid}, DatanodeId: dn,
		Reason: truncReason(reason), Reporter: truncReason(reporter), ReportedUnixMs: now, Reports: 1}
	if old != nil {
		r.Reports = old.Reports + 1
	}
	s.reports[k] = r
	s.put(b, reportKey(k), r)
	return true
}

// dropReports deletes the reports against datanode dn's replica of
// container cid (caller holds mu).
func (s *State) dropReports(b *pebble.Batch, cid, dn uint64) {
	for k := range s.reports {
		if k.cid == cid && k.dn == dn {
			delete(s.reports, k)
			if err := b.Delete(reportKey(k), nil); err != nil {
				panic(err)
			}
		}
	}
}

// OpState returns a datanode's operational state.
func (s *State) OpState(dn uint64) *metapb.NodeOpRow {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.opStateLocked(dn)
}

// OpStates returns the datanodes whose operational state is not
// IN_SERVICE, by ID.
func (s *State) OpStates() map[uint64]*metapb.NodeOpRow {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := map[uint64]*metapb.NodeOpRow{}
	for id, o := range s.opStates {
		if o.State != metapb.NodeOpState_IN_SERVICE {
			out[id] = o
		}
	}
	return out
}

// ReplicaReports returns the reports against container cid's replicas
// (cid 0: all of them), by container, block, datanode.
func (s *State) ReplicaReports(cid uint64) []*metapb.CorruptReplica {
	s.mu.RLock()
	defer s.mu.RUnlock()
	var out []*metapb.CorruptReplica
	for k, r := range s.reports {
		if cid == 0 || k.cid == cid {
			out = append(out, r)
		}
	}
	slices.SortFunc(out, func(a, b *metapb.CorruptReplica) int {
		return cmp.Or(cmp.Compare(a.Block.ContainerId, b.Block.ContainerId), cmp.Compare(a.Block.LocalId, b.Block.LocalId), cmp.Compare(a.DatanodeId, b.DatanodeId))
	})
	return out
}

// ReplicaReportCount is the number of stored reports.
func (s *State) ReplicaReportCount() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.reports)
}

// SafeModeExited reports whether a leader has left safe mode before.
func (s *State) SafeModeExited() bool {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.safeExit
}
