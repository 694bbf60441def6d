package sim

import (
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

func TestKVCommandRoundTrip(t *testing.T) {
	for _, c := range []kvCmd{{op: kvPut, key: "k1", value: "v"}, {op: kvGet, key: "a/b"}, {op: kvPut, key: "", value: "x"}} {
		got, err := decodeKV(c.encode())
		if err != nil || got != c {
			t.Fatalf("%+v -> %+v, %v", c, got, err)
		}
	}
	for _, bad := range [][]byte{nil, {'X', 0}, {kvPut, 9, 'a'}} {
		if _, err := decodeKV(bad); err == nil {
			t.Fatalf("%q decoded", bad)
		}
	}
}

func TestLinearizabilityChecker(t *testing.T) {
	ms := time.Millisecond
	put := func(c int, k, v string, call, ret time.Duration) *kvOp {
		return &kvOp{client: c, cmd: kvCmd{op: kvPut, key: k, value: v}, call: call, ret: ret}
	}
	get := func(c int, k, v string, found bool, call, ret time.Duration) *kvOp {
		return &kvOp{client: c, cmd: kvCmd{op: kvGet, key: k}, call: call, ret: ret, res: kvResult{value: v, found: found}}
	}
	unknownPut := put(1, "a", "2", 5*ms, 0)
	unknownPut.unknown = true
	cases := []struct {
		name string
		ops  []*kvOp
		want porcupine.CheckResult
	}{
		{"sequential", []*kvOp{put(0, "a", "1", 0, ms), get(1, "a", "1", true, 2*ms, 3*ms)}, porcupine.Ok},
		{"stale read", []*kvOp{put(0, "a", "1", 0, ms), put(0, "a", "2", 2*ms, 3*ms), get(1, "a", "1", true, 4*ms, 5*ms)}, porcupine.Illegal},
		{"lost write", []*kvOp{put(0, "a", "1", 0, ms), get(1, "a", "", false, 2*ms, 3*ms)}, porcupine.Illegal},
		{"concurrent", []*kvOp{put(0, "a", "1", 0, 10*ms), get(1, "a", "", false, ms, 2*ms), get(2, "a", "1", true, 3*ms, 4*ms)}, porcupine.Ok},
		{"unknown put may apply late", []*kvOp{put(0, "a", "1", 0, ms), unknownPut, get(2, "a", "2", true, 50*ms, 51*ms)}, porcupine.Ok},
		{"keys independent", []*kvOp{put(0, "a", "1", 0, ms), get(1, "b", "", false, 2*ms, 3*ms)}, porcupine.Ok},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, why := checkLinearizable(tc.ops, time.Second)
			if got != tc.want {
				t.Fatalf("got %v, want %v (%s)", got, tc.want, why)
			}
		})
	}
}

// TestNetwork checks the simulated network's fates: with no faults every
// message arrives once, in latency order; partitions and downed hosts
// lose messages; the same seed gives the same schedule.
func TestNetwork(t *testing.T) {
	run := func(seed uint64, cfg NetConfig, cut bool) []string {
		clk := &clock{}
		n := newNetwork(clk, stream(seed, "net"), cfg)
		var got []string
		for _, id := range []uint64{1, 2, 3} {
			h := &recHandler{id: id, got: &got, clk: clk}
			n.transport(id).Start(h)
		}
		if cut {
			n.partition([]uint64{1}, []uint64{3})
		}
		tr := n.transport(1)
		for i := 0; i < 20; i++ {
			tr.Send(uint64(2+i%2), []raftOutgoing{testMsg(uint64(i))})
		}
		for {
			e, ok := clk.next()
			if !ok {
				break
			}
			e.fn()
		}
		return got
	}
	clean := run(1, NetConfig{MinDelay: time.Millisecond, MaxDelay: 5 * time.Millisecond}, false)
	if len(clean) != 20 {
		t.Fatalf("clean network delivered %d of 20", len(clean))
	}
	cut := run(1, NetConfig{MinDelay: time.Millisecond, MaxDelay: 5 * time.Millisecond}, true)
	if len(cut) != 10 {
		t.Fatalf("partitioned network delivered %d, want the 10 to host 2", len(cut))
	}
	lossy := NetConfig{MaxDelay: 10 * time.Millisecond, Drop: 0.3, Duplicate: 0.3}
	a, b := run(7, lossy, false), run(7, lossy, false)
	if len(a) == 20 || len(a) == 0 {
		t.Fatalf("lossy network delivered %d of 20", len(a))
	}
	if len(a) != len(b) {
		t.Fatalf("same seed, different schedules: %v vs %v", a, b)
	}
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("same seed, different schedules: %v vs %v", a, b)
		}
	}
}
