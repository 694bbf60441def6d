package meta

import (
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/basalt-store/basalt/internal/vfs"
)

// The data directory records, before any group is created, how this node
// became a member. Only an initial member (one of the cluster's first
// --peers) ever bootstraps a group, and always with the initial voters it
// recorded on its first start: those are the first entries of every
// replica's log. A node that joined (basalt meta --join) never
// bootstraps: each group on it starts empty and waits for the leader's
// snapshot, even after a restart in the middle of an add (a locally
// bootstrapped group would hold a configuration that is not the group's).
const (
	// JoinedMarker: written (synced, directory too) first thing on --join.
	JoinedMarker = "joined"
	// InitialMarker: the initial voters, written before the first bootstrap.
	InitialMarker = "initial-members"
)

// writeMarker writes DataDir/name durably: the file and DataDir's entry
// (and DataDir's own entry in its parent).
func writeMarker(fs vfs.FS, dir, name string, data []byte) error {
	if err := fs.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("meta: %s: %w", dir, err)
	}
	if err := vfs.SyncDir(fs, filepath.Dir(filepath.Clean(dir))); err != nil {
		return fmt.Errorf("meta: sync the parent of %s: %w", dir, err)
	}
	if err := vfs.WriteFileAtomic(fs, filepath.Join(dir, name), data); err != nil {
		return fmt.Errorf("meta: write %s: %w", filepath.Join(dir, name), err)
	}
	return nil
}

// bootMembership reads (or, on a first start, records) how this node
// became a member: joined, or an initial member with the initial voters
// (the ones its groups bootstrap with). peers are Config.Peers' IDs.
// inTable: this node has a row in its member table.
func bootMembership(fs vfs.FS, dir string, nodeID uint64, join bool, peers []uint64, inTable bool) (joined bool, initial []uint64, err error) {
	if join {
		// New wrote the marker already (first thing).
		return true, nil, nil
	}
	if ok, err := vfs.Exists(fs, filepath.Join(dir, JoinedMarker)); err != nil {
		return false, nil, err
	} else if ok {
		return true, nil, nil
	}
	path := filepath.Join(dir, InitialMarker)
	if ok, err := vfs.Exists(fs, path); err != nil {
		return false, nil, err
	} else if ok {
		b, err := vfs.ReadFile(fs, path)
		if err != nil {
			return false, nil, err
		}
		ids, err := parseIDs(string(b))
		if err != nil || !slices.Contains(ids, nodeID) {
			return false, nil, fmt.Errorf("meta: %s is damaged (%q): it should list the initial voters, this node among them", path, b)
		}
		return false, ids, nil
	}
	// No marker: a first start, or a data directory older than the
	// markers (its groups were bootstrapped with the static --peers).
	if !slices.Contains(peers, nodeID) {
		if len(peers) > 0 || inTable {
			// A node that is not among --peers and holds state can only
			// have joined. One that holds none (an empty directory, a
			// mistyped --id or --peers, a wiped member started without
			// --join) is no member: nothing is recorded, and New refuses
			// it (start it with --join, which runs the stricter checks).
			state := inTable
			if !state {
				ok, err := vfs.Exists(fs, filepath.Join(dir, "raft"))
				if err != nil {
					return false, nil, err
				}
				state = ok
			}
			if !state {
				return false, nil, nil
			}
			if err := writeMarker(fs, dir, JoinedMarker, []byte("joined\n")); err != nil {
				return false, nil, err
			}
			return true, nil, nil
		}
		peers = []uint64{nodeID} // a single-node service
	}
	ids := slices.Sorted(slices.Values(peers))
	if err := writeMarker(fs, dir, InitialMarker, []byte(formatIDs(ids)+"\n")); err != nil {
		return false, nil, err
	}
	return false, ids, nil
}

func formatIDs(ids []uint64) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.FormatUint(id, 10)
	}
	return strings.Join(s, " ")
}

func parseIDs(s string) ([]uint64, error) {
	f := strings.Fields(s)
	if len(f) == 0 || len(f) > maxMembers {
		return nil, fmt.Errorf("%d IDs", len(f))
	}
	ids := make([]uint64, 0, len(f))
	for _, w := range f {
		id, err := strconv.ParseUint(w, 10, 64)
		if err != nil || id == 0 {
			return nil, fmt.Errorf("bad ID %q", w)
		}
		ids = append(ids, id)
	}
	return ids, nil
}
