package s3

import (
	"errors"
	"io"
	"net/http"
	"os"
	"time"
)

// Slow clients: a body that stops arriving, or a response nobody reads,
// must not hold a connection, an upload slot and the client's write
// buffer forever. Each read of a body (each write of a response) pushes
// the connection's deadline idle further away; when a deadline passes the
// read fails with RequestTimeout (the write with an error that ends the
// handler). Deadlines are moved at most every idle/8, so the limit is
// between 7/8 of idle and idle.

var errRequestTimeout = errorf("RequestTimeout", 400, "Your socket connection to the server was not read from or written to within the timeout period.")

// idleBody is a request body with an idle timeout.
type idleBody struct {
	r     io.ReadCloser
	rc    *http.ResponseController
	idle  time.Duration
	moved time.Time // when the deadline was last moved; zero: not yet
	off   bool      // the connection has no deadlines (not a net.Conn)
}

func newIdleBody(w http.ResponseWriter, r io.ReadCloser, idle time.Duration) io.ReadCloser {
	if idle <= 0 {
		return r
	}
	return &idleBody{r: r, rc: http.NewResponseController(w), idle: idle}
}

func (b *idleBody) Read(p []byte) (int, error) {
	if !b.off {
		if now := time.Now(); now.Sub(b.moved) > b.idle/8 {
			if err := b.rc.SetReadDeadline(now.Add(b.idle)); err != nil {
				b.off = true // e.g. a handler test's recorder
			} else {
				b.moved = now
			}
		}
	}
	n, err := b.r.Read(p)
	if err != nil && errors.Is(err, os.ErrDeadlineExceeded) {
		err = errRequestTimeout
	}
	if err == io.EOF && !b.moved.IsZero() {
		// The server now reads ahead on the connection for as long as the
		// handler runs (to notice the client leaving); that read must not
		// time out and cancel a request whose body is complete.
		b.rc.SetReadDeadline(time.Time{})
		b.moved = time.Time{}
	}
	return n, err
}

func (b *idleBody) Close() error { return b.r.Close() }

// idleWriter is a response body with an idle timeout.
type idleWriter struct {
	w     io.Writer
	rc    *http.ResponseController
	idle  time.Duration
	moved time.Time
	off   bool
	// inPlace: the response is net/http's HTTP/1.x writer, whose Write
	// copies p into its buffers or write(2)s it, in the handler's
	// goroutine (client.SyncWriter). HTTP/2's passes p to the
	// connection's goroutines: not in place.
	inPlace bool
}

// WritesInCallingGoroutine implements client.SyncWriter: WriteRange may
// write a mapped local block file's bytes to an HTTP/1.x response
// without copying them first (a fault on the mapping stays in the
// guarded goroutine).
func (iw *idleWriter) WritesInCallingGoroutine() bool { return iw.inPlace }

func newIdleWriter(w http.ResponseWriter, idle time.Duration) *idleWriter {
	return &idleWriter{w: w, rc: http.NewResponseController(w), idle: idle, off: idle <= 0}
}

// stop clears the deadline: the server does not, and the connection may
// serve more requests.
func (iw *idleWriter) stop() {
	if !iw.moved.IsZero() {
		iw.rc.SetWriteDeadline(time.Time{})
	}
}

func (iw *idleWriter) Write(p []byte) (int, error) {
	if !iw.off {
		if now := time.Now(); now.Sub(iw.moved) > iw.idle/8 {
			if err := iw.rc.SetWriteDeadline(now.Add(iw.idle)); err != nil {
				iw.off = true
			} else {
				iw.moved = now
			}
		}
	}
	return iw.w.Write(p)
}
