//go:build race

package s3_test

// raceEnabled: the race detector's instrumentation allocates, so
// allocation-count checks do not hold under it.
const raceEnabled = true
