package stream

import (
	"crypto/tls"
	"errors"
	"io"
	"net"
	"sync/atomic"
	"syscall"
	"time"
)

// testHookKept (tests only) is called with a kept connection that
// checkIdle found open, right before a header is written into it.
var testHookKept atomic.Pointer[func(net.Conn)]

func hookKept(c net.Conn) {
	if f := testHookKept.Load(); f != nil {
		(*f)(c)
	}
}

// errPeerSentData: a connection between two streams, on which the peer
// owes nothing, holds input: it cannot carry a next stream.
var errPeerSentData = errors.New("stream: the peer sent data on a connection between streams")

// errConnExpired: a kept connection is past its maximum age or its peer's
// certificate's NotAfter.
var errConnExpired = errors.New("stream: connection past its maximum age or its peer certificate's expiry")

// checkIdle reports why c, a connection between two streams, cannot carry
// the next one: nil if it is open with nothing to read; io.EOF or a
// reset if the peer closed it (a datanode closes an idle connection when
// its ReuseIdle or MaxConnAge runs out, past MaxIdle, or on restart);
// errPeerSentData if anything arrived. It peeks at the socket without
// waiting and without consuming anything, so it is called right before a
// header is written: a peer that closed the connection cannot have read
// that header, and a new connection is then as safe as on a first dial.
// A close that crosses the peek on the wire is not seen: the header is
// then written into a dying connection, and the caller fails the stream
// (unless the write itself failed, see the callers).
func checkIdle(c net.Conn) error {
	raw := c
	switch tc := c.(type) {
	case *recordConn:
		raw = tc.Conn
	case *tls.Conn:
		raw = tc.NetConn()
	}
	return peekClosed(raw)
}

// expiry is when a connection made at born may carry no more streams:
// born+maxAge, or earlier when the peer's certificate (cs, nil on
// plaintext) expires.
func expiry(born time.Time, maxAge time.Duration, cs *tls.ConnectionState) time.Time {
	e := born.Add(maxAge)
	if cs != nil && len(cs.PeerCertificates) > 0 {
		if na := cs.PeerCertificates[0].NotAfter; na.Before(e) {
			e = na
		}
	}
	return e
}

// countReader counts the bytes read through it.
type countReader struct {
	r io.Reader
	n int64
}

func (c *countReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

// readAnswer reads the ack that answers a header written into c (plain
// or, on a kept secured connection, a record connection) and reports how
// many bytes of the connection it received, so that the caller can tell
// a connection that ended before any of the answer arrived (staleEnd).
func readAnswer(c net.Conn, b *[ackLen]byte, a *ack) (got int64, err error) {
	if rc, ok := c.(*recordConn); ok {
		cr := &countReader{r: rc.r}
		rc.r = cr
		err = readAck(rc, b, a)
		rc.r = cr.r
		return cr.n, err
	}
	cr := &countReader{r: c}
	err = readAck(cr, b, a)
	return cr.n, err
}

// staleEnd reports whether err, reading the answer to a header written
// whole into a KEPT connection after got bytes of it arrived, is how the
// peer's close of that connection while idle looks when the close
// crosses the header on the wire: nothing of the answer arrived and the
// connection ended (end of file: the peer's FIN came first; or a reset:
// the header reached a socket already closed, or unread in one being
// closed). Not stale: any byte of an answer (the peer was answering), a
// timeout (the peer holds the connection but does not answer), our own
// end closing it (net.ErrClosed: an interrupt or a revocation watch), a
// refused record. A peer that died after reading the header looks the
// same as a stale one; so the stream is abandoned (a new block, never
// the same one: that peer may have opened it) and the peer judged on a
// new connection (CodeStale).
func staleEnd(err error, got int64) bool {
	if got != 0 || err == nil {
		return false
	}
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNABORTED) || errors.Is(err, syscall.EPIPE)
}
