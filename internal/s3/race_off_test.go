//go:build !race

package s3_test

const raceEnabled = false
