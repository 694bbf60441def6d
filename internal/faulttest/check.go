package faulttest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
)

// Violation classes: each is a broken promise.
const (
	MissingKey       = "KEY_MISSING"             // acknowledged key not found (LookupKey)
	BadKeyMeta       = "KEY_METADATA_WRONG"      // size or block layout disagrees with what was written
	ReadError        = "KEY_READ_ERROR"          // GetKey failed
	DataMismatch     = "KEY_DATA_MISMATCH"       // GetKey returned other bytes (SHA-256)
	UnreportedBlock  = "BLOCK_UNDER_REPLICATED"  // < 3 replicas verify, SCM lists 3 and reports nothing
	UnknownContainer = "CONTAINER_UNKNOWN"       // SCM does not know the block's container
	LeaderMissing    = "META_LEADER_MISSING_KEY" // a meta node, once leader, does not list an acknowledged key
	ProcessCrash     = "PROCESS_CRASH"           // a server exited without being killed
)

// Findings that are not violations.
const (
	ReportedBlock   = "block under-replicated, reported by SCM (allowed)"
	CaughtUp        = "block under-replicated at first check, verified within the settle time"
	FailedCommitted = "PutKey failed with a definite error but the key is committed"
	LongerReplica   = "replica block longer than the key's block"
	CorruptReported = "replicas on SCM's corrupt list (client reports) before the checks"
	SlowRestart     = "restarted datanode not serving within 15 s"
)

// Finding is one violation or observation.
type Finding struct {
	Class   string
	Key     string
	Block   string // "c<container>/b<local id>"
	Replica string // "dn3@127.0.0.1:port"
	Detail  string
	Faults  string // faults overlapping the key's write
}

// Checker verifies the acknowledged keys against a settled cluster.
type Checker struct {
	C      *Cluster
	Client *client.Client
	Volume string
	Bucket string
	Events []Event
	Logf   func(format string, args ...any)

	mu       sync.Mutex
	conns    map[string]*grpc.ClientConn
	dnNames  map[uint64]string
	findings []Finding
	info     []Finding
	firstBad []Acked            // keys failing the first replica pass
	keyFail  map[string]Finding // latest key-level failure per key
}

func (ch *Checker) add(f Finding, violation bool) {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if violation {
		ch.findings = append(ch.findings, f)
	} else {
		ch.info = append(ch.info, f)
	}
}

// Violations and Info return what the checks found.
func (ch *Checker) Violations() []Finding {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	return append([]Finding(nil), ch.findings...)
}
func (ch *Checker) Info() []Finding {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	return append([]Finding(nil), ch.info...)
}

func (ch *Checker) dn(addr string) (datanodepb.DatanodeClient, error) {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if ch.conns == nil {
		ch.conns = map[string]*grpc.ClientConn{}
	}
	conn := ch.conns[addr]
	if conn == nil {
		var err error
		conn, err = grpc.NewClient(addr, ch.C.Creds.GRPCDialOption(pki.RoleDatanode),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20)))
		if err != nil {
			return nil, err
		}
		ch.conns[addr] = conn
	}
	return datanodepb.NewDatanodeClient(conn), nil
}

// Close closes the datanode connections.
func (ch *Checker) Close() {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	for _, c := range ch.conns {
		c.Close()
	}
}

// faultsDuring names the faults whose window overlaps [start, end]; the
// disk stays full from its fill until its release.
func faultsDuring(events []Event, start, end time.Duration) string {
	var out []string
	var fillStart time.Duration = -1
	for _, e := range events {
		s, t := e.Start, e.End
		if e.Kind == FillDisk {
			if strings.HasPrefix(e.Note, "ballast removed") {
				if fillStart >= 0 && fillStart <= end && e.End >= start {
					out = append(out, "disk-full "+e.Target)
				}
				fillStart = -1
				continue
			}
			if strings.HasPrefix(e.Note, "skipped") {
				continue
			}
			fillStart = s
			continue
		}
		if s <= end && t >= start {
			out = append(out, string(e.Kind)+" "+e.Target)
		}
	}
	if fillStart >= 0 && fillStart <= end {
		out = append(out, "disk-full")
	}
	if len(out) == 0 {
		return "none"
	}
	return strings.Join(out, ", ")
}

// replicaResult is one replica's verdict.
type replicaResult struct {
	name, addr string
	ok         bool
	longer     bool
	why        string
}

