package pki

import (
	"context"
	"crypto/tls"
	"net"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc/credentials"
)

// Record batching, measured and not used (kept here for the benchmarks).
//
// crypto/tls hands every record it seals (at most 16 KiB of data) to the
// connection under it with a Write of its own: one system call, one TCP
// send and one wake-up of the reader per 16 KiB (a datanode profile
// showed a quarter of its read CPU under those writes). Conn collects the records of one
// Write of the TLS connection and gives them to the socket in one go (at
// most batchBytes at a time), so a 1 MiB write costs 4 system calls, not 64.
//
// Nothing is held back: records are buffered only while a Write of the TLS
// connection is in progress and flushed before it returns. Everything else
// crypto/tls writes (the handshake, post-handshake messages from Read,
// close_notify) goes straight through, as without the batching.
//
// On this machine it does not pay: the system calls saved were cheap (on
// loopback a send's cost is the kernel copying the data, which batching
// does not change) and the copy into the batch costs more (crypto/tls
// reuses one record buffer, so records cannot be gathered without it). A datanode
// serving 1 MiB gRPC messages over TLS used 0.36-0.41 CPU-s per GiB with
// crypto/tls as it is, 0.39-0.45 batched, 0.50-0.59 batched behind a 1 MiB
// gRPC write buffer (BenchmarkGRPCServe; docs/BENCHMARKS.md).

// batchBytes is the most a batch holds before it is sent (a variable: the
// benchmarks try several sizes).
var batchBytes = 256 << 10

// recordMax is the most one record takes on the wire (16 KiB of data plus
// the record header, the AEAD tag and the content type): a batch never
// grows past batchBytes plus one record.
const recordMax = 16<<10 + 256

var batchPool = sync.Pool{New: func() any { b := make([]byte, 0, batchBytes+recordMax); return &b }}

// recordBatcher is the connection under the TLS connection: it buffers the
// records written between begin and end.
type recordBatcher struct {
	net.Conn
	mu      sync.Mutex
	active  int     // Writes of the TLS connection in progress
	buf     *[]byte // pooled while a batch is open
	err     error   // the first failed write: later ones fail the same way
	flushes atomic.Int64
}

func newRecordBatcher(raw net.Conn) *recordBatcher { return &recordBatcher{Conn: raw} }

// Write buffers p while a batch is open, else sends it (after anything
// still buffered).
func (b *recordBatcher) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.err != nil {
		return 0, b.err
	}
	if b.active == 0 {
		if err := b.flushLocked(); err != nil {
			return 0, err
		}
		return b.send(p)
	}
	if b.buf == nil {
		b.buf = batchPool.Get().(*[]byte)
	}
	if len(*b.buf)+len(p) > cap(*b.buf) {
		if err := b.flushLocked(); err != nil {
			return 0, err
		}
		if len(p) > batchBytes {
			return b.send(p)
		}
		b.buf = batchPool.Get().(*[]byte)
	}
	*b.buf = append(*b.buf, p...)
	if len(*b.buf) >= batchBytes {
		if err := b.flushLocked(); err != nil {
			return 0, err
		}
	}
	return len(p), nil
}

func (b *recordBatcher) send(p []byte) (int, error) {
	b.flushes.Add(1)
	n, err := b.Conn.Write(p)
	if err != nil {
		b.err = err
	}
	return n, err
}

// flushLocked sends the buffered records and gives the buffer back.
func (b *recordBatcher) flushLocked() error {
	if b.buf == nil {
		return b.err
	}
	buf := b.buf
	b.buf = nil
	var err error
	if len(*buf) > 0 {
		_, err = b.send(*buf)
	}
	*buf = (*buf)[:0]
	batchPool.Put(buf)
	return err
}

func (b *recordBatcher) begin() {
	b.mu.Lock()
	b.active++
	b.mu.Unlock()
}

// end closes a batch: whatever it collected is sent now.
func (b *recordBatcher) end() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.active--
	return b.flushLocked()
}

// Close sends what is buffered if no write is in progress (a Close that
// comes to break a blocked write must not wait for it) and closes the
// connection.
func (b *recordBatcher) Close() error {
	if b.mu.TryLock() {
		if b.err == nil {
			b.flushLocked()
		}
		b.mu.Unlock()
	}
	return b.Conn.Close()
}

