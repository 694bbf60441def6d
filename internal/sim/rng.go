package sim

import (
	"hash/fnv"
	"math/rand/v2"
)

// stream returns the random stream named name of a seed. Each concern
// (network, faults, workload, crashes, every disk) draws from its own
// stream, so a change in how often one of them draws (a new kind of fault,
// one more message) does not reshuffle all the others: a seed keeps
// meaning roughly the same scenario as the code changes.
func stream(seed uint64, name string) *rand.Rand {
	h := fnv.New64a()
	h.Write([]byte(name))
	return rand.New(rand.NewPCG(seed, h.Sum64()))
}

// chance reports true with probability p.
func chance(r *rand.Rand, p float64) bool { return p > 0 && r.Float64() < p }
