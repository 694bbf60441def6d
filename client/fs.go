package client

import (
	"context"
	"fmt"
	"time"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// File-system calls on fs buckets (layout FS): directories are rows keyed
// by their parent, so creating, renaming and deleting one is a single
// metadata operation whatever it holds. Files are keys, written with PutKey
// and read with GetKey; RenameKey and DeleteKey work on both.

// FileStatus is a file or directory of an fs bucket.
type FileStatus struct {
	// Path is the path in the bucket ("" for the bucket's root).
	Path     string    `json:"path"`
	IsDir    bool      `json:"is_dir"`
	DirID    uint64    `json:"dir_id,omitempty"`
	Modified time.Time `json:"modified"`
	// File is set for files (without block replicas).
	File *KeyInfo `json:"file,omitempty"`
	// Attrs are a directory's Hadoop-style attributes (a file's are in
	// File.Attrs; nil: none recorded).
	Attrs *metapb.FileAttrs `json:"attrs,omitempty"`
}

func fileStatusOf(s *metapb.FileStatus) FileStatus {
	fs := FileStatus{Path: s.Path, IsDir: s.IsDir, DirID: s.DirId, Modified: unixMs(s.ModifiedUnixMs), Attrs: s.Attrs}
	if s.File != nil {
		ki := keyInfoOf(s.File)
		fs.File = &ki
	}
	return fs
}

// CreateDirectory makes path a directory of an fs bucket, with any missing
// parents (mkdir -p). An existing directory is not an error; a file on the
// way is (ErrPrecondition).
func (c *Client) CreateDirectory(ctx context.Context, volume, bucket, path string) (FileStatus, error) {
	s, err := c.ns.CreateDirectory(ctx, &metapb.CreateDirectoryRequest{Volume: volume, Bucket: bucket, Path: path})
	if err != nil {
		return FileStatus{}, wrapErr(fmt.Sprintf("create directory %s", keyPath(volume, bucket, path)), err)
	}
	return fileStatusOf(s), nil
}

// GetFileStatus returns a file or directory of an fs bucket ("" is the
// bucket's root). A missing entry is ErrNotFound; a file where a parent
// directory should be is ErrPrecondition.
func (c *Client) GetFileStatus(ctx context.Context, volume, bucket, path string) (FileStatus, error) {
	s, err := c.ns.GetFileStatus(ctx, &metapb.GetFileStatusRequest{Volume: volume, Bucket: bucket, Path: path})
	if err != nil {
		return FileStatus{}, wrapErr(fmt.Sprintf("file status of %s", keyPath(volume, bucket, path)), err)
	}
	return fileStatusOf(s), nil
}

// StatusPage is one page of a directory listing.
type StatusPage struct {
	Entries   []FileStatus `json:"entries"`
	Truncated bool         `json:"truncated"`
}

// ListStatus returns one page of a directory's children by name, strictly
// after startAfter (a child name; "" from the start). pageSize 0 is the
// server's default (1000).
func (c *Client) ListStatus(ctx context.Context, volume, bucket, path, startAfter string, n int) (StatusPage, error) {
	r, err := c.ns.ListStatus(ctx, &metapb.ListStatusRequest{Volume: volume, Bucket: bucket, Path: path,
		StartAfter: startAfter, PageSize: pageSize(n)})
	if err != nil {
		return StatusPage{}, wrapErr(fmt.Sprintf("list directory %s", keyPath(volume, bucket, path)), err)
	}
	p := StatusPage{Truncated: r.Truncated}
	for _, e := range r.Entries {
		p.Entries = append(p.Entries, fileStatusOf(e))
	}
	return p, nil
}

// BlockChecksums is what a block's replica stores as its checksums: one
// CRC32C (4 bytes, big-endian) per BytesPerChecksum window of the block's
// data, in order.
type BlockChecksums struct {
	Length           uint64
	BytesPerChecksum uint32
	Sums             []byte
}

// KeyChecksums returns the stored checksums of each block of a key, read
// from the nearest replica that answers (one GetBlock call per block, no
// data moved). The key must have been written with CRC32C checksums.
func (c *Client) KeyChecksums(ctx context.Context, volume, bucket, key string) (KeyInfo, []BlockChecksums, error) {
	op := "checksums of key " + keyPath(volume, bucket, key)
	k, err := c.lookup(ctx, volume, bucket, key)
	if err != nil {
		return KeyInfo{}, nil, err
	}
	if k.ChecksumType != metapb.ChecksumType_CRC32C {
		return KeyInfo{}, nil, &Error{Op: op, Msg: fmt.Sprintf("key has checksum type %v, not CRC32C", k.ChecksumType), kind: ErrPrecondition}
	}
	out := make([]BlockChecksums, 0, len(k.Locations))
	for _, l := range k.Locations {
		var last error
		var got *BlockChecksums
		for _, d := range l.Datanodes {
			bc, err := c.blockChecksums(ctx, d.DataAddr, l)
			if err == nil {
				got = bc
				break
			}
			last = err
		}
		if got == nil {
			if last == nil {
				last = fmt.Errorf("no replicas")
			}
			return KeyInfo{}, nil, &Error{Op: op, Msg: fmt.Sprintf("block %d/%d: %v", l.GetId().GetContainerId(), l.GetId().GetLocalId(), last), kind: ErrUnavailable}
		}
		out = append(out, *got)
	}
	return keyInfoOf(k), out, nil
}

// blockChecksums reads one replica's checksums of the key's part of a
// block (a key may hold a prefix of a stored block).
func (c *Client) blockChecksums(ctx context.Context, addr string, l *metapb.BlockLocation) (*BlockChecksums, error) {
	dn, err := c.dns.get(addr)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, c.cfg.RPCTimeout)
	defer cancel()
	bd, err := dn.GetBlock(blocktoken.WithToken(ctx, l.Token), &datanodepb.GetBlockRequest{Block: dnBlockID(l.Id)})
	if err != nil {
		return nil, err
	}
	bc := &BlockChecksums{Length: l.Length}
	var next uint64 // block offset the next window starts at
	for _, ch := range bd.Chunks {
		cs := ch.GetChecksum()
		if cs.GetType() != datanodepb.ChecksumType_CHECKSUM_CRC32C {
			return nil, fmt.Errorf("chunk at %d has checksum type %v", ch.Offset, cs.GetType())
		}
		bpc := uint64(cs.BytesPerChecksum)
		if bc.BytesPerChecksum == 0 {
			bc.BytesPerChecksum = cs.BytesPerChecksum
		}
		if cs.BytesPerChecksum != bc.BytesPerChecksum || bpc == 0 {
			return nil, fmt.Errorf("chunk at %d has %d bytes per checksum, want %d", ch.Offset, bpc, bc.BytesPerChecksum)
		}
		if ch.Offset != next {
			return nil, fmt.Errorf("chunk at %d does not continue the windows at %d", ch.Offset, next)
		}
		for i := uint64(0); i*bpc < ch.Length; i++ {
			start := ch.Offset + i*bpc
			if start >= l.Length {
				break
			}
			end := min(start+bpc, ch.Offset+ch.Length)
			if end > l.Length {
				return nil, fmt.Errorf("the key ends at %d inside a stored checksum window [%d, %d)", l.Length, start, end)
			}
			if 4*(i+1) > uint64(len(cs.Sums)) {
				return nil, fmt.Errorf("chunk at %d has %d checksum bytes, too few for %d bytes", ch.Offset, len(cs.Sums), ch.Length)
			}
			bc.Sums = append(bc.Sums, cs.Sums[4*i:4*i+4]...)
		}
		next = ch.Offset + ch.Length
	}
	if next < l.Length {
		return nil, fmt.Errorf("replica holds %d bytes, the key %d", next, l.Length)
	}
	return bc, nil
}
