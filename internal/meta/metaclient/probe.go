package metaclient

import (
	"context"
	"errors"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// Defaults of the hung-node detection (Config.ProbeAfter, ProbeTimeout,
// SuspectFor; ProberConfig likewise).
const (
	DefaultProbeAfter   = time.Second
	DefaultProbeTimeout = time.Second
	DefaultSuspectFor   = 5 * time.Second
)

// ErrHung is the cause of a call abandoned because its node did not answer
// a probe: a stopped (SIGSTOP), frozen or cut-off process whose kernel
// still holds the connection open, so the call would otherwise wait for
// its whole deadline.
var ErrHung = errors.New("node did not answer a probe: abandoned as hung")

// ProberConfig configures a Prober. Zero values take the defaults.
type ProberConfig struct {
	// ProbeAfter: a call that has waited this long on a connection makes
	// the prober probe it, and again every ProbeAfter while it waits.
	ProbeAfter time.Duration
	// ProbeTimeout: a probe not answered within this marks the node hung.
	ProbeTimeout time.Duration
}

// Prober detects hung servers the way etcd's clients do with keepalive
// pings, at the application level: while a call waits on a connection, a
// tiny RPC is sent on the same connection (grpc.health.v1.Health/Check).
// Any answer, even Unimplemented from a server that does not register the
// health service, proves that the process reads its socket and runs its
// gRPC server; silence for ProbeTimeout does not, and the call is
// abandoned. A slow but live server (a long fsync, a big listing) keeps
// its calls. Probes are shared: concurrent calls waiting on one connection
// cause one probe per ProbeAfter, not one each.
type Prober struct {
	cfg ProberConfig
	mu  sync.Mutex
	// last probe per connection: in flight (done open) or finished.
	runs map[*grpc.ClientConn]*probeRun
}

type probeRun struct {
	done  chan struct{}
	alive bool
	at    time.Time // when it finished
}

// NewProber returns a prober.
func NewProber(cfg ProberConfig) *Prober {
	if cfg.ProbeAfter <= 0 {
		cfg.ProbeAfter = DefaultProbeAfter
	}
	if cfg.ProbeTimeout <= 0 {
		cfg.ProbeTimeout = DefaultProbeTimeout
	}
	return &Prober{cfg: cfg, runs: map[*grpc.ClientConn]*probeRun{}}
}

// Watch returns a context for one call on cc, derived from ctx, and a
// function to call once the call returned. The context is cancelled with
// cause ErrHung if cc's server stops answering probes while the call
// waits; done reports whether that happened (and the caller's own ctx had
// not ended first). The fast path costs one timer.
func (p *Prober) Watch(ctx context.Context, cc *grpc.ClientConn) (context.Context, func() (hung bool)) {
	cctx, cancel := context.WithCancelCause(ctx)
	var t *time.Timer
	t = time.AfterFunc(p.cfg.ProbeAfter, func() {
		for cctx.Err() == nil {
			if !p.alive(cctx, cc) {
				cancel(ErrHung)
				return
			}
			tm := time.NewTimer(p.cfg.ProbeAfter)
			select {
			case <-cctx.Done():
				tm.Stop()
				return
			case <-tm.C:
			}
		}
	})
	return cctx, func() bool {
		t.Stop()
		hung := ctx.Err() == nil && errors.Is(context.Cause(cctx), ErrHung)
		cancel(context.Canceled)
		return hung
	}
}

// alive probes cc (or joins a probe in flight, or reuses a result younger
// than ProbeAfter/2). It returns true if ctx ends first: the call is over.
func (p *Prober) alive(ctx context.Context, cc *grpc.ClientConn) bool {
	p.mu.Lock()
	r := p.runs[cc]
	if r == nil || (isClosed(r.done) && time.Since(r.at) > p.cfg.ProbeAfter/2) {
		r = &probeRun{done: make(chan struct{})}
		p.runs[cc] = r
		go p.probe(cc, r)
	}
	p.mu.Unlock()
	select {
	case <-r.done:
		return r.alive
	case <-ctx.Done():
		return true
	}
}

func (p *Prober) probe(cc *grpc.ClientConn, r *probeRun) {
	ctx, cancel := context.WithTimeout(context.Background(), p.cfg.ProbeTimeout)
	err := cc.Invoke(ctx, healthpb.Health_Check_FullMethodName, &healthpb.HealthCheckRequest{}, &healthpb.HealthCheckResponse{})
	cancel()
	p.mu.Lock()
	r.alive = Answered(err)
	r.at = time.Now()
	close(r.done)
	p.mu.Unlock()
}

// Probe sends one probe to cc now and reports whether the server answered
// within ProbeTimeout.
func (p *Prober) Probe(cc *grpc.ClientConn) bool {
	r := &probeRun{done: make(chan struct{})}
	p.probe(cc, r)
	return r.alive
}

// Answered reports whether err (of a probe) came from the server itself:
// any status but a deadline, a cancellation or an unreachable transport.
func Answered(err error) bool {
	switch status.Code(err) {
	case codes.DeadlineExceeded, codes.Canceled, codes.Unavailable:
		return false
	}
	return true
}

func isClosed(c chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}
