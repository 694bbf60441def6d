// Package topology implements network locations and HDFS-style tree
// distance. A location is a path like "/dc1/rack2"; a node's full path is
// its location plus its own name. The distance between two nodes is the
// number of edges between them in the tree: 0 for the same node, 2 for two
// nodes on the same rack, 4 for two racks in the same data center, and so
// on. An empty location means the default rack "/default-rack".
package topology

import (
	"fmt"
	"sort"
	"strings"
)

// DefaultLocation is used for nodes configured without a location.
const DefaultLocation = "/default-rack"

// MaxDepth bounds the number of levels of a location.
const MaxDepth = 8

// Normalize validates a location and returns its canonical form.
func Normalize(loc string) (string, error) {
	if loc == "" {
		return DefaultLocation, nil
	}
	if !strings.HasPrefix(loc, "/") {
		return "", fmt.Errorf("network location %q must start with \"/\"", loc)
	}
	loc = strings.TrimRight(loc, "/")
	if loc == "" {
		return "", fmt.Errorf("network location %q has no levels", "/")
	}
	parts := strings.Split(loc[1:], "/")
	if len(parts) > MaxDepth {
		return "", fmt.Errorf("network location %q has %d levels, at most %d allowed", loc, len(parts), MaxDepth)
	}
	for _, p := range parts {
		if p == "" || p == "." || p == ".." {
			return "", fmt.Errorf("network location %q has an empty or relative level", loc)
		}
	}
	return loc, nil
}

func levels(loc string) []string {
	if loc == "" {
		loc = DefaultLocation
	}
	return strings.Split(strings.Trim(loc, "/"), "/")
}

// Distance is the tree distance between node a at location locA and node b
// at locB. sameNode says whether a and b are the same node (distance 0).
// An unknown caller location ("") is treated as far from everything except
// itself: the distance is the sum of both depths plus 2.
func Distance(locA, locB string, sameNode bool) int {
	if sameNode {
		return 0
	}
	la, lb := levels(locA), levels(locB)
	common := 0
	for common < len(la) && common < len(lb) && la[common] == lb[common] {
		common++
	}
	// Edges from each node up to the deepest common ancestor; +1 each for
	// the node's own edge to its rack.
	return (len(la) - common + 1) + (len(lb) - common + 1)
}

// SortByDistance orders nodes nearest first from a caller at callerLoc.
// callerID matches a node that is the caller itself (distance 0); pass 0
// if the caller is not a node. Ties keep their order (stable), so callers
// can pre-shuffle to spread load across equally near replicas.
func SortByDistance[T any](nodes []T, callerID uint64, callerLoc string, id func(T) uint64, loc func(T) string) {
	if callerLoc == "" && callerID == 0 {
		return
	}
	sort.SliceStable(nodes, func(i, j int) bool {
		di := Distance(callerLoc, loc(nodes[i]), callerID != 0 && id(nodes[i]) == callerID)
		dj := Distance(callerLoc, loc(nodes[j]), callerID != 0 && id(nodes[j]) == callerID)
		return di < dj
	})
}