// blockResult is one block's verdict.
type blockResult struct {
	key      Acked
	block    client.BlockInfo
	replicas []replicaResult
	good     int
	reported string // why SCM counts as having reported it ("" = it did not)
}

// CheckReplicas verifies every block of every acknowledged key on every
// replica SCM lists, re-checking the failures until settleBy (followers
// may still be catching up), and records the violations.
func (ch *Checker) CheckReplicas(ctx context.Context, acked []Acked, settleBy time.Time, workers int) error {
	dns, err := ch.C.Datanodes(ctx)
	if err != nil {
		return fmt.Errorf("list datanodes: %w", err)
	}
	ch.dnNames = map[uint64]string{}
	for _, d := range dns {
		ch.dnNames[d.Details.Id] = d.Details.Hostname
	}
	// An error here is the check's error, never "no corruption reported"
	// (the RPC is admins only: a checker that lost that right must fail).
	// Retried until settleBy: a leader change after the faults may answer
	// NotLeader for a while.
	cr, err := ch.C.CorruptReplicas(ctx)
	for err != nil && time.Now().Before(settleBy) && ctx.Err() == nil {
		time.Sleep(200 * time.Millisecond)
		cr, err = ch.C.CorruptReplicas(ctx)
	}
	if err != nil {
		return fmt.Errorf("list corrupt replicas: %w", err)
	}
	for _, r := range cr {
		ch.add(Finding{Class: CorruptReported, Block: fmt.Sprintf("c%d/b%d", r.Block.GetContainerId(), r.Block.GetLocalId()),
			Replica: ch.dnNames[r.DatanodeId], Detail: r.Reason}, false)
	}
	pending := acked
	for pass := 1; ; pass++ {
		containers, err := ch.C.Containers(ctx)
		if err != nil {
			return fmt.Errorf("list containers: %w", err)
		}
		bad := ch.checkPass(ctx, pending, containers, workers)
		ch.Logf("replica check pass %d: %d keys checked, %d with a block that does not verify on 3 replicas", pass, len(pending), len(bad))
		if pass == 1 {
			// However long the first pass took, re-check its failures at
			// least once, a little later.
			settleBy = later(settleBy, time.Now().Add(10*time.Second))
		}
		if len(bad) == 0 || time.Now().Add(5*time.Second).After(settleBy) || ctx.Err() != nil {
			ch.record(bad, containers)
			if pass > 1 {
				ch.noteCaughtUp(bad)
			}
			return nil
		}
		var next []Acked
		for _, b := range bad {
			next = append(next, b.key)
		}
		next = dedupe(next)
		if pass == 1 {
			ch.firstBad = next
		}
		pending = next
		select {
		case <-ctx.Done():
		case <-time.After(5 * time.Second):
		}
	}
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

func dedupe(as []Acked) []Acked {
	seen := map[string]bool{}
	var out []Acked
	for _, a := range as {
		if !seen[a.Name] {
			seen[a.Name] = true
			out = append(out, a)
		}
	}
	return out
}

// noteCaughtUp records the keys that failed the first pass but passed a
// later one.
func (ch *Checker) noteCaughtUp(finalBad []*blockResult) {
	still := map[string]bool{}
	for _, b := range finalBad {
		still[b.key.Name] = true
	}
	for _, a := range ch.firstBad {
		if !still[a.Name] {
			ch.add(Finding{Class: CaughtUp, Key: a.Name, Faults: faultsDuring(ch.Events, a.Start, a.End)}, false)
		}
	}
}

// record turns the final failing blocks into findings.
func (ch *Checker) record(bad []*blockResult, containers map[uint64]*metapb.Container) {
	for _, b := range bad {
		f := Finding{Key: b.key.Name, Block: fmt.Sprintf("c%d/b%d", b.block.ContainerID, b.block.LocalID),
			Faults: faultsDuring(ch.Events, b.key.Start, b.key.End)}
		if b.replicas == nil { // key-level failure, Detail says
			continue
		}
		var parts []string
		for _, r := range b.replicas {
			if r.ok {
				parts = append(parts, r.name+" ok")
			} else {
				parts = append(parts, r.name+": "+r.why)
			}
		}
		ct := containers[b.block.ContainerID]
		state := "?"
		if ct != nil {
			state = fmt.Sprintf("%v, replicas %v", ct.State, ch.names(ct.Replicas))
		}
		f.Detail = fmt.Sprintf("%d/%d verify; SCM: %s; %s", b.good, len(b.replicas), state, strings.Join(parts, "; "))
		for _, r := range b.replicas {
			if !r.ok {
				f.Replica = r.name + "@" + r.addr
				break
			}
		}
		switch {
		case ct == nil:
			f.Class = UnknownContainer
			ch.add(f, true)
		case b.reported != "":
			f.Class = ReportedBlock
			f.Detail = b.reported + "; " + f.Detail
			ch.add(f, false)
		default:
			f.Class = UnreportedBlock
			ch.add(f, true)
		}
	}
}

func (ch *Checker) names(ids []uint64) string {
	var out []string
	for _, id := range ids {
		n := ch.dnNames[id]
		if n == "" {
			n = fmt.Sprintf("dn-id%d", id)
		}
		out = append(out, n)
	}
	return "[" + strings.Join(out, " ") + "]"
}

// checkPass checks the keys with workers goroutines and returns the blocks
// that do not verify on 3 replicas. Key-level failures (missing key, wrong
// layout) are recorded directly, on the last pass only, by the caller's
// retry: they are returned as blockResults without replicas.
func (ch *Checker) checkPass(ctx context.Context, keys []Acked, containers map[uint64]*metapb.Container, workers int) []*blockResult {
	var mu sync.Mutex
	var bad []*blockResult
	work := make(chan Acked)
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var buf []byte
			for a := range work {
				var res []*blockResult
				res, buf = ch.checkKey(ctx, a, containers, buf)
				if len(res) > 0 {
					mu.Lock()
					bad = append(bad, res...)
					mu.Unlock()
				}
			}
		}()
	}
	for _, a := range keys {
		if ctx.Err() != nil {
			break
		}
		work <- a
	}
	close(work)
	wg.Wait()
	return bad
}

