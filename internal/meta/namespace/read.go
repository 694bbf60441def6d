package namespace

import (
	"encoding/binary"
	"errors"
	"strings"

	"github.com/cockroachdb/pebble/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// Readers of committed state. They are not linearizable by themselves: the
// caller runs the Raft read barrier (ReadIndex) first.

func (s *State) view(f func(r pebble.Reader) error) error { return s.st.View(f) }

// GetVolume returns a volume.
func (s *State) GetVolume(name string) (*metapb.Volume, error) {
	v := &metapb.Volume{}
	err := s.view(func(r pebble.Reader) error {
		ok, err := get(r, volumeKey(name), v)
		if err == nil && !ok {
			err = noSuchVolume(name)
		}
		return err
	})
	return v, err
}

// GetBucket returns a bucket.
func (s *State) GetBucket(volume, name string) (*metapb.Bucket, error) {
	var b *metapb.Bucket
	err := s.view(func(r pebble.Reader) error {
		var err error
		b, err = readBucket(r, volume, name)
		return err
	})
	return b, err
}

func readBucket(r pebble.Reader, volume, name string) (*metapb.Bucket, error) {
	b := &metapb.Bucket{}
	ok, err := get(r, bucketKey(volume, name), b)
	if err != nil {
		return nil, err
	}
	if !ok {
		if ok, _ := get(r, volumeKey(volume), &metapb.Volume{}); !ok {
			return nil, noSuchVolume(volume)
		}
		return nil, noSuchBucket(volume, name)
	}
	return b, nil
}

// scanNames lists rows under base whose name (the key after base) has
// prefix and sorts after startAfter, up to limit; f gets name and value.
func scanNames(r pebble.Reader, base []byte, prefix, startAfter string, limit int, f func(name string, v []byte) error) (truncated bool, err error) {
	lower := cat(base, []byte(prefix))
	if startAfter >= prefix {
		lower = cat(base, []byte(startAfter), []byte{0})
	}
	it, err := r.NewIter(&pebble.IterOptions{LowerBound: lower, UpperBound: store.PrefixEnd(cat(base, []byte(prefix)))})
	if err != nil {
		return false, err
	}
	defer it.Close()
	n := 0
	for it.First(); it.Valid(); it.Next() {
		if n == limit {
			return true, nil
		}
		if err := f(string(it.Key()[len(base):]), it.Value()); err != nil {
			return false, err
		}
		n++
	}
	return false, it.Error()
}

// ListVolumes lists volumes by name.
func (s *State) ListVolumes(req *metapb.ListVolumesRequest) (*metapb.ListVolumesResponse, error) {
	resp := &metapb.ListVolumesResponse{}
	err := s.view(func(r pebble.Reader) error {
		var err error
		resp.Truncated, err = scanNames(r, pfxVolume, req.Prefix, req.StartAfter, pageSize(req.PageSize), func(_ string, v []byte) error {
			vol := &metapb.Volume{}
			resp.Volumes = append(resp.Volumes, vol)
			return proto.Unmarshal(v, vol)
		})
		return err
	})
	return resp, err
}

// ListBuckets lists the buckets of a volume by name.
func (s *State) ListBuckets(req *metapb.ListBucketsRequest) (*metapb.ListBucketsResponse, error) {
	resp := &metapb.ListBucketsResponse{}
	err := s.view(func(r pebble.Reader) error {
		if ok, err := get(r, volumeKey(req.Volume), &metapb.Volume{}); err != nil || !ok {
			if err == nil {
				err = noSuchVolume(req.Volume)
			}
			return err
		}
		if req.Owner != "" {
			return listOwnedBuckets(r, req, resp)
		}
		var err error
		resp.Truncated, err = scanNames(r, bucketKey(req.Volume, ""), req.Prefix, req.StartAfter, pageSize(req.PageSize), func(_ string, v []byte) error {
			b := &metapb.Bucket{}
			resp.Buckets = append(resp.Buckets, b)
			return proto.Unmarshal(v, b)
		})
		return err
	})
	return resp, err
}

// listOwnedBuckets is ListBuckets of one owner's buckets: a page holds up
// to page_size of them, however many others it passes.
func listOwnedBuckets(r pebble.Reader, req *metapb.ListBucketsRequest, resp *metapb.ListBucketsResponse) error {
	base := bucketKey(req.Volume, "")
	lower := cat(base, []byte(req.Prefix))
	if req.StartAfter >= req.Prefix {
		lower = cat(base, []byte(req.StartAfter), []byte{0})
	}
	it, err := r.NewIter(&pebble.IterOptions{LowerBound: lower, UpperBound: store.PrefixEnd(cat(base, []byte(req.Prefix)))})
	if err != nil {
		return err
	}
	defer it.Close()
	limit := pageSize(req.PageSize)
	for it.First(); it.Valid(); it.Next() {
		b := &metapb.Bucket{}
		if err := proto.Unmarshal(it.Value(), b); err != nil {
			return err
		}
		if b.Owner != req.Owner {
			continue
		}
		if len(resp.Buckets) == limit {
			resp.Truncated = true
			return nil
		}
		resp.Buckets = append(resp.Buckets, b)
	}
	return it.Error()
}

// LookupKey returns a committed key (without locations).
func (s *State) LookupKey(volume, bucket, key string) (*metapb.KeyInfo, error) {
	ki, _, err := s.lookupKeySized(volume, bucket, key)
	return ki, err
}

// lookupKeySized is LookupKey that also returns the key's encoded size
// (the stored record's length for an object bucket's key, which is what
// proto.Size would compute, without a pass over the message).
func (s *State) lookupKeySized(volume, bucket, key string) (*metapb.KeyInfo, int, error) {
	var ki *metapb.KeyInfo
	size := -1
	gen := s.buckets.generation()
	err := s.view(func(r pebble.Reader) error {
		b, err := s.buckets.get(r, gen, volume, bucket)
		if err != nil {
			return err
		}
		if b.Layout == metapb.BucketLayout_FS {
			parts, err := SplitPath(key, false)
			if err != nil {
				return err
			}
			_, e, err := resolve(r, b, parts, key)
			if err != nil {
				return err
			}
			if e == nil {
				return noSuchKey(bucket, key)
			}
			if e.IsDir {
				return status.Errorf(codes.FailedPrecondition, "key %q in bucket %q is a directory", key, bucket)
			}
			ki = e.File
			return nil
		}
		if err := ValidateKey(key); err != nil {
			return err
		}
		rec, n, ok, err := s.readKey(r, b, key)
		if err == nil && !ok {
			err = noSuchKey(bucket, key)
		}
		if err != nil {
			return err
		}
		ki, size = rec, n
		return nil
	})
	if err == nil && size < 0 {
		size = proto.Size(ki)
	}
	return ki, size, err
}

// readKey reads an object bucket's key record through the lookup cache
// (lookupcache.go), with the stored record's length. The record is the
// caller's: every call decodes a new one.
func (s *State) readKey(r pebble.Reader, b *metapb.Bucket, key string) (ki *metapb.KeyInfo, n int, ok bool, err error) {
	var buf [128]byte // the probe's key on the stack: a hit allocates nothing here
	probe := append(binary.BigEndian.AppendUint64(append(buf[:0], pfxKey...), b.Id), key...)
	names := recordNames{b.Volume, b.Name, key}
	ki, n, gen := s.lookups.get(probe, names)
	if ki != nil {
		return ki, n, true, nil
	}
	k := objKey(b.Id, key) // not probe: a Get of it would move buf to the heap
	v, closer, err := r.Get(k)
	if errors.Is(err, pebble.ErrNotFound) {
		return nil, 0, false, nil
	}
	if err != nil {
		return nil, 0, false, err
	}
	defer closer.Close()
	if ki, err = decodeRecord(v, names); err != nil {
		return nil, 0, false, err
	}
	s.lookups.put(k, gen, v)
	return ki, len(v), true, nil
}

// SetLookupCacheBytes bounds the lookup cache (0: the default,
// DefaultLookupCacheBytes; negative: no cache). Call it before serving.
func (s *State) SetLookupCacheBytes(n int64) {
	s.lookups.end(s.lookups.beginAll())
	s.lookups.setMax(n)
}

// LookupCacheStats returns the lookup cache's counters.
func (s *State) LookupCacheStats() LookupCacheStats { return s.lookups.stats() }

// ListKeys lists an object bucket's keys S3-style: keys with the prefix,
// rolled up into common prefixes at the first delimiter after the prefix,
// strictly after start_after, page by page. A common prefix costs one seek
// (to the first key past it), never a scan of the keys under it.
func (s *State) ListKeys(req *metapb.ListKeysRequest) (*metapb.ListKeysResponse, error) {
	if len(req.Delimiter) > MaxDelimiterSize {
		return nil, invalid("delimiter %q is %d bytes, at most %d", req.Delimiter, len(req.Delimiter), MaxDelimiterSize)
	}
	if len(req.Prefix) > MaxKeyBytes || len(req.StartAfter) > MaxKeyBytes {
		return nil, invalid("prefix or start_after longer than %d bytes", MaxKeyBytes)
	}
	limit := pageSize(req.PageSize)
	resp := &metapb.ListKeysResponse{}
	err := s.view(func(r pebble.Reader) error {
		b, err := readBucket(r, req.Volume, req.Bucket)
		if err != nil {
			return err
		}
		if b.Layout == metapb.BucketLayout_FS {
			return status.Errorf(codes.FailedPrecondition, "bucket %q in volume %q has layout FS; list it with ListStatus", req.Bucket, req.Volume)
		}
		base := objPrefix(b.Id)
		upper := store.PrefixEnd(cat(base, []byte(req.Prefix)))
		it, err := r.NewIter(&pebble.IterOptions{LowerBound: base, UpperBound: upper})
		if err != nil {
			return err
		}
		defer it.Close()
		start := cat(base, []byte(req.Prefix))
		if req.StartAfter >= req.Prefix {
			start = cat(base, []byte(req.StartAfter), []byte{0})
		}
		n := 0
		for valid := it.SeekGE(start); valid; {
			name := string(it.Key()[len(base):])
			if req.Delimiter != "" {
				if i := strings.Index(name[len(req.Prefix):], req.Delimiter); i >= 0 {
					cp := name[:len(req.Prefix)+i+len(req.Delimiter)]
					if cp > req.StartAfter {
						if n == limit {
							resp.Truncated = true
							break
						}
						resp.CommonPrefixes = append(resp.CommonPrefixes, cp)
						resp.NextStartAfter = cp
						n++
					}
					next := store.PrefixEnd(cat(base, []byte(cp)))
					if next == nil {
						break
					}
					valid = it.SeekGE(next)
					continue
				}
			}
			if n == limit {
				resp.Truncated = true
				break
			}
			ki := &metapb.KeyInfo{}
			if err := proto.Unmarshal(it.Value(), ki); err != nil {
				return err
			}
			ki.Blocks = nil
			resp.Keys = append(resp.Keys, ki)
			resp.NextStartAfter = name
			n++
			valid = it.Next()
		}
		return it.Error()
	})
	if err != nil {
		return nil, err
	}
	if !resp.Truncated {
		resp.NextStartAfter = ""
	}
	return resp, nil
}

// GetFileStatus returns a file or directory of an fs bucket.
func (s *State) GetFileStatus(req *metapb.GetFileStatusRequest) (*metapb.FileStatus, error) {
	var fs *metapb.FileStatus
	err := s.view(func(r pebble.Reader) error {
		b, err := readBucket(r, req.Volume, req.Bucket)
		if err != nil {
			return err
		}
		if b.Layout != metapb.BucketLayout_FS {
			return status.Errorf(codes.FailedPrecondition, "bucket %q in volume %q has layout OBJECT; file status needs an FS bucket", req.Bucket, req.Volume)
		}
		parts, err := SplitPath(req.Path, true)
		if err != nil {
			return err
		}
		if len(parts) == 0 {
			fs = &metapb.FileStatus{Path: "", IsDir: true, DirId: 0, ModifiedUnixMs: b.CreatedUnixMs, Attrs: b.Attrs}
			return nil
		}
		_, e, err := resolve(r, b, parts, req.Path)
		if err != nil {
			return err
		}
		if e == nil {
			return notFound("%q not found in bucket %q", req.Path, req.Bucket)
		}
		fs = entryStatus(req.Path, e)
		return nil
	})
	return fs, err
}

func entryStatus(path string, e *metapb.FsEntry) *metapb.FileStatus {
	fs := &metapb.FileStatus{Path: path, IsDir: e.IsDir, DirId: e.DirId, ModifiedUnixMs: e.ModifiedUnixMs, Attrs: entryAttrs(e)}
	if e.File != nil {
		f := proto.Clone(e.File).(*metapb.KeyInfo)
		f.Blocks = nil
		fs.File = f
	}
	return fs
}

// ListStatus lists a directory of an fs bucket by child name.
func (s *State) ListStatus(req *metapb.ListStatusRequest) (*metapb.ListStatusResponse, error) {
	resp := &metapb.ListStatusResponse{}
	err := s.view(func(r pebble.Reader) error {
		b, err := readBucket(r, req.Volume, req.Bucket)
		if err != nil {
			return err
		}
		if b.Layout != metapb.BucketLayout_FS {
			return status.Errorf(codes.FailedPrecondition, "bucket %q in volume %q has layout OBJECT; ListStatus needs an FS bucket", req.Bucket, req.Volume)
		}
		parts, err := SplitPath(req.Path, true)
		if err != nil {
			return err
		}
		dir := uint64(0)
		if len(parts) > 0 {
			_, e, err := resolve(r, b, parts, req.Path)
			if err != nil {
				return err
			}
			if e == nil {
				return notFound("directory %q not found in bucket %q", req.Path, req.Bucket)
			}
			if !e.IsDir {
				return status.Errorf(codes.FailedPrecondition, "%q in bucket %q is a file, not a directory", req.Path, req.Bucket)
			}
			dir = e.DirId
		}
		resp.Truncated, err = scanNames(r, fsPrefix(b.Id, dir), "", req.StartAfter, pageSize(req.PageSize), func(name string, v []byte) error {
			e := &metapb.FsEntry{}
			if err := proto.Unmarshal(v, e); err != nil {
				return err
			}
			p := name
			if req.Path != "" {
				p = req.Path + "/" + name
			}
			resp.Entries = append(resp.Entries, entryStatus(p, e))
			return nil
		})
		return err
	})
	return resp, err
}

// OpenKey returns an open key's row.
func (s *State) OpenKey(id uint64) (*metapb.OpenKeyRow, error) {
	row := &metapb.OpenKeyRow{}
	err := s.view(func(r pebble.Reader) error {
		ok, err := get(r, u64Key(pfxOpen, id), row)
		if err == nil && !ok {
			err = notFound("open key %d not found (expired or already committed)", id)
		}
		return err
	})
	return row, err
}

// scanRows returns up to limit rows of a table keyed by u64, decoded by f.
func (s *State) scanRows(pfx []byte, limit int, f func(v []byte) (bool, error)) error {
	return s.view(func(r pebble.Reader) error {
		it, err := r.NewIter(&pebble.IterOptions{LowerBound: pfx, UpperBound: store.PrefixEnd(pfx)})
		if err != nil {
			return err
		}
		defer it.Close()
		n := 0
		for it.First(); it.Valid() && n < limit; it.Next() {
			more, err := f(it.Value())
			if err != nil {
				return err
			}
			if !more {
				break
			}
			n++
		}
		return it.Error()
	})
}

// ExpiredOpenKeys returns up to limit open keys created before olderThan.
// Open IDs grow with time, so the scan stops at the first young one.
func (s *State) ExpiredOpenKeys(olderThanUnixMs int64, limit int) ([]uint64, error) {
	var ids []uint64
	err := s.scanRows(pfxOpen, limit, func(v []byte) (bool, error) {
		row := &metapb.OpenKeyRow{}
		if err := proto.Unmarshal(v, row); err != nil {
			return false, err
		}
		if row.CreatedUnixMs >= olderThanUnixMs {
			return false, nil
		}
		ids = append(ids, row.OpenId)
		return true, nil
	})
	return ids, err
}

// DeletedRows returns up to limit rows of blocks waiting for SCM.
func (s *State) DeletedRows(limit int) ([]*metapb.DeletedRow, error) {
	var rows []*metapb.DeletedRow
	err := s.scanRows(pfxDeleted, limit, func(v []byte) (bool, error) {
		row := &metapb.DeletedRow{}
		rows = append(rows, row)
		return true, proto.Unmarshal(v, row)
	})
	return rows, err
}

// PendingDirs returns up to limit deleted directories not yet reclaimed.
func (s *State) PendingDirs(limit int) ([]*metapb.PendingDirRow, error) {
	var rows []*metapb.PendingDirRow
	err := s.scanRows(pfxPending, limit, func(v []byte) (bool, error) {
		row := &metapb.PendingDirRow{}
		rows = append(rows, row)
		return true, proto.Unmarshal(v, row)
	})
	return rows, err
}
