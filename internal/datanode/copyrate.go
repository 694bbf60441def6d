package datanode

import (
	"context"
	"io"
	"time"
)

// pacedReader caps the bytes per second read through it (a container
// copy's bandwidth, ReplicateContainerCommand.max_bytes_per_sec), so a
// repair leaves the disk and the network to foreground writes. It reads
// freely and then sleeps until the bytes read so far are due; a burst of
// one read (at most an export piece) goes through at once.
type pacedReader struct {
	ctx   context.Context
	r     io.Reader
	rate  float64 // bytes per second; 0: no cap
	start time.Time
	n     int64
}

func paced(ctx context.Context, r io.Reader, bytesPerSec uint64) io.Reader {
	if bytesPerSec == 0 {
		return r
	}
	return &pacedReader{ctx: ctx, r: r, rate: float64(bytesPerSec), start: time.Now()}
}

func (p *pacedReader) Read(b []byte) (int, error) {
	n, err := p.r.Read(b)
	p.n += int64(n)
	due := p.start.Add(time.Duration(float64(p.n) / p.rate * float64(time.Second)))
	if wait := time.Until(due); wait > 0 {
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-p.ctx.Done():
			t.Stop()
			return n, p.ctx.Err()
		}
	}
	return n, err
}
