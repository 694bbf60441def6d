package datanode

import (
	"errors"
	"fmt"
	"math"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/storage"
)

// Requests are validated before they are proposed: an entry in a pipeline's
// log is replayed on every replica and resent to every follower, so one
// that storage refuses (a chunk over the limit, checksums that do not fit
// the data) must never get there. The rules are storage's
// (Store.ValidateChunk, ValidateBlock), checked here so the client learns
// of its mistake as BAD_REQUEST naming the input, and so nothing with bad
// checksum metadata reaches code that indexes the sums.

// checkChunk validates a chunk of block b that comes with n bytes of data.
func checkChunk(st *storage.Store, b *datanodepb.BlockID, c *datanodepb.ChunkInfo, n int) error {
	switch {
	case b == nil:
		return errors.New("block id missing")
	case c == nil:
		return errors.New("chunk info missing")
	case n == 0 || c.GetLength() != uint64(n):
		return fmt.Errorf("chunk length %d with %d bytes of data: a nonzero length equal to the data's is required", c.GetLength(), n)
	case c.GetOffset() > math.MaxInt64:
		return fmt.Errorf("chunk offset %d out of range", c.GetOffset())
	}
	return st.ValidateChunk(storage.ContainerID(b.GetContainerId()), storage.LocalID(b.GetLocalId()),
		int64(c.GetOffset()), int64(n), toChecksum(c.GetChecksum()))
}

// checkBlock validates a PutBlock's (or PutSmallFile's) block description.
func checkBlock(st *storage.Store, b *datanodepb.BlockData) error {
	if b.GetId() == nil {
		return errors.New("block id missing")
	}
	if b.GetLength() > math.MaxInt64 {
		return fmt.Errorf("block length %d out of range", b.GetLength())
	}
	for _, c := range b.GetChunks() {
		if c.GetOffset() > math.MaxInt64 || c.GetLength() > math.MaxInt64 {
			return fmt.Errorf("chunk [%d, +%d) out of range", c.GetOffset(), c.GetLength())
		}
	}
	return st.ValidateBlock(storage.ContainerID(b.GetId().GetContainerId()), toBlockData(b))
}
