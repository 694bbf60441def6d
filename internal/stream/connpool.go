package stream

import (
	"crypto/tls"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// ConnPool keeps a client's stream connections between streams (doc.go,
// "Reuse"): a Writer whose stream closed cleanly (every hop acked the
// close, nothing failed) hands its connection back, and the next Dial for
// the same route and TLS configuration takes it instead of connecting,
// handshaking and having every datanode connect to the next. A
// connection idle longer than the pool's bound is closed; so are those
// beyond its size, and all of them at Close. A connection is used by one
// stream at a time.
type ConnPool struct {
	max    int
	idle   time.Duration
	maxAge time.Duration // since the handshake (DefaultPoolMaxAge)

	mu     sync.Mutex
	conns  map[poolKey][]*pooledConn // newest last
	n      int
	closed bool
	sweep  *time.Timer // armed while the pool holds connections

	dials, reuses, stale, staleHeaders atomic.Uint64
}

// pooledConn is a stream connection between streams, and what the next
// stream on it needs.
type pooledConn struct {
	key  poolKey
	conn net.Conn // *recordConn (secured) or the TCP connection
	// cs is the session with the first datanode: the payload key of the
	// connection's stream number seq is exported from it.
	cs      *tls.ConnectionState
	seq     uint64    // streams the connection carried so far
	unwatch func()    // Options.Watch's stop
	since   time.Time // handed back
	born    time.Time // connected
}

// usable reports whether pc may carry another stream: idle less than
// idle, younger than maxAge, and the datanode's certificate unexpired.
func (pc *pooledConn) usable(now time.Time, idle, maxAge time.Duration) bool {
	return now.Sub(pc.since) < idle && now.Before(expiry(pc.born, maxAge, pc.cs))
}

func (pc *pooledConn) close() {
	closeRaw(pc.conn)
	if pc.unwatch != nil {
		pc.unwatch()
	}
}

// PoolStats are a ConnPool's counters.
type PoolStats struct {
	Dials  uint64 // connections opened by Dials with this pool
	Reuses uint64 // streams opened (or refused) on a pooled connection
	Stale  uint64 // pooled connections found closed by the datanode before the header was sent (then a new one was dialed)
	// StaleHeaders counts streams on pooled connections that failed with
	// CodeStale: the connection (or a datanode's kept one down the route)
	// ended before the header was answered; the stream was abandoned.
	StaleHeaders uint64
	Idle         int // connections in the pool now
}

// DefaultPoolIdle is how long a pooled connection may wait for its next
// stream; datanodes wait longer (ServerConfig.ReuseIdle), so an idle
// connection is normally ended by the client first. A datanode also
// closes one earlier: beyond its MaxIdle, at its MaxConnAge or the
// client certificate's NotAfter, or when it restarts. Dial peeks at the
// connection before writing the header (checkIdle) and dials anew if the
// datanode closed it; a close that crosses the header on the wire fails
// that stream with CodeStale (abandoned: the caller sends its data again
// as a new block on a new connection, Options.Fresh, without blaming the
// datanode).
const DefaultPoolIdle = 20 * time.Second

// DefaultPoolMaxAge bounds how long after its handshake a pooled
// connection may carry streams (datanodes allow longer,
// ServerConfig.MaxConnAge); none is used past the datanode's certificate
// NotAfter either.
const DefaultPoolMaxAge = 10 * time.Minute

// NewConnPool returns a pool of at most max idle connections (default 64),
// each closed after idle (default DefaultPoolIdle) without a stream.
func NewConnPool(max int, idle time.Duration) *ConnPool {
	if max <= 0 {
		max = 64
	}
	if idle <= 0 {
		idle = DefaultPoolIdle
	}
	return &ConnPool{max: max, idle: idle, maxAge: DefaultPoolMaxAge, conns: map[poolKey][]*pooledConn{}}
}

// Stats returns the counters.
func (p *ConnPool) Stats() PoolStats {
	p.mu.Lock()
	n := p.n
	p.mu.Unlock()
	return PoolStats{Dials: p.dials.Load(), Reuses: p.reuses.Load(), Stale: p.stale.Load(), StaleHeaders: p.staleHeaders.Load(), Idle: n}
}

// poolKey names what a connection can carry: the first hop, the rest of
// the route (each datanode keeps its connection to the next) and the TLS
// configuration (the client's identity) it was opened with. The key
// holds the configuration itself, so it stays alive (and its address
// unique) while a connection opened with it is pooled.
type poolKey struct {
	cfg   *tls.Config
	route string
}

func keyFor(route []Target, cfg *tls.Config) poolKey {
	var b strings.Builder
	for _, t := range route {
		fmt.Fprintf(&b, "%d@%s|", t.ID, t.Addr)
	}
	return poolKey{cfg: cfg, route: b.String()}
}

// take is get, or nil if fresh (Options.Fresh: the pooled connections
// stay for later streams).
func (p *ConnPool) take(key poolKey, fresh bool) *pooledConn {
	if fresh {
		return nil
	}
	return p.get(key)
}

// get takes the newest idle connection for key, or nil.
func (p *ConnPool) get(key poolKey) *pooledConn {
	p.mu.Lock()
	defer p.mu.Unlock()
	l := p.conns[key]
	for len(l) > 0 {
		pc := l[len(l)-1]
		l[len(l)-1] = nil
		l = l[:len(l)-1]
		p.n--
		if pc.usable(time.Now(), p.idle, p.maxAge) {
			p.set(key, l)
			return pc
		}
		pc.close()
	}
	p.set(key, l)
	return nil
}

func (p *ConnPool) set(key poolKey, l []*pooledConn) {
	if len(l) == 0 {
		delete(p.conns, key)
	} else {
		p.conns[key] = l
	}
}

// put keeps pc for the next stream of its route, or closes it if the
// pool is closed or full.
func (p *ConnPool) put(pc *pooledConn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || p.n >= p.max {
		pc.close()
		return
	}
	pc.since = time.Now()
	p.conns[pc.key] = append(p.conns[pc.key], pc)
	p.n++
	if p.sweep == nil {
		p.sweep = time.AfterFunc(p.idle/2, p.expire)
	}
}

// expire closes the connections idle past the bound (or past their age);
// it runs while the pool holds any.
func (p *ConnPool) expire() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.sweep = nil
	if p.closed {
		return
	}
	for key, l := range p.conns {
		keep := l[:0]
		for _, pc := range l {
			if !pc.usable(time.Now(), p.idle, p.maxAge) {
				pc.close()
				p.n--
			} else {
				keep = append(keep, pc)
			}
		}
		clear(l[len(keep):])
		p.set(key, keep)
	}
	if p.n > 0 {
		p.sweep = time.AfterFunc(p.idle/2, p.expire)
	}
}

// Close closes every idle connection; connections handed back later are
// closed at once.
func (p *ConnPool) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	p.closeIdle()
	return nil
}

// CloseIdle closes every idle connection; the pool stays open.
func (p *ConnPool) CloseIdle() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closeIdle()
}

func (p *ConnPool) closeIdle() {
	if p.sweep != nil {
		p.sweep.Stop()
		p.sweep = nil
	}
	for key, l := range p.conns {
		for _, pc := range l {
			pc.close()
		}
		delete(p.conns, key)
	}
	p.n = 0
}
