package client

import (
	"context"
	"math/bits"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// DefaultReserveBlocks is the default of Config.ReserveBlocks.
const DefaultReserveBlocks = 64

// takeReserved gives a small key of n bytes a block reserved ahead of
// need (issue 15, metaclient/reserve.go) as its open key: the key is then
// committed with one CommitKey naming it, and no OpenKey is made. nil
// (no error): open the key the usual way. Pools are per size class (a
// power of two from 4 KiB), so that SCM charges each block about what
// an open key's size hint would.
func (c *Client) takeReserved(ctx context.Context, volume, bucket string, repl Replication, n int) (*metapb.OpenKeyResponse, error) {
	class := uint64(4096)
	if n > 4096 {
		class = 1 << bits.Len64(uint64(n-1))
	}
	ex := c.excl.snapshot()
	r, err := c.meta.TakeReserved(ctx, &metapb.ReserveBlocksRequest{
		Volume: volume, Bucket: bucket, Count: uint32(c.cfg.ReserveBlocks), Replication: repl.pb(),
		ChecksumType: metapb.ChecksumType_CRC32C, BytesPerChecksum: uint32(c.cfg.BytesPerChecksum),
		ClientLocation: c.cfg.Location, Exclude: ex.proto(), ExpectedBytes: class,
	})
	if r == nil || err != nil {
		return nil, err
	}
	return &metapb.OpenKeyResponse{OpenId: r.OpenID, Blocks: []*metapb.BlockLocation{r.Block}, BlockSize: r.BlockSize}, nil
}
