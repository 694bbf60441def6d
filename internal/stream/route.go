package stream

import (
	"fmt"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/topology"
)

// Route orders a block's datanodes nearest to the client first (tree
// distance between network locations, ties keep the given order) and
// returns them as a stream route: the client dials the first, each
// datanode forwards to the next. The nearest need not be the pipeline's
// Raft leader. clientLoc "" keeps the given order (the metadata service
// already sorts replicas for the location the client gave it).
func Route(dns []*metapb.DatanodeDetails, clientLoc string) ([]Target, error) {
	sorted := append([]*metapb.DatanodeDetails(nil), dns...)
	topology.SortByDistance(sorted, 0, clientLoc,
		func(d *metapb.DatanodeDetails) uint64 { return d.GetId() },
		func(d *metapb.DatanodeDetails) string { return d.GetLocation() })
	out := make([]Target, 0, len(sorted))
	for _, d := range sorted {
		if d.GetStreamAddr() == "" {
			return nil, fmt.Errorf("stream: datanode %d (%s) has no stream address (it predates V2 streaming)", d.GetId(), d.GetHostname())
		}
		out = append(out, Target{ID: d.GetId(), Addr: d.GetStreamAddr()})
	}
	return out, nil
}
