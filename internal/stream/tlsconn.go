package stream

import (
	"bufio"
	"crypto/tls"
	"net"
	"sync"
)

// crypto/tls writes every record (at most 16 KiB of data) with its own
// write on the connection under it, and reads the connection a record at
// a time: a 1 MiB packet costs some 64 write and 64+ read system calls on
// each hop, and over loopback or a fast link the kernel's per-call and
// per-segment work weighs more than the AES-GCM. A stream's TLS
// connection therefore runs over a recordConn, which gathers the records
// of one packet into writes of up to tlsWriteBatch bytes and reads the
// socket tlsReadBuffer bytes at a time. The bytes on the wire are the
// same records in the same order: only the system calls change.
var (
	tlsWriteBatch = 256 << 10 // 0: a write per record
	tlsReadBuffer = 256 << 10 // 0: a read per record
)

var batchPool sync.Pool // *[]byte of cap tlsWriteBatch

// recordConn is the TCP connection under a stream's TLS connection.
type recordConn struct {
	net.Conn
	rd *bufio.Reader // nil: reads go straight to the socket

	mu    sync.Mutex // orders buffered and direct writes
	batch *[]byte    // non-nil between begin and end
}

// newRecordConn wraps raw; buffered reads are for the side that receives
// packets (a datanode's upstream connection), not for one that reads acks.
func newRecordConn(raw net.Conn, bufferReads bool) *recordConn {
	c := &recordConn{Conn: raw}
	if bufferReads && tlsReadBuffer > 0 {
		c.rd = bufio.NewReaderSize(raw, tlsReadBuffer)
	}
	return c
}

func (c *recordConn) Read(p []byte) (int, error) {
	if c.rd == nil {
		return c.Conn.Read(p)
	}
	return c.rd.Read(p)
}

// Write sends p, or between begin and end appends it to the batch (TLS
// records; crypto/tls reuses its record buffer, so p is copied).
func (c *recordConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.batch == nil {
		return c.Conn.Write(p)
	}
	b := *c.batch
	if len(b)+len(p) > cap(b) {
		if err := c.flushLocked(); err != nil {
			return 0, err
		}
		b = *c.batch
		if len(p) > cap(b) {
			return c.Conn.Write(p)
		}
	}
	*c.batch = append(b, p...)
	return len(p), nil
}

func (c *recordConn) flushLocked() error {
	b := *c.batch
	*c.batch = b[:0]
	if len(b) == 0 {
		return nil
	}
	_, err := c.Conn.Write(b)
	return err
}

// begin starts gathering writes.
func (c *recordConn) begin() {
	if tlsWriteBatch <= 0 {
		return
	}
	bp, _ := batchPool.Get().(*[]byte)
	if bp == nil || cap(*bp) != tlsWriteBatch {
		b := make([]byte, 0, tlsWriteBatch)
		bp = &b
	}
	c.mu.Lock()
	c.batch = bp
	c.mu.Unlock()
}

// end sends what was gathered since begin and writes directly again.
func (c *recordConn) end() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.batch == nil {
		return nil
	}
	err := c.flushLocked()
	bp := c.batch
	c.batch = nil
	*bp = (*bp)[:0]
	batchPool.Put(bp)
	return err
}

// writePacket writes bufs to w in as few system calls as the batch
// allows when w is TLS over a recordConn, else with one writev.
func writePacket(w net.Conn, rc *recordConn, bufs *net.Buffers) error {
	if _, ok := w.(*tls.Conn); !ok || rc == nil {
		_, err := bufs.WriteTo(w)
		return err
	}
	rc.begin()
	_, err := bufs.WriteTo(w)
	if eerr := rc.end(); err == nil {
		err = eerr
	}
	return err
}
