package datanode

import (
	"bytes"
	"io"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/storage"
)

func toChecksum(c *datanodepb.ChecksumData) storage.ChecksumData {
	if c == nil {
		return storage.ChecksumData{}
	}
	return storage.ChecksumData{
		Type:             storage.ChecksumType(c.GetType()),
		BytesPerChecksum: c.GetBytesPerChecksum(),
		Sums:             c.GetSums(),
	}
}

func fromChecksum(c storage.ChecksumData) *datanodepb.ChecksumData {
	return &datanodepb.ChecksumData{
		Type:             datanodepb.ChecksumType(c.Type),
		BytesPerChecksum: c.BytesPerChecksum,
		Sums:             c.Sums,
	}
}

func toBlockData(b *datanodepb.BlockData) storage.BlockData {
	bd := storage.BlockData{
		LocalID: storage.LocalID(b.GetId().GetLocalId()),
		Length:  int64(b.GetLength()),
		BCSID:   b.GetBcsid(),
		Chunks:  make([]storage.ChunkInfo, len(b.GetChunks())),
	}
	for i, c := range b.GetChunks() {
		bd.Chunks[i] = storage.ChunkInfo{Offset: int64(c.GetOffset()), Length: int64(c.GetLength()), Checksum: toChecksum(c.GetChecksum())}
	}
	return bd
}

func fromBlockData(cid storage.ContainerID, bd storage.BlockData) *datanodepb.BlockData {
	out := &datanodepb.BlockData{
		Id:     &datanodepb.BlockID{ContainerId: uint64(cid), LocalId: uint64(bd.LocalID)},
		Length: uint64(bd.Length),
		Bcsid:  bd.BCSID,
		Chunks: make([]*datanodepb.ChunkInfo, len(bd.Chunks)),
	}
	for i, c := range bd.Chunks {
		out.Chunks[i] = &datanodepb.ChunkInfo{Offset: uint64(c.Offset), Length: uint64(c.Length), Checksum: fromChecksum(c.Checksum)}
	}
	return out
}

func bytesReader(b []byte) io.Reader { return bytes.NewReader(b) }
