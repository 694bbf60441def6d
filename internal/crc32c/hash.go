package crc32c

import "hash"

// Size is the size of a CRC32C checksum in bytes.
const Size = 4

type digest uint32

// New returns a hash.Hash32 computing the CRC32C with Update (the same
// sums as hash/crc32.New(crc32.MakeTable(crc32.Castagnoli))).
func New() hash.Hash32 { d := digest(0); return &d }

func (d *digest) Size() int      { return Size }
func (d *digest) BlockSize() int { return 1 }
func (d *digest) Reset()         { *d = 0 }
func (d *digest) Sum32() uint32  { return uint32(*d) }

func (d *digest) Write(p []byte) (int, error) {
	*d = digest(update(uint32(*d), p))
	return len(p), nil
}

func (d *digest) Sum(in []byte) []byte {
	s := uint32(*d)
	return append(in, byte(s>>24), byte(s>>16), byte(s>>8), byte(s))
}
