//go:build race

package raft

// raceEnabled: the race detector slows everything ~10x; the heaviest tests
// scale down under it.
const raceEnabled = true
