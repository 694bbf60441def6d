package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
)

// readAheadUnit is the span of one read-ahead piece: one ReadBlock call.
// Larger pieces mean fewer calls; Config.MaxInflightChunks pieces are in
// flight, so one WriteRange holds at most MaxInflightChunks*readAheadUnit
// bytes (16 MiB with the defaults: 4 pieces of 4 MiB).
func (c *Client) readAheadUnit() int64 { return int64(c.cfg.ChunkSize) }

// maxReadAheadBytes bounds the read-ahead buffers of all of a client's
// readers together (an S3 gateway serving many GETs): each reader may have
// MaxInflightChunks pieces in flight, but only this many bytes of pieces
// exist at once across them; readers beyond wait for pieces to drain.
const maxReadAheadBytes = 256 << 20

// pieceBufs pools read-ahead buffers by size (one size per client config
// in practice), so a GET does not allocate and clear 4 MiB per piece.
var pieceBufs sync.Map // int64 -> *sync.Pool

func getPieceBuf(n int64) *[]byte {
	p, _ := pieceBufs.LoadOrStore(n, &sync.Pool{New: func() any { b := make([]byte, n); return &b }})
	return p.(*sync.Pool).Get().(*[]byte)
}

func putPieceBuf(b *[]byte) {
	if p, ok := pieceBufs.Load(int64(cap(*b))); ok {
		*b = (*b)[:cap(*b)]
		p.(*sync.Pool).Put(b)
	}
}

// WriteRange writes n bytes of the key from off to w, with up to
// Config.MaxInflightChunks pieces read in parallel ahead of w (each piece
// from the replicas, verified against the stored checksums, with failover
// as ReadAt). Pieces are aligned to the read-ahead unit within the key so
// that they are whole checksum windows and go straight into the pooled
// buffers. It returns the bytes written; it does not move the reader's
// position. A range past the end is cut at the end.
func (r *KeyReader) WriteRange(w io.Writer, off, n int64) (int64, error) {
	if off < 0 || n < 0 {
		return 0, fmt.Errorf("%s: invalid range at %d of %d bytes", r.op, off, n)
	}
	end := min(off+n, r.Size())
	if off >= end {
		return 0, nil
	}
	type piece struct {
		pos  int64
		buf  *[]byte
		m    mappedPiece // or a range of a mapped local block file
		n    int
		err  error
		done chan struct{}
	}
	unit := r.c.readAheadUnit()
	// lazy: a mapped piece is verified step by step just before each
	// step is written (mappedPiece.write), so the writer's copy reads
	// bytes the checksum just brought into the CPU cache: one pass over
	// memory fewer than verifying the whole piece ahead (measured:
	// docs/BENCHMARKS.md, session 7). Writers that do not read the bytes
	// (io.Discard; a FileSender sends the file) get pieces verified
	// ahead, in parallel.
	_, sends := w.(FileSender)
	lazy := w != io.Discard && !sends
	inflight := max(r.c.cfg.MaxInflightChunks, 1)
	queue := make(chan *piece, inflight)
	ctx, cancel := context.WithCancel(r.ctx)
	defer cancel()
	var wg sync.WaitGroup
	go func() {
		defer close(queue)
		for pos := off; pos < end; {
			pe := min((pos/unit+1)*unit, end)
			if sem := r.c.readAhead; sem != nil {
				select {
				case sem <- struct{}{}:
				case <-ctx.Done():
					return
				}
			}
			p := &piece{pos: pos, done: make(chan struct{})}
			select {
			case queue <- p:
			case <-ctx.Done():
				r.c.releasePiece(nil)
				return
			}
			wg.Add(1)
			go func(pos, pe int64) {
				defer wg.Done()
				defer close(p.done)
				if m, ok := r.mapPiece(pos, pe, lazy); ok {
					p.m, p.n = m, int(pe-pos)
					return
				}
				p.buf = getPieceBuf(unit)
				p.n, p.err = r.readAt(ctx, (*p.buf)[:pe-pos], pos)
			}(pos, pe)
			pos = pe
		}
	}()
	var total int64
	var err error
	for p := range queue {
		<-p.done
		if err == nil {
			if p.err != nil && p.err != io.EOF {
				err = p.err
			} else {
				var k int
				if p.m.bf != nil {
					var sent, copied bool
					k, sent, copied, err = p.m.write(w)
					p.m.bf = nil
					st := &r.c.sc.blk
					st.reads.Add(1)
					st.bytes.Add(uint64(k))
					if copied {
						st.copied.Add(uint64(k))
					} else {
						st.mapped.Add(uint64(k))
					}
					if sent {
						st.sent.Add(uint64(k))
					}
					if errors.Is(err, errVerifyLater) {
						// A step failed its checksum (or faulted) before it
						// was written: the rest of the piece is read the
						// ordinary way, which reports a corrupt replica and
						// reads another.
						var k2 int
						k2, err = r.writeRest(ctx, w, p.pos+int64(k), p.pos+int64(p.n))
						k += k2
					}
				} else {
					k, err = w.Write((*p.buf)[:p.n])
				}
				total += int64(k)
			}
			if err != nil {
				cancel()
			}
		}
		if p.m.bf != nil {
			p.m.bf.release()
		}
		r.c.releasePiece(p.buf)
	}
	wg.Wait()
	return total, err
}

// writeRest reads [pos, end) (at most one read-ahead unit) with readAt
// and writes it to w.
func (r *KeyReader) writeRest(ctx context.Context, w io.Writer, pos, end int64) (int, error) {
	b := getPieceBuf(r.c.readAheadUnit())
	defer putPieceBuf(b)
	n, err := r.readAt(ctx, (*b)[:end-pos], pos)
	if err != nil && err != io.EOF {
		return 0, err
	}
	return w.Write((*b)[:n])
}

// releasePiece returns a read-ahead piece's buffer and its place in the
// client-wide bound.
func (c *Client) releasePiece(b *[]byte) {
	if b != nil {
		putPieceBuf(b)
	}
	if c.readAhead != nil {
		<-c.readAhead
	}
}
