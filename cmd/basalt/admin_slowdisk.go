package main

import (
	"fmt"
	"io"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Slow disks in `basalt admin datanode list`: the log directories and
// volumes each datanode marked slow (internal/slowdisk); new Raft groups
// and containers avoid them, and SCM replaces pipelines that use them.

type slowDiskJSON struct {
	Path        string `json:"path"`
	Kind        string `json:"kind"`
	MedianFlush string `json:"median_flush"`
	PeersMedian string `json:"peers_median"`
	Limit       string `json:"limit"`
	Since       string `json:"since,omitempty"`
}

func us(v uint64) time.Duration { return time.Duration(v) * time.Microsecond }

func slowDisksJSON(sd []*metapb.SlowDisk) []slowDiskJSON {
	var out []slowDiskJSON
	for _, s := range sd {
		j := slowDiskJSON{Path: s.GetPath(), Kind: s.GetKind(), MedianFlush: us(s.GetMedianFlushUs()).String(),
			PeersMedian: us(s.GetPeersMedianUs()).String(), Limit: us(s.GetLimitUs()).String()}
		if s.GetSinceUnixMs() > 0 {
			j.Since = time.UnixMilli(s.GetSinceUnixMs()).UTC().Format(time.RFC3339)
		}
		out = append(out, j)
	}
	return out
}

// printSlowDisks lists the slow disks under the datanode table (nothing
// when there are none).
func printSlowDisks(w io.Writer, ds []*metapb.DatanodeStatus) error {
	first := true
	for _, d := range ds {
		for _, s := range d.GetSlowDisks() {
			if first {
				if _, err := fmt.Fprintln(w, "\nSlow disks (no new Raft groups or containers; their pipelines are replaced):"); err != nil {
					return err
				}
				first = false
			}
			since := ""
			if s.GetSinceUnixMs() > 0 {
				since = ", since " + time.UnixMilli(s.GetSinceUnixMs()).UTC().Format(time.RFC3339)
			}
			if _, err := fmt.Fprintf(w, "  datanode %d: %s %s: median flush %v, peers %v, limit %v%s\n", d.GetDetails().GetId(), s.GetKind(), s.GetPath(),
				us(s.GetMedianFlushUs()).Round(100*time.Microsecond), us(s.GetPeersMedianUs()).Round(100*time.Microsecond), us(s.GetLimitUs()).Round(100*time.Microsecond), since); err != nil {
				return err
			}
		}
	}
	return nil
}
