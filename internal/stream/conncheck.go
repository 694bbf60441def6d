package stream

import (
	"crypto/tls"
	"errors"
	"net"
	"sync/atomic"
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