func (ch *Checker) checkKey(ctx context.Context, a Acked, containers map[uint64]*metapb.Container, buf []byte) ([]*blockResult, []byte) {
	var info client.KeyInfo
	var err error
	for attempt := 0; attempt < 3; attempt++ {
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		info, err = ch.Client.StatKey(sctx, ch.Volume, ch.Bucket, a.Name)
		cancel()
		if err == nil || errors.Is(err, client.ErrNotFound) {
			break
		}
	}
	faults := faultsDuring(ch.Events, a.Start, a.End)
	if err != nil {
		class := ReadError
		if errors.Is(err, client.ErrNotFound) {
			class = MissingKey
		}
		// Only the last pass's result is kept (see keyFailures).
		ch.keyFailure(a.Name, Finding{Class: class, Key: a.Name, Detail: "lookup: " + err.Error(), Faults: faults})
		return []*blockResult{{key: a}}, buf
	}
	var off uint64
	for _, b := range info.Blocks {
		if b.Offset != off {
			ch.keyFailure(a.Name, Finding{Class: BadKeyMeta, Key: a.Name, Faults: faults,
				Detail: fmt.Sprintf("block c%d/b%d at offset %d, want %d", b.ContainerID, b.LocalID, b.Offset, off)})
			return []*blockResult{{key: a}}, buf
		}
		off += b.Length
	}
	if int64(info.Size) != a.Size || int64(off) != a.Size {
		ch.keyFailure(a.Name, Finding{Class: BadKeyMeta, Key: a.Name, Faults: faults,
			Detail: fmt.Sprintf("size %d, blocks hold %d, written %d", info.Size, off, a.Size)})
		return []*blockResult{{key: a}}, buf
	}
	ch.keyFailure(a.Name, Finding{}) // clears an earlier pass's key-level failure
	data := keyData(a.DataSeed, a.Size, buf)
	var bad []*blockResult
	for _, b := range info.Blocks {
		want := data[b.Offset : b.Offset+b.Length]
		br := &blockResult{key: a, block: b}
		var failing []uint64
		for _, r := range b.Replicas {
			rr := ch.checkReplica(ctx, r, b, want)
			if rr.ok {
				br.good++
			} else {
				failing = append(failing, r.ID)
			}
			if rr.longer {
				ch.add(Finding{Class: LongerReplica, Key: a.Name, Block: fmt.Sprintf("c%d/b%d", b.ContainerID, b.LocalID),
					Replica: rr.name, Detail: rr.why}, false)
			}
			br.replicas = append(br.replicas, rr)
		}
		if br.good >= 3 && len(b.Replicas) >= 3 {
			continue
		}
		br.reported = reported(containers[b.ContainerID], len(b.Replicas), failing, ch.names)
		bad = append(bad, br)
	}
	return bad, data
}

