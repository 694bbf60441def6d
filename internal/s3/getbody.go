package s3

import (
	"fmt"
	"io"

	"github.com/basalt-store/basalt/client"
)

// writeObjectBody sends length bytes of the object from start: pieces of
// the key are read in parallel ahead of the connection (KeyReader.
// WriteRange) and each is written to w in one call, straight from the
// reader's buffer. io.CopyN through KeyReader.Read read one 4 MiB chunk at
// a time, one round trip after another, and copied it in 32 KiB steps.
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
