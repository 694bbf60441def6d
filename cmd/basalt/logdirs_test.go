package main

import (
	"testing"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestLogDirsText: the LOGDIRS column of `admin datanode list`.
func TestLogDirsText(t *testing.T) {
	for _, c := range []struct {
		total, failed uint32
		want          string
	}{
		{0, 0, "-"},
		{2, 0, "2"},
		{2, 1, "1/2 failed"},
		{1, 1, "1/1 failed, no new pipelines"},
	} {
		if got := logDirsText(&metapb.DatanodeStatus{LogDirs: c.total, LogDirsFailed: c.failed}); got != c.want {
			t.Errorf("%d/%d: %q, want %q", c.failed, c.total, got, c.want)
		}
	}
}