// keyFailures holds the latest key-level failure per key; FinishKeys
// records them.
func (ch *Checker) keyFailure(name string, f Finding) {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if ch.keyFail == nil {
		ch.keyFail = map[string]Finding{}
	}
	if f.Class == "" {
		delete(ch.keyFail, name)
		return
	}
	ch.keyFail[name] = f
}

// FinishKeys records the key-level failures that remained after the last
// replica-check pass.
func (ch *Checker) FinishKeys() {
	ch.mu.Lock()
	fs := ch.keyFail
	ch.keyFail = nil
	ch.mu.Unlock()
	for _, f := range fs {
		ch.add(f, true)
	}
}

func (ch *Checker) checkReplica(ctx context.Context, r client.Replica, b client.BlockInfo, want []byte) replicaResult {
	name := r.Hostname
	if name == "" {
		name = ch.dnNames[r.ID]
	}
	rr := replicaResult{name: name, addr: r.Addr}
	dn, err := ch.dn(r.Addr)
	if err != nil {
		rr.why = err.Error()
		return rr
	}
	rctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	st, err := dn.ReadBlock(blocktoken.WithToken(rctx, b.Token), &datanodepb.ReadBlockRequest{Block: &datanodepb.BlockID{ContainerId: b.ContainerID, LocalId: b.LocalID}})
	if err != nil {
		rr.why = rpcWhy(err)
		return rr
	}
	var got []byte
	var bd *datanodepb.BlockData
	for {
		m, err := st.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			rr.why = fmt.Sprintf("after %d bytes: %s", len(got), rpcWhy(err))
			return rr
		}
		if m.Block != nil {
			bd = m.Block
		}
		got = append(got, m.Data...)
	}
	if bd == nil {
		rr.why = "no BlockData in the reply"
		return rr
	}
	switch {
	case len(got) < len(want):
		rr.why = fmt.Sprintf("short: replica has %d bytes (BlockData length %d, bcsid %d), key's block has %d", len(got), bd.Length, bd.Bcsid, len(want))
		if i := firstDiff(got, want[:len(got)]); i >= 0 {
			rr.why += fmt.Sprintf("; and differs at byte %d", i)
		}
		return rr
	case !bytes.Equal(got[:len(want)], want):
		i := firstDiff(got[:len(want)], want)
		zeros := allZero(got[i:min(len(want), i+4096)])
		rr.why = fmt.Sprintf("content differs from byte %d of %d (bcsid %d)", i, len(want), bd.Bcsid)
		if zeros {
			rr.why += ", zeros there (a hole)"
		}
		return rr
	}
	rr.ok = true
	if len(got) > len(want) {
		rr.longer = true
		rr.why = fmt.Sprintf("replica has %d bytes, key's block %d", len(got), len(want))
	}
	return rr
}

func rpcWhy(err error) string {
	if s, ok := status.FromError(err); ok {
		return fmt.Sprintf("%v: %s", s.Code(), truncate(s.Message(), 300))
	}
	return truncate(err.Error(), 300)
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	if len(a) != len(b) {
		return min(len(a), len(b))
	}
	return -1
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return len(b) > 0
}

// reported says whether the system admits that a block whose listed
// replicas (listed of them; failing: the IDs of those that did not
// verify) are fewer than 3 good ones is not fully replicated, and how:
//
//   - SCM's container record lists fewer than 3 replicas, or something in
//     it says the whole container is unhealthy: an enum value naming
//     UNHEALTHY, UNDER_REPLICATED, DEGRADED or MISSING (its state, or a
//     per-replica state a later version may add), or a set field so named
//     that is not a list of datanode IDs;
//   - every failing replica is in a list of datanode IDs whose field name
//     says unhealthy (Container.unhealthy_replicas);
//   - no listed replica fails but fewer than 3 are listed: the lookup left
//     replicas out, as it does for replicas SCM recorded unhealthy.
//
// It walks the record by reflection so a new field or enum value counts
// without changing this test.
func reported(ct *metapb.Container, listed int, failing []uint64, names func([]uint64) string) string {
	if ct == nil {
		return ""
	}
	if ct.Replication == metapb.Replication_THREE && len(ct.Replicas) < 3 {
		return fmt.Sprintf("SCM lists %d replicas", len(ct.Replicas))
	}
	wide, bad := scanContainer(ct)
	if wide != "" {
		return wide
	}
	if len(failing) == 0 {
		return fmt.Sprintf("LookupKey lists %d replicas (SCM unhealthy: %s)", listed, names(sortedIDs(bad)))
	}
	for _, id := range failing {
		if !bad[id] {
			return ""
		}
	}
	return fmt.Sprintf("SCM records the failing replicas unhealthy (%s)", names(sortedIDs(bad)))
}