// Flushes is the number of writes the socket has seen (for tests).
func (b *recordBatcher) Flushes() int64 { return b.flushes.Load() }

// Conn is a TLS connection that sends the records of each Write in as few
// system calls as it can. It is a *tls.Conn in every other respect.
type Conn struct {
	*tls.Conn
	b *recordBatcher
}

// Server is tls.Server with batched record writes.
func Server(raw net.Conn, cfg *tls.Config) *Conn {
	b := newRecordBatcher(raw)
	return &Conn{Conn: tls.Server(b, cfg), b: b}
}

// Client is tls.Client with batched record writes.
func Client(raw net.Conn, cfg *tls.Config) *Conn {
	b := newRecordBatcher(raw)
	return &Conn{Conn: tls.Client(b, cfg), b: b}
}

// Write encrypts p and sends its records together. The handshake, if not
// done yet, runs first and unbatched: its messages must reach the peer
// before this side waits for the answer.
func (c *Conn) Write(p []byte) (int, error) {
	if err := c.Conn.Handshake(); err != nil {
		return 0, err
	}
	return batchedWrite(c.b, c.Conn, p)
}

// WriteBuffers writes bufs in one batch (net.Buffers.WriteTo would make
// each a batch of its own: a packet header in a system call by itself).
func (c *Conn) WriteBuffers(bufs [][]byte) (int64, error) {
	if err := c.Conn.Handshake(); err != nil {
		return 0, err
	}
	c.b.begin()
	var n int64
	var err error
	for _, p := range bufs {
		var m int
		m, err = c.Conn.Write(p)
		n += int64(m)
		if err != nil {
			break
		}
	}
	if ferr := c.b.end(); err == nil && ferr != nil {
		return 0, ferr
	}
	return n, err
}

// NetConn is the connection under the batching (as tls.Conn.NetConn).
func (c *Conn) NetConn() net.Conn { return c.b.Conn }

// Flushes is the number of writes the socket has seen.
func (c *Conn) Flushes() int64 { return c.b.Flushes() }

func batchedWrite(b *recordBatcher, w net.Conn, p []byte) (int, error) {
	b.begin()
	n, err := w.Write(p)
	if ferr := b.end(); err == nil && ferr != nil {
		// The records were accepted into the batch but never sent.
		return 0, ferr
	}
	return n, err
}

// ConnectionStater is what TLS connections (*tls.Conn, *Conn, and the
// connections gRPC's TLS credentials return) have in common.
type ConnectionStater interface {
	ConnectionState() tls.ConnectionState
}

// batchedCreds are gRPC transport credentials whose connections batch
// their records: the handshake is gRPC's own (ALPN, TLSInfo), on a
// batching connection.
type batchedCreds struct {
	credentials.TransportCredentials
}

// BatchedTLS is credentials.NewTLS(cfg) with batched record writes.
func BatchedTLS(cfg *tls.Config) credentials.TransportCredentials {
	return batchedCreds{credentials.NewTLS(cfg)}
}

func (c batchedCreds) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	b := newRecordBatcher(raw)
	conn, info, err := c.TransportCredentials.ClientHandshake(ctx, authority, b)
	if err != nil {
		return nil, nil, err
	}
	return &grpcConn{Conn: conn, b: b}, info, nil
}

func (c batchedCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	b := newRecordBatcher(raw)
	conn, info, err := c.TransportCredentials.ServerHandshake(b)
	if err != nil {
		return nil, nil, err
	}
	return &grpcConn{Conn: conn, b: b}, info, nil
}

func (c batchedCreds) Clone() credentials.TransportCredentials {
	return batchedCreds{c.TransportCredentials.Clone()}
}

// grpcConn is the handshaken connection gRPC's TLS credentials return,
// with batched writes.
type grpcConn struct {
	net.Conn
	b *recordBatcher
}

func (c *grpcConn) Write(p []byte) (int, error) { return batchedWrite(c.b, c.Conn, p) }

func (c *grpcConn) ConnectionState() tls.ConnectionState {
	if s, ok := c.Conn.(ConnectionStater); ok {
		return s.ConnectionState()
	}
	return tls.ConnectionState{}
}
