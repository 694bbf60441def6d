package sim

import (
	"flag"
	"fmt"
	"os"
	"strings"
	"testing"
	"testing/cryptotest"
	"time"
)

var (
	flagSeed   = flag.Uint64("seed", 0, "run TestSim with this seed only (0: the fixed set)")
	flagSteps  = flag.Int("steps", 0, "workload actions per seed (0: default)")
	flagSeeds  = flag.Int("seeds", 0, "TestSimRandom: how many random seeds to run")
	flagStrict = flag.Bool("strict", false, "fail seeds that hit only known defects (TestSimRandom always does)")
)

// fixedSeeds run in `make test`: seeds 1 to nFixedSeeds, about 85 s on
// the shared 2-core machine (docs/SIMULATION.md).
const nFixedSeeds = 300

func fixedSeeds() []uint64 {
	seeds := make([]uint64, nFixedSeeds)
	for i := range seeds {
		seeds[i] = uint64(i + 1)
	}
	return seeds
}

const defaultSteps = 200

func steps() int {
	if *flagSteps > 0 {
		return *flagSteps
	}
	return defaultSteps
}

// runSeed runs one seed and fails the test with its replay command.
// etcd raft draws election timeouts from crypto/rand: the seed fixes
// that stream too.
func runSeed(t *testing.T, seed uint64) *Report {
	t.Helper()
	cryptotest.SetGlobalRandom(t, seed)
	cfg := Config{Seed: seed, Steps: steps()}
	if testing.Verbose() && *flagSeed != 0 {
		cfg.Logf = func(format string, args ...any) { fmt.Fprintf(os.Stderr, format+"\n", args...) }
	}
	start := time.Now()
	rep := Run(cfg)
	t.Logf("%v (took %v)", rep, time.Since(start).Round(time.Millisecond))
	if len(rep.Violations) > 0 && rep.OnlyKnown() && !*flagStrict {
		t.Skipf("seed %d hits only known defects (docs/SIMULATION.md):\n  %s\nreplay: %s", seed, strings.Join(rep.Violations, "\n  "), Replay(seed, cfg.Steps))
	}
	if len(rep.Violations) > 0 {
		t.Errorf("seed %d failed:\n  %s\nreplay: %s", seed, strings.Join(rep.Violations, "\n  "), Replay(seed, cfg.Steps))
	}
	return rep
}

// TestSim runs the fixed seeds, or -seed alone.
func TestSim(t *testing.T) {
	seeds := fixedSeeds()
	if *flagSeed != 0 {
		seeds = []uint64{*flagSeed}
	}
	for _, seed := range seeds {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { runSeed(t, seed) })
	}
}

// TestSimDeterministic: one seed run twice does exactly the same thing.
func TestSimDeterministic(t *testing.T) {
	var a, b *Report
	t.Run("first", func(t *testing.T) { cryptotest.SetGlobalRandom(t, 42); a = Run(Config{Seed: 42, Steps: 80}) })
	t.Run("second", func(t *testing.T) { cryptotest.SetGlobalRandom(t, 42); b = Run(Config{Seed: 42, Steps: 80}) })
	if a.Trace != b.Trace || a.String() != b.String() {
		t.Fatalf("seed 42 ran differently twice:\n%v\n%v", a, b)
	}
}

// TestSimRandom runs -seeds random seeds (make simulate), printing the
// replay command of each failing one.
func TestSimRandom(t *testing.T) {
	if *flagSeeds == 0 {
		t.Skip("run with -seeds=N (make simulate SEEDS=N)")
	}
	base := uint64(time.Now().UnixNano())
	var failed []string
	for i := 0; i < *flagSeeds; i++ {
		seed := base + uint64(i)*0x9e3779b97f4a7c15
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			*flagStrict = true
			if rep := runSeed(t, seed); len(rep.Violations) > 0 {
				failed = append(failed, Replay(seed, steps()))
			}
		})
	}
	for _, f := range failed {
		fmt.Println("FAILING SEED:", f)
	}
}