func sortedIDs(m map[uint64]bool) []uint64 {
	var out []uint64
	for id := range m {
		out = append(out, id)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

var reportWords = []string{"UNHEALTHY", "UNDER_REPLICATED", "DEGRADED", "MISSING"}

// scanContainer returns why the whole container counts as reported ("" if
// it does not) and the datanode IDs listed in integer-list fields named
// unhealthy.
func scanContainer(ct *metapb.Container) (wide string, bad map[uint64]bool) {
	bad = map[uint64]bool{}
	named := func(fd protoreflect.FieldDescriptor) bool {
		n := strings.ToUpper(string(fd.Name()))
		for _, w := range reportWords[:3] {
			if strings.Contains(n, w) {
				return true
			}
		}
		return false
	}
	enumWhy := func(fd protoreflect.FieldDescriptor, ed protoreflect.EnumDescriptor, v protoreflect.EnumNumber) {
		ev := ed.Values().ByNumber(v)
		if ev == nil || wide != "" {
			return
		}
		for _, w := range reportWords {
			if strings.Contains(string(ev.Name()), w) {
				wide = fmt.Sprintf("SCM reports %s = %s", fd.Name(), ev.Name())
				return
			}
		}
	}
	var walk func(m protoreflect.Message, top bool)
	walk = func(m protoreflect.Message, top bool) {
		m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
			isIDList := fd.IsList() && (fd.Kind() == protoreflect.Uint64Kind || fd.Kind() == protoreflect.Fixed64Kind)
			switch {
			case top && isIDList && named(fd):
				l := v.List()
				for i := range l.Len() {
					bad[l.Get(i).Uint()] = true
				}
				return true
			case named(fd) && wide == "":
				wide = fmt.Sprintf("SCM reports %s = %v", fd.Name(), v)
			}
			switch {
			case fd.IsMap():
				v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
					switch fd.MapValue().Kind() {
					case protoreflect.EnumKind:
						enumWhy(fd, fd.MapValue().Enum(), mv.Enum())
					case protoreflect.MessageKind:
						walk(mv.Message(), false)
					}
					return true
				})
			case fd.IsList():
				l := v.List()
				for i := range l.Len() {
					switch fd.Kind() {
					case protoreflect.EnumKind:
						enumWhy(fd, fd.Enum(), l.Get(i).Enum())
					case protoreflect.MessageKind, protoreflect.GroupKind:
						walk(l.Get(i).Message(), false)
					}
				}
			case fd.Kind() == protoreflect.EnumKind:
				enumWhy(fd, fd.Enum(), v.Enum())
			case fd.Kind() == protoreflect.MessageKind || fd.Kind() == protoreflect.GroupKind:
				walk(v.Message(), false)
			}
			return true
		})
	}
	walk(ct.ProtoReflect(), true)
	return wide, bad
}

// CheckReadback reads every acknowledged key through the client and
// compares its SHA-256.
func (ch *Checker) CheckReadback(ctx context.Context, acked []Acked, workers int) {
	work := make(chan Acked)
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for a := range work {
				ch.readback(ctx, a)
			}
		}()
	}
	for _, a := range acked {
		if ctx.Err() != nil {
			break
		}
		work <- a
	}
	close(work)
	wg.Wait()
}

func (ch *Checker) readback(ctx context.Context, a Acked) {
	faults := faultsDuring(ch.Events, a.Start, a.End)
	rctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	r, err := ch.Client.GetKey(rctx, ch.Volume, ch.Bucket, a.Name)
	if err != nil {
		class := ReadError
		if errors.Is(err, client.ErrNotFound) {
			class = MissingKey
		}
		ch.add(Finding{Class: class, Key: a.Name, Detail: "get: " + err.Error(), Faults: faults}, true)
		return
	}
	defer r.Close()
	h := sha256.New()
	n, err := io.Copy(h, r)
	if err != nil {
		ch.add(Finding{Class: ReadError, Key: a.Name, Detail: fmt.Sprintf("read after %d bytes: %v", n, err), Faults: faults}, true)
		return
	}
	var sum [32]byte
	h.Sum(sum[:0])
	if n != a.Size || sum != a.SHA {
		ch.add(Finding{Class: DataMismatch, Key: a.Name, Faults: faults,
			Detail: fmt.Sprintf("read %d bytes sha256 %x, wrote %d bytes sha256 %x", n, sum[:8], a.Size, a.SHA[:8])}, true)
	}
}

