//go:build race

package storage

// raceEnabled: the race detector's instrumentation allocates, so
// allocation-count checks do not hold under it.
const raceEnabled = true
