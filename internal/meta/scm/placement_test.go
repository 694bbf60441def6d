package scm

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// simulate runs the pipeline creator's loop over a topology: keep placing
// until ChooseMembers finds nothing.
func simulate(t *testing.T, racks []string, limit int, rng *rand.Rand) (pipes [][]uint64, load map[uint64]int) {
	t.Helper()
	load = map[uint64]int{}
	existing := map[string]bool{}
	rackSet := map[string]bool{}
	for _, r := range racks {
		rackSet[r] = true
	}
	for iter := 0; iter < 10000; iter++ {
		var cands []Candidate
		for i, r := range racks {
			id := uint64(i + 1)
			if load[id] < limit {
				cands = append(cands, Candidate{ID: id, Rack: r, Pipelines: load[id]})
			}
		}
		ids := ChooseMembers(cands, 3, len(rackSet), existing, rng)
		if ids == nil {
			return pipes, load
		}
		existing[SetKey(ids)] = true
		for _, id := range ids {
			load[id]++
		}
		pipes = append(pipes, ids)
	}
	t.Fatal("placement did not terminate")
	return
}

// TestPlacementProperties checks, over random topologies, the properties
// seed 001 asks for: per-datanode limit, distinct member sets, rack spread
// on multi-rack clusters, every datanode used, and about M·N/3 pipelines.
func TestPlacementProperties(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := 0; trial < 300; trial++ {
		n := 3 + rng.IntN(30)
		nracks := 1 + rng.IntN(5)
		limit := 1 + rng.IntN(5)
		racks := make([]string, n)
		for i := range racks {
			racks[i] = fmt.Sprintf("/dc1/rack%d", rng.IntN(nracks))
		}
		rackSet := map[string]bool{}
		for _, r := range racks {
			rackSet[r] = true
		}
		pipes, load := simulate(t, racks, limit, rng)
		desc := fmt.Sprintf("trial %d: n=%d racks=%v limit=%d", trial, n, racks, limit)
		seen := map[string]bool{}
		for _, p := range pipes {
			k := SetKey(p)
			if seen[k] {
				t.Fatalf("%s: duplicate member set %s", desc, k)
			}
			seen[k] = true
			rs := map[string]bool{}
			for _, id := range p {
				rs[racks[id-1]] = true
			}
			if len(rackSet) >= 2 && len(rs) < 2 {
				t.Fatalf("%s: pipeline %v on one rack in a %d-rack cluster", desc, p, len(rackSet))
			}
		}
		for id, l := range load {
			if l > limit {
				t.Fatalf("%s: datanode %d in %d pipelines, limit %d", desc, id, l, limit)
			}
		}
		// With a balanced rack layout (no rack holding more than a third of
		// the nodes), every node is used and the count is near M·N/3.
		maxRack := 0
		cnt := map[string]int{}
		for _, r := range racks {
			cnt[r]++
			maxRack = max(maxRack, cnt[r])
		}
		if len(rackSet) == 1 || maxRack*3 <= n {
			// With a limit of 1, n mod 3 datanodes must stay idle.
			wantUsed := n
			if limit == 1 {
				wantUsed = n / 3 * 3
			}
			if len(load) < wantUsed {
				t.Fatalf("%s: only %d of %d datanodes used (%v)", desc, len(load), n, pipes)
			}
			// Distinct member sets cap the count at C(n,3).
			ideal := min(limit*n/3, n*(n-1)*(n-2)/6)
			if len(pipes) < ideal-2 {
				t.Fatalf("%s: %d pipelines, want about %d", desc, len(pipes), ideal)
			}
		}
	}
}

func TestPlacementFourNodes(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	pipes, load := simulate(t, []string{"/r1", "/r1", "/r1", "/r1"}, 3, rng)
	if len(pipes) != 4 || len(load) != 4 {
		t.Fatalf("4 datanodes, limit 3: got %d pipelines over %d datanodes, want 4 over 4: %v", len(pipes), len(load), pipes)
	}
	pipes, load = simulate(t, []string{"/r1", "/r1", "/r2", "/r2"}, 2, rng)
	if len(pipes) != 2 || len(load) != 4 {
		t.Fatalf("4 datanodes on 2 racks, limit 2: %d pipelines over %d datanodes: %v", len(pipes), len(load), pipes)
	}
}

func TestPlacementTooFew(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	if ids := ChooseMembers([]Candidate{{ID: 1}, {ID: 2}}, 3, 1, nil, rng); ids != nil {
		t.Fatalf("chose %v from 2 candidates", ids)
	}
	// Two candidates on one rack of a two-rack cluster plus a third on it:
	// no valid set.
	c := []Candidate{{ID: 1, Rack: "a"}, {ID: 2, Rack: "a"}, {ID: 3, Rack: "a"}}
	if ids := ChooseMembers(c, 3, 2, nil, rng); ids != nil {
		t.Fatalf("chose single-rack %v in a two-rack cluster", ids)
	}
}
