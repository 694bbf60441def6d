package meta

import (
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
)

// nsCacheResolver resolves cache directives to blocks by reading this
// node's replica of the namespace (the SCM leader is co-located with the
// namespace leader; a follower's replica is at most a moment behind, and
// the monitor rescans periodically).
type nsCacheResolver struct{ s *Server }

var _ scm.CacheResolver = nsCacheResolver{}

func (r nsCacheResolver) ResolveCache(d *metapb.CacheDirective, limit int) ([]scm.CacheFile, bool, error) {
	st := r.s.nsState
	b, err := st.GetBucket(d.Volume, d.Bucket)
	if err != nil {
		return nil, false, err
	}
	var out []scm.CacheFile
	add := func(name string, ki *metapb.KeyInfo) bool {
		if len(out) >= limit {
			return false
		}
		out = append(out, scm.CacheFile{Key: name, Blocks: ki.GetBlocks()})
		return true
	}
	if b.Layout == metapb.BucketLayout_FS {
		path := strings.Trim(d.Path, "/")
		if path != "" {
			fs, err := st.GetFileStatus(&metapb.GetFileStatusRequest{Volume: d.Volume, Bucket: d.Bucket, Path: path})
			if err != nil {
				return nil, false, err
			}
			if !fs.IsDir {
				add(path, fs.File)
				return out, false, nil
			}
		}
		// A directory: every file below it.
		dirs := []string{path}
		for len(dirs) > 0 {
			dir := dirs[0]
			dirs = dirs[1:]
			after := ""
			for {
				ls, err := st.ListStatus(&metapb.ListStatusRequest{Volume: d.Volume, Bucket: d.Bucket, Path: dir, StartAfter: after, PageSize: 1000})
				if err != nil {
					return nil, false, err
				}
				for _, e := range ls.Entries {
					name := e.Path
					if e.IsDir {
						dirs = append(dirs, strings.Trim(name, "/"))
					} else if !add(name, e.File) {
						return out, true, nil
					}
					after = name[strings.LastIndex(strings.TrimSuffix(name, "/"), "/")+1:]
				}
				if !ls.Truncated || len(ls.Entries) == 0 {
					break
				}
			}
		}
		return out, false, nil
	}
	if !d.Prefix {
		if d.Path == "" {
			return nil, false, status.Error(codes.InvalidArgument, "cache directive: an object bucket path needs a key, or a prefix")
		}
		ki, err := st.LookupKey(d.Volume, d.Bucket, d.Path)
		if err != nil {
			if status.Code(err) == codes.NotFound {
				return nil, false, nil // may be written later
			}
			return nil, false, err
		}
		add(d.Path, ki)
		return out, false, nil
	}
	after := ""
	for {
		ls, err := st.ListKeys(&metapb.ListKeysRequest{Volume: d.Volume, Bucket: d.Bucket, Prefix: d.Path, StartAfter: after, PageSize: 1000})
		if err != nil {
			return nil, false, err
		}
		for _, k := range ls.Keys {
			ki, err := st.LookupKey(d.Volume, d.Bucket, k.Name)
			if err != nil {
				continue // deleted meanwhile
			}
			if !add(k.Name, ki) {
				return out, true, nil
			}
		}
		if !ls.Truncated || ls.NextStartAfter == "" {
			return out, false, nil
		}
		after = ls.NextStartAfter
	}
}
