package client

import (
	"context"
	"fmt"
	"iter"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// KeyInfo describes a committed key.
type KeyInfo struct {
	Volume           string      `json:"volume"`
	Bucket           string      `json:"bucket"`
	Name             string      `json:"name"`
	Size             uint64      `json:"size"`
	Replication      Replication `json:"-"`
	ReplicationName  string      `json:"replication"`
	ChecksumType     string      `json:"checksum_type"`
	BytesPerChecksum uint32      `json:"bytes_per_checksum"`
	Created          time.Time   `json:"created"`
	Modified         time.Time   `json:"modified"`
	ObjectID         uint64      `json:"object_id"`
	// Meta holds the S3 attributes stored with the key (nil for keys
	// written without them).
	Meta *metapb.ObjectMeta `json:"meta,omitempty"`
	// Attrs are a file's Hadoop-style attributes set by SetFileAttrs (fs
	// buckets; nil: none recorded).
	Attrs *metapb.FileAttrs `json:"attrs,omitempty"`
	// Pipeline is the write path PutKey used ("v1" or "v2"); only PutKey
	// fills it.
	Pipeline string `json:"pipeline,omitempty"`
	// Blocks is filled by StatKey, GetKey and PutKey; listings leave it
	// empty.
	Blocks []BlockInfo `json:"blocks,omitempty"`
}

// BlockInfo is one block of a key.
type BlockInfo struct {
	ContainerID uint64 `json:"container_id"`
	LocalID     uint64 `json:"local_id"`
	Offset      uint64 `json:"offset"` // in the key
	Length      uint64 `json:"length"`
	PipelineID  uint64 `json:"pipeline_id,omitempty"`
	// ContainerState is "OPEN", "CLOSING", "CLOSED" or "" if unknown.
	ContainerState string `json:"container_state,omitempty"`
	// Replicas, nearest to Config.Location first.
	Replicas []Replica `json:"replicas,omitempty"`
	// Token is the block's read token (package blocktoken), for tools
	// that read replicas directly (blocktoken.WithToken); a credential,
	// so never printed.
	Token []byte `json:"-"`
}

// Replica is a datanode holding a block.
type Replica struct {
	ID       uint64 `json:"id"`
	UUID     string `json:"uuid,omitempty"`
	Hostname string `json:"hostname,omitempty"`
	Addr     string `json:"addr"`
	Location string `json:"location"`
}

func checksumName(t metapb.ChecksumType) string {
	switch t {
	case metapb.ChecksumType_CRC32C:
		return "CRC32C"
	case metapb.ChecksumType_CHECKSUM_NONE:
		return "NONE"
	}
	return ""
}

func containerStateName(s metapb.ContainerState) string {
	switch s {
	case metapb.ContainerState_CONTAINER_OPEN:
		return "OPEN"
	case metapb.ContainerState_CONTAINER_CLOSING:
		return "CLOSING"
	case metapb.ContainerState_CONTAINER_CLOSED:
		return "CLOSED"
	}
	return ""
}

func replicaOf(d *metapb.DatanodeDetails) Replica {
	return Replica{ID: d.Id, UUID: d.Uuid, Hostname: d.Hostname, Addr: d.DataAddr, Location: d.Location}
}

// keyInfoOf converts; locations (from LookupKey) win over the stored block
// list when present.
func keyInfoOf(k *metapb.KeyInfo) KeyInfo {
	r := replicationOf(k.Replication)
	ki := KeyInfo{
		Volume: k.Volume, Bucket: k.Bucket, Name: k.Name, Size: k.Size,
		Replication: r, ReplicationName: r.String(),
		ChecksumType: checksumName(k.ChecksumType), BytesPerChecksum: k.BytesPerChecksum,
		Created: unixMs(k.CreatedUnixMs), Modified: unixMs(k.ModifiedUnixMs), ObjectID: k.ObjectId, Meta: k.Meta, Attrs: k.Attrs,
	}
	if len(k.Locations) > 0 {
		for _, l := range k.Locations {
			b := BlockInfo{ContainerID: l.GetId().GetContainerId(), LocalID: l.GetId().GetLocalId(), Offset: l.Offset, Length: l.Length,
				PipelineID: l.PipelineId, ContainerState: containerStateName(l.ContainerState), Token: l.Token}
			for _, d := range l.Datanodes {
				b.Replicas = append(b.Replicas, replicaOf(d))
			}
			ki.Blocks = append(ki.Blocks, b)
		}
		return ki
	}
	var off uint64
	for _, kb := range k.Blocks {
		ki.Blocks = append(ki.Blocks, BlockInfo{ContainerID: kb.GetId().GetContainerId(), LocalID: kb.GetId().GetLocalId(), Offset: off, Length: kb.Length})
		off += kb.Length
	}
	return ki
}

func keyPath(volume, bucket, key string) string { return "/" + volume + "/" + bucket + "/" + key }

// lookup is the one metadata call of a read. Concurrent lookups share
// LookupKeys calls (metaclient.Client.Lookup).
func (c *Client) lookup(ctx context.Context, volume, bucket, key string) (*metapb.KeyInfo, error) {
	k, err := c.meta.Lookup(ctx, &metapb.LookupKeyRequest{Volume: volume, Bucket: bucket, Key: key, ClientLocation: c.cfg.Location})
	if err != nil {
		return nil, wrapErr(fmt.Sprintf("lookup key %s", keyPath(volume, bucket, key)), err)
	}
	return k, nil
}

// StatKey returns a key's metadata with its blocks and their replicas,
// nearest first.
func (c *Client) StatKey(ctx context.Context, volume, bucket, key string) (KeyInfo, error) {
	k, err := c.lookup(ctx, volume, bucket, key)
	if err != nil {
		return KeyInfo{}, err
	}
	return keyInfoOf(k), nil
}

// HeadKey returns a key's metadata without its blocks' replicas: what an
// S3 HEAD needs, and cheaper than StatKey (no replica lookup or sorting,
// a smaller response). Like every read it is linearizable. Concurrent
// calls share LookupKeys calls (metaclient.Client.Lookup).
func (c *Client) HeadKey(ctx context.Context, volume, bucket, key string) (KeyInfo, error) {
	k, err := c.meta.Lookup(ctx, &metapb.LookupKeyRequest{Volume: volume, Bucket: bucket, Key: key, NoLocations: true})
	if err != nil {
		return KeyInfo{}, wrapErr(fmt.Sprintf("head key %s", keyPath(volume, bucket, key)), err)
	}
	return keyInfoOf(k), nil
}

// DeleteKey deletes a key. For fs buckets, recursive deletes a non-empty
// directory with everything under it.
func (c *Client) DeleteKey(ctx context.Context, volume, bucket, key string, recursive bool) error {
	_, err := c.ns.DeleteKey(ctx, &metapb.DeleteKeyRequest{Volume: volume, Bucket: bucket, Key: key, Recursive: recursive})
	return wrapErr(fmt.Sprintf("delete key %s", keyPath(volume, bucket, key)), err)
}

// RenameKey renames a key within its bucket; it fails with ErrExists if
// newKey exists.
func (c *Client) RenameKey(ctx context.Context, volume, bucket, key, newKey string) error {
	_, err := c.ns.RenameKey(ctx, &metapb.RenameKeyRequest{Volume: volume, Bucket: bucket, Key: key, NewKey: newKey})
	return wrapErr(fmt.Sprintf("rename key %s to %q", keyPath(volume, bucket, key), newKey), err)
}

// CopyOptions tunes CopyKey.
type CopyOptions struct {
	// ExpectObjectID, if not 0, makes the copy fail with ErrPrecondition
	// when the source is no longer that version (KeyInfo.ObjectID).
	ExpectObjectID uint64
	// ReplaceMeta gives the copy Meta instead of the source's S3
	// attributes; the ETag, flexible checksums and parts count stay the
	// source's, as they describe the bytes.
	ReplaceMeta bool
	Meta        *metapb.ObjectMeta
}

// CopyKey copies srcKey of srcBucket to key of bucket, both in volume, by
// sharing the source's blocks: no data moves, whatever the size, and the
// source and the copy can then be overwritten or deleted independently.
// The copy may be the source itself (to replace its attributes). It fails
// with ErrPrecondition when the blocks cannot be shared (the destination
// bucket's replication differs from the source's); copy the data with
// GetKey and PutKey then.
func (c *Client) CopyKey(ctx context.Context, volume, srcBucket, srcKey, bucket, key string, o CopyOptions) (KeyInfo, error) {
	k, err := c.ns.CopyKey(ctx, &metapb.CopyKeyRequest{Volume: volume, SrcBucket: srcBucket, SrcKey: srcKey, ExpectObjectId: o.ExpectObjectID,
		Bucket: bucket, Key: key, ReplaceMeta: o.ReplaceMeta, Meta: o.Meta})
	if err != nil {
		return KeyInfo{}, wrapErr(fmt.Sprintf("copy key %s to %s", keyPath(volume, srcBucket, srcKey), keyPath(volume, bucket, key)), err)
	}
	return keyInfoOf(k), nil
}

// ListKeysOptions selects keys of an object bucket.
type ListKeysOptions struct {
	Prefix string
	// StartAfter: only entries strictly after it (a key or a common
	// prefix); pass KeyPage.NextStartAfter to continue.
	StartAfter string
	// Delimiter groups keys sharing the part of their name up to it (after
	// Prefix) into CommonPrefixes, like S3.
	Delimiter string
	// PageSize is the entries per call (0 = the server's default, 1000).
	PageSize int
}

// KeyPage is one page of a listing.
type KeyPage struct {
	Keys           []KeyInfo `json:"keys"`
	CommonPrefixes []string  `json:"common_prefixes,omitempty"`
	Truncated      bool      `json:"truncated"`
	NextStartAfter string    `json:"next_start_after,omitempty"`
}

// ListKeys returns one page of keys.
func (c *Client) ListKeys(ctx context.Context, volume, bucket string, o ListKeysOptions) (KeyPage, error) {
	r, err := c.ns.ListKeys(ctx, &metapb.ListKeysRequest{Volume: volume, Bucket: bucket, Prefix: o.Prefix,
		StartAfter: o.StartAfter, Delimiter: o.Delimiter, PageSize: pageSize(o.PageSize)})
	if err != nil {
		return KeyPage{}, wrapErr(fmt.Sprintf("list keys of /%s/%s (prefix %q)", volume, bucket, o.Prefix), err)
	}
	p := KeyPage{CommonPrefixes: r.CommonPrefixes, Truncated: r.Truncated, NextStartAfter: r.NextStartAfter}
	for _, k := range r.Keys {
		p.Keys = append(p.Keys, keyInfoOf(k))
	}
	return p, nil
}

// ListEntry is a key or, with a delimiter, a common prefix.
type ListEntry struct {
	Key    *KeyInfo // nil for a prefix
	Prefix string   // set for a common prefix
}

// Keys iterates over all keys (and common prefixes) matching o, in order,
// fetching pages as needed. A failure is yielded once, as the last item.
func (c *Client) Keys(ctx context.Context, volume, bucket string, o ListKeysOptions) iter.Seq2[ListEntry, error] {
	return func(yield func(ListEntry, error) bool) {
		for {
			p, err := c.ListKeys(ctx, volume, bucket, o)
			if err != nil {
				yield(ListEntry{}, err)
				return
			}
			// Keys and prefixes are each sorted; merge them so the caller
			// sees one ordered stream as S3 does.
			i, j := 0, 0
			for i < len(p.Keys) || j < len(p.CommonPrefixes) {
				var e ListEntry
				if j >= len(p.CommonPrefixes) || (i < len(p.Keys) && p.Keys[i].Name < p.CommonPrefixes[j]) {
					e.Key = &p.Keys[i]
					i++
				} else {
					e.Prefix = p.CommonPrefixes[j]
					j++
				}
				if !yield(e, nil) {
					return
				}
			}
			if !p.Truncated || p.NextStartAfter == "" || p.NextStartAfter == o.StartAfter {
				return
			}
			o.StartAfter = p.NextStartAfter
		}
	}
}
