package s3

import (
	"fmt"
	"io"
	"os"

	"github.com/basalt-store/basalt/client"
)

// writeObjectBody sends length bytes of the object from start: pieces of
// the key are read in parallel ahead of the connection (KeyReader.
// WriteRange) and each is written to w in one call, straight from the
// reader's buffer or from the mapping of a local block file. On a plain
// HTTP connection (plain) a piece of a local block file, its checksums
// verified by the reader, goes to the socket with sendfile: the gateway
// copies none of its bytes (fileSender).
func writeObjectBody(w *idleWriter, plain bool, kr *client.KeyReader, start, length int64) error {
	var dst io.Writer = w
	if rf, ok := w.w.(io.ReaderFrom); ok && plain {
		dst = fileSender{w, rf}
	}
	n, err := kr.WriteRange(dst, start, length)
	if err != nil {
		return err
	}
	if n != length {
		return fmt.Errorf("sent %d of %d bytes", n, length)
	}
	return nil
}

// fileSender is a client.FileSender over the response: net/http's
// response.ReadFrom sends an *io.LimitedReader of an *os.File with
// sendfile(2) once the header is out and the body is not chunked
// (Content-Length is set for every GET body).
type fileSender struct {
	*idleWriter
	rf io.ReaderFrom
}

func (s fileSender) SendFile(f *os.File, n int64) (int64, error) {
	if _, err := s.idleWriter.Write(nil); err != nil { // moves the idle deadline
		return 0, err
	}
	return s.rf.ReadFrom(&io.LimitedReader{R: f, N: n})
}