// CheckLeaders lists the bucket on each meta node as leader in turn (the
// leader is killed and restarted until every node has led, at most
// rounds times) and reports acknowledged keys a leader does not list:
// metadata that went backwards on a follower shows up only once that
// follower leads. It also reports keys whose PutKey failed but which are
// committed (information).
func (ch *Checker) CheckLeaders(ctx context.Context, acked []Acked, failed []string, rounds int) {
	led := map[int]bool{}
	for round := 0; round < rounds && len(led) < numMeta && ctx.Err() == nil; round++ {
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		li, err := ch.C.WaitLeader(wctx)
		cancel()
		if err != nil {
			ch.Logf("leader check: %v", err)
			return
		}
		if !led[li] {
			led[li] = true
			names, err := ch.list(ctx)
			if err != nil {
				ch.Logf("leader check: listing with leader %s: %v", ch.C.Metas[li].Name, err)
			} else {
				missing := 0
				for _, a := range acked {
					if !names[a.Name] {
						missing++
						if missing <= 20 {
							ch.add(Finding{Class: LeaderMissing, Key: a.Name, Detail: "not listed with leader " + ch.C.Metas[li].Name,
								Faults: faultsDuring(ch.Events, a.Start, a.End)}, true)
						}
					}
				}
				if missing > 20 {
					ch.add(Finding{Class: LeaderMissing, Detail: fmt.Sprintf("%d more keys not listed with leader %s", missing-20, ch.C.Metas[li].Name)}, true)
				}
				if round == 0 {
					for _, k := range failed {
						if names[k] {
							ch.add(Finding{Class: FailedCommitted, Key: k}, false)
						}
					}
				}
				ch.Logf("leader check: %s leads, lists %d keys, %d acknowledged keys missing", ch.C.Metas[li].Name, len(names), missing)
			}
		}
		if len(led) == numMeta {
			break
		}
		// Make another node lead: kill this one, wait for a new leader,
		// restart it.
		p := ch.C.Metas[li]
		if err := p.Kill(); err != nil {
			ch.Logf("leader check: %v", err)
			return
		}
		wctx, cancel = context.WithTimeout(ctx, 30*time.Second)
		_, err = ch.C.WaitLeader(wctx)
		cancel()
		if err := p.Start(); err != nil {
			ch.Logf("leader check: restart %s: %v", p.Name, err)
			return
		}
		if err != nil {
			ch.Logf("leader check: no new leader after killing %s: %v", p.Name, err)
			return
		}
	}
	var who []string
	for i := range led {
		who = append(who, ch.C.Metas[i].Name)
	}
	sort.Strings(who)
	ch.Logf("leader check: listed with leaders %v", who)
}

func (ch *Checker) list(ctx context.Context) (map[string]bool, error) {
	lctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	names := map[string]bool{}
	for e, err := range ch.Client.Keys(lctx, ch.Volume, ch.Bucket, client.ListKeysOptions{PageSize: 1000}) {
		if err != nil {
			return nil, err
		}
		if e.Key != nil {
			names[e.Key.Name] = true
		}
	}
	return names, nil
}

// AddSlowRestarts records restarts after which a datanode did not serve
// (an observation: a datanode that cannot start should say why and exit).
func (ch *Checker) AddSlowRestarts() {
	for _, e := range ch.Events {
		if e.Kind == KillDN && strings.Contains(e.Note, "not serving") {
			ch.add(Finding{Class: SlowRestart, Replica: e.Target, Detail: fmt.Sprintf("at %.1fs: %s", e.Start.Seconds(), e.Note)}, false)
		}
	}
}

// AddCrashes records unexpected process exits as violations.
func (ch *Checker) AddCrashes(crashes []Crash, since func(time.Time) time.Duration) {
	for _, c := range crashes {
		ch.add(Finding{Class: ProcessCrash, Replica: c.Name,
			Detail: fmt.Sprintf("at %.1fs: %s; log tail: %s", since(c.At).Seconds(), c.Err, lastLines(c.Tail, 6))}, true)
	}
}

