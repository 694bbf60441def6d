package s3

import (
	"fmt"
	"io"

	"github.com/basalt-store/basalt/client"
)

// writeObjectBody sends length bytes of the object from start: pieces of
// the key are read in parallel ahead of the connection (KeyReader.
// WriteRange) and each is written to w in one call, straight from the
// reader's buffer or, for a block on this host, from the mapping of its
// block file, each 256 KiB step written right after its checksums are
// verified there (one copy: the kernel's into the socket, from bytes the
// checksum just brought into the cache).
//
// sendfile from the block file instead (w as a client.FileSender over
// net/http's ReadFrom) was measured and not taken: on loopback it cost
// more server CPU per GiB than the write from the mapping (0.69–0.90 vs
// 0.60–0.71 CPU-s/GiB in six alternating runs, docs/BENCHMARKS.md), the
// checksum pass over the mapping being needed either way.
func writeObjectBody(w io.Writer, kr *client.KeyReader, start, length int64) error {
	n, err := kr.WriteRange(w, start, length)
	if err != nil {
		return err
	}
	if n != length {
		return fmt.Errorf("sent %d of %d bytes", n, length)
	}
	return nil
}
