package storage

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"hash/crc32"

	"github.com/basalt-store/basalt/internal/crc32c"
)

// ChecksumType names the checksum algorithm of a chunk.
type ChecksumType uint8

const (
	ChecksumNone   ChecksumType = 0
	ChecksumCRC32C ChecksumType = 1 // hardware CRC32C (SSE4.2 / ARMv8 CRC)
	ChecksumSHA256 ChecksumType = 2
)

const (
	// DefaultBytesPerChecksum is the window one checksum covers. 64 KiB keeps
	// the metadata of a 256 MiB block at 16 KiB while a random read verifies
	// at most 128 KiB more than it returns.
	DefaultBytesPerChecksum = 64 << 10
	// MaxBytesPerChecksum bounds the read amplification of verification.
	MaxBytesPerChecksum = 16 << 20
	minBytesPerChecksum = 512
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

func (t ChecksumType) String() string {
	switch t {
	case ChecksumNone:
		return "NONE"
	case ChecksumCRC32C:
		return "CRC32C"
	case ChecksumSHA256:
		return "SHA256"
	}
	return fmt.Sprintf("ChecksumType(%d)", uint8(t))
}

// Size is the length in bytes of one checksum of this type.
func (t ChecksumType) Size() int {
	switch t {
	case ChecksumCRC32C:
		return 4
	case ChecksumSHA256:
		return sha256.Size
	}
	return 0
}

// Checksum is the helper clients use to compute the checksums this layer
// stores and verifies: the same type and window on both sides give the same
// bytes. The zero value means NONE.
type Checksum struct {
	Type             ChecksumType
	BytesPerChecksum int // 0 means DefaultBytesPerChecksum
}

// DefaultChecksum is CRC32C over every 64 KiB.
var DefaultChecksum = Checksum{Type: ChecksumCRC32C, BytesPerChecksum: DefaultBytesPerChecksum}

func (c Checksum) bpc() int {
	if c.BytesPerChecksum <= 0 {
		return DefaultBytesPerChecksum
	}
	return c.BytesPerChecksum
}

// Compute returns the checksums of data, one per window of BytesPerChecksum
// (the last window may be short). data is a whole chunk: windows start at
// its first byte.
func (c Checksum) Compute(data []byte) ChecksumData {
	d := ChecksumData{Type: c.Type, BytesPerChecksum: uint32(c.bpc())}
	if c.Type == ChecksumNone {
		return d
	}
	bpc := c.bpc()
	n := (len(data) + bpc - 1) / bpc
	d.Sums = make([]byte, 0, n*c.Type.Size())
	for off := 0; off < len(data); off += bpc {
		d.Sums = appendSum(d.Sums, c.Type, data[off:min(off+bpc, len(data))])
	}
	return d
}

func appendSum(dst []byte, t ChecksumType, p []byte) []byte {
	switch t {
	case ChecksumCRC32C:
		return binary.BigEndian.AppendUint32(dst, crc32c.Checksum(p))
	case ChecksumSHA256:
		s := sha256.Sum256(p)
		return append(dst, s[:]...)
	}
	return dst
}

// ChecksumData is the stored checksum of one chunk: the concatenated sums of
// its windows, in order.
type ChecksumData struct {
	Type             ChecksumType
	BytesPerChecksum uint32
	Sums             []byte
}

// validate checks that d can describe a chunk of length n.
func (d ChecksumData) validate(n int64) error {
	switch d.Type {
	case ChecksumNone:
		if len(d.Sums) != 0 {
			return fmt.Errorf("type NONE with %d bytes of sums", len(d.Sums))
		}
		return nil
	case ChecksumCRC32C, ChecksumSHA256:
	default:
		return fmt.Errorf("unknown checksum type %d", d.Type)
	}
	bpc := int64(d.BytesPerChecksum)
	if bpc < minBytesPerChecksum || bpc > MaxBytesPerChecksum {
		return fmt.Errorf("bytes per checksum %d outside [%d, %d]", bpc, minBytesPerChecksum, MaxBytesPerChecksum)
	}
	want := (n + bpc - 1) / bpc * int64(d.Type.Size())
	if int64(len(d.Sums)) != want {
		return fmt.Errorf("%d bytes of %s sums for %d bytes of data at %d per checksum; want %d",
			len(d.Sums), d.Type, n, bpc, want)
	}
	return nil
}

// Verify checks data (a whole chunk) against d. It returns -1 if all windows
// match, or the offset within data of the first window that does not. It
// never panics: malformed checksum data (a zero window, too few sums)
// fails at the first window it cannot check; ValidateChunk says why.
func (d ChecksumData) Verify(data []byte) int64 {
	return d.verifyRange(data, 0)
}

// verifyRange checks data, which starts at window index firstWin of the
// chunk and ends at a window boundary or the chunk end. Returns the offset
// within data of the first bad window, or -1.
func (d ChecksumData) verifyRange(data []byte, firstWin int) int64 {
	if d.Type == ChecksumNone {
		return -1
	}
	bpc := int(d.BytesPerChecksum)
	sz := d.Type.Size()
	if bpc <= 0 || sz == 0 || firstWin < 0 {
		return 0
	}
	var tmp [sha256.Size]byte
	for i, off := firstWin, 0; off < len(data); i, off = i+1, off+bpc {
		p := data[off:min(off+bpc, len(data))]
		if (i+1)*sz > len(d.Sums) {
			return int64(off)
		}
		want := d.Sums[i*sz : (i+1)*sz]
		switch d.Type {
		case ChecksumCRC32C:
			if binary.BigEndian.Uint32(want) != crc32c.Checksum(p) {
				return int64(off)
			}
		case ChecksumSHA256:
			tmp = sha256.Sum256(p)
			if string(tmp[:]) != string(want) {
				return int64(off)
			}
		}
	}
	return -1
}

func (d ChecksumData) equal(o ChecksumData) bool {
	return d.Type == o.Type && d.BytesPerChecksum == o.BytesPerChecksum && string(d.Sums) == string(o.Sums)
}
