package scm

import (
	"math/rand/v2"
	"sort"
)

// Candidate is a datanode that may join a new pipeline.
type Candidate struct {
	ID        uint64
	Rack      string
	Pipelines int // open pipelines of the same replication it is in
}

// maxPlacementTries bounds the combinations ChooseMembers examines.
const maxPlacementTries = 50000

// ChooseMembers picks factor datanodes for a new pipeline among cands
// (which the caller has already limited to healthy datanodes under their
// pipeline limit), following Ozone's PipelinePlacementPolicy and seed 001:
//   - least loaded first (fewest pipelines), random among equals, so that
//     with N datanodes and a limit of M each the cluster ends with about
//     M·N/3 pipelines and every datanode is used (4 datanodes: not 3 + 1 idle);
//   - members on at least two racks when clusterRacks ≥ 2 (a multi-rack
//     cluster never gets a single-rack pipeline, even if that means fewer
//     pipelines);
//   - never the same member set as an existing open pipeline (existing
//     holds SetKey of each).
//
// It returns nil when no valid set exists.
func ChooseMembers(cands []Candidate, factor int, clusterRacks int, existing map[string]bool, rng *rand.Rand) []uint64 {
	if len(cands) < factor || factor < 1 {
		return nil
	}
	c := append([]Candidate(nil), cands...)
	rng.Shuffle(len(c), func(i, j int) { c[i], c[j] = c[j], c[i] })
	sort.SliceStable(c, func(i, j int) bool { return c[i].Pipelines < c[j].Pipelines })

	needRacks := 1
	if clusterRacks >= 2 && factor >= 2 {
		needRacks = 2
	}
	// Depth-first over index combinations in lexicographic order: the first
	// valid one has the least loaded members available.
	idx := make([]int, factor)
	tries := 0
	var rec func(pos, from int) []uint64
	rec = func(pos, from int) []uint64 {
		if pos == factor {
			tries++
			ids := make([]uint64, factor)
			racks := map[string]bool{}
			for i, k := range idx {
				ids[i] = c[k].ID
				racks[c[k].Rack] = true
			}
			if len(racks) < needRacks || existing[SetKey(ids)] {
				return nil
			}
			return ids
		}
		for k := from; k <= len(c)-(factor-pos) && tries < maxPlacementTries; k++ {
			idx[pos] = k
			if ids := rec(pos+1, k+1); ids != nil {
				return ids
			}
		}
		return nil
	}
	return rec(0, 0)
}