func lastLines(s string, n int) string {
	ls := strings.Split(strings.TrimSpace(s), "\n")
	if len(ls) > n {
		ls = ls[len(ls)-n:]
	}
	return strings.Join(ls, " | ")
}

// Table formats findings: a summary line per class (count, distinct
// keys, example) and breakdowns of failing replicas by datanode and by
// reason.
func Table(title string, fs []Finding) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: %d\n", title, len(fs))
	if len(fs) == 0 {
		return b.String()
	}
	byClass := map[string][]Finding{}
	var classes []string
	for _, f := range fs {
		if byClass[f.Class] == nil {
			classes = append(classes, f.Class)
		}
		byClass[f.Class] = append(byClass[f.Class], f)
	}
	sort.Strings(classes)
	tw := tabwriter.NewWriter(&b, 2, 8, 2, ' ', 0)
	fmt.Fprintf(tw, "  class\tcount\tkeys\texample\n")
	for _, c := range classes {
		keys := map[string]bool{}
		for _, f := range byClass[c] {
			if f.Key != "" {
				keys[f.Key] = true
			}
		}
		ex := byClass[c][0]
		fmt.Fprintf(tw, "  %s\t%d\t%d\t%s\n", c, len(byClass[c]), len(keys), truncate(describe(ex), 900))
	}
	tw.Flush()
	for _, c := range classes {
		if len(byClass[c]) < 2 {
			continue
		}
		// Breakdowns: which replica failed and why (numbers folded), and
		// which faults overlapped the writes.
		rep, why, flt, ctr := map[string]int{}, map[string]int{}, map[string]int{}, map[string]int{}
		for _, f := range byClass[c] {
			if f.Replica != "" {
				rep[strings.SplitN(f.Replica, "@", 2)[0]]++
			}
			if f.Block != "" {
				ctr[strings.SplitN(f.Block, "/", 2)[0]]++
			}
			why[reasonOf(f.Detail)]++
			flt[f.Faults]++
		}
		delete(flt, "")
		delete(why, "")
		for _, x := range []struct {
			what string
			m    map[string]int
			n    int
		}{{"first failing replica", rep, 10}, {"container", ctr, 12}, {"reason", why, 6}, {"faults during the write", flt, 8}} {
			if len(x.m) > 0 {
				fmt.Fprintf(&b, "  %s by %s: %s\n", c, x.what, counts(x.m, x.n))
			}
		}
	}
	return b.String()
}

func describe(f Finding) string {
	var parts []string
	if f.Key != "" {
		parts = append(parts, "key "+f.Key)
	}
	if f.Block != "" {
		parts = append(parts, "block "+f.Block)
	}
	if f.Replica != "" {
		parts = append(parts, "replica "+f.Replica)
	}
	if f.Detail != "" {
		parts = append(parts, f.Detail)
	}
	if f.Faults != "" {
		parts = append(parts, "faults during write: "+f.Faults)
	}
	return strings.Join(parts, " | ")
}

// reasonOf folds the first failing replica's reason of a detail.
func reasonOf(d string) string {
	if d == "" {
		return ""
	}
	// Details look like "2/3 verify; SCM: ...; dn1 ok; dn4: NotFound: ...".
	for _, p := range strings.Split(d, "; ") {
		if i := strings.Index(p, ": "); i > 0 && strings.HasPrefix(p, "dn") && !strings.HasSuffix(p, " ok") {
			return truncate(digits.ReplaceAllString(p[i+2:], "#"), 120)
		}
	}
	return truncate(digits.ReplaceAllString(d, "#"), 120)
}

func counts(m map[string]int, n int) string {
	type kv struct {
		k string
		v int
	}
	var kvs []kv
	for k, v := range m {
		kvs = append(kvs, kv{k, v})
	}
	sort.Slice(kvs, func(i, j int) bool { return kvs[i].v > kvs[j].v || kvs[i].v == kvs[j].v && kvs[i].k < kvs[j].k })
	var out []string
	for i, e := range kvs {
		if i == n {
			out = append(out, fmt.Sprintf("… %d more", len(kvs)-n))
			break
		}
		out = append(out, fmt.Sprintf("%s ×%d", e.k, e.v))
	}
	return strings.Join(out, ", ")
}
