// Package guard keeps one request's bug from becoming the whole process's
// outage: a panic inside one request handler becomes an error for that
// request, is logged with its stack and counted in a metric; it never
// takes the process down.
//
// A Go program dies when any goroutine panics without recovering, so a
// server that serves many clients from one process must recover at the
// boundary of each unit of work it does for someone else: a gRPC call
// (UnaryServerInterceptor, StreamServerInterceptor), an HTTP request
// (Guard.HTTP), a connection served on its own goroutine (Guard.Run,
// Guard.Go). Inside that boundary the code asserts its invariants with
// panics as it likes; the guard turns a failed assertion into a failed
// request (codes.Internal, HTTP 500) and leaves every other request alone.
//
// What a guard cannot do is undo the half-done work of the request that
// panicked: locks it held are released only by its own defers, and state
// it changed stays changed. Code that mutates shared state under a lock
// must therefore unlock with defer, as Go code should anyway.
//
// Recovered panics are counted in basalt_panics_recovered_total{where},
// registered on the Registerer the caller gives (none by default, as every
// Basalt package's metrics), and logged at Error level with the stack. The
// stack goes only to the log: the error the client sees names where it
// happened, not how.
package guard

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// maxValueLen bounds how much of a panic value goes into an error message
// (the log gets all of it).
const maxValueLen = 256

// PanicError is a recovered panic: where it happened, the value passed to
// panic, and the goroutine's stack at that point.
type PanicError struct {
	Where string
	Value any
	Stack []byte
}

func (e *PanicError) Error() string { return fmt.Sprintf("panic in %s: %s", e.Where, e.value()) }

// value is the panic value as text, bounded.
func (e *PanicError) value() string {
	v := fmt.Sprint(e.Value)
	if len(v) > maxValueLen {
		v = v[:maxValueLen] + "..."
	}
	return v
}

// Unwrap returns the panic value when it is an error (a runtime error,
// say), so errors.As finds it.
func (e *PanicError) Unwrap() error {
	err, _ := e.Value.(error)
	return err
}

// Guard recovers panics, logs them and counts them. A nil *Guard is
// usable: it recovers and logs to slog.Default, counting in a counter no
// registry exports.
type Guard struct {
	log    *slog.Logger
	panics *prometheus.CounterVec
}

// New returns a guard that logs to log (nil: slog.Default) and registers
// its counter on reg (nil: not exported). If reg already has the counter
// (another guard of this process registered it), the guard shares it, so
// several servers on one registry export one metric.
func New(reg prometheus.Registerer, log *slog.Logger) *Guard {
	if log == nil {
		log = slog.Default()
	}
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "basalt", Name: "panics_recovered_total",
		Help: "Panics recovered inside one request or connection handler (the request failed, the process carried on), by where they happened.",
	}, []string{"where"})
	if reg != nil {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if errors.As(err, &are) {
				if existing, ok := are.ExistingCollector.(*prometheus.CounterVec); ok {
					c = existing
				}
			}
			// Any other conflict (the name registered with other labels):
			// keep counting, just do not export, as the raft metrics do.
		}
	}
	return &Guard{log: log, panics: c}
}

// fallback serves nil *Guard receivers.
var fallback = New(nil, nil)

func (g *Guard) get() *Guard {
	if g == nil {
		return fallback
	}
	return g
}

// Recovered returns how many panics the guard's counter holds for where
// (for tests and status pages; it exports a zero series for a where that
// never panicked).
func (g *Guard) Recovered(where string) uint64 {
	g = g.get()
	c, err := g.panics.GetMetricWithLabelValues(where)
	if err != nil {
		return 0
	}
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return 0
	}
	return uint64(m.GetCounter().GetValue())
}

// handle records a recovered panic value and returns it as an error.
// It must be called from the deferred function that recovered, so the
// stack is the panicking goroutine's.
func (g *Guard) handle(where string, v any) *PanicError {
	g = g.get()
	pe := &PanicError{Where: where, Value: v, Stack: debug.Stack()}
	g.panics.WithLabelValues(where).Inc()
	g.log.Error("recovered a panic; the request fails, the process carries on",
		"where", where, "panic", fmt.Sprint(v), "stack", string(pe.Stack))
	return pe
}

// Run calls fn and returns its error, or a *PanicError if fn panicked.
func (g *Guard) Run(where string, fn func() error) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = g.handle(where, v)
		}
	}()
	return fn()
}

// Go runs fn on a new goroutine under the guard. onPanic, if not nil, is
// called with the recovered panic (on that goroutine), e.g. to fail the
// work fn was part of.
func (g *Guard) Go(where string, fn func(), onPanic func(*PanicError)) {
	go func() {
		err := g.Run(where, func() error { fn(); return nil })
		var pe *PanicError
		if onPanic != nil && errors.As(err, &pe) {
			onPanic(pe)
		}
	}()
}

// Run is Guard.Run on a guard that is not exported anywhere; for code that
// has no registry at hand.
func Run(where string, fn func() error) error { return fallback.Run(where, fn) }

// UnaryServerInterceptor returns a gRPC interceptor that turns a panic in
// the handler (or in interceptors after it in the chain) into a
// codes.Internal status naming the method. Put it first in the chain.
func (g *Guard) UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
		defer func() {
			if v := recover(); v != nil {
				resp, err = nil, g.status(info.FullMethod, v)
			}
		}()
		return handler(ctx, req)
	}
}

// StreamServerInterceptor is UnaryServerInterceptor for streaming calls:
// the stream ends with codes.Internal.
func (g *Guard) StreamServerInterceptor() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) (err error) {
		defer func() {
			if v := recover(); v != nil {
				err = g.status(info.FullMethod, v)
			}
		}()
		return handler(srv, ss)
	}
}

func (g *Guard) status(method string, v any) error {
	pe := g.handle(method, v)
	// The panic value helps whoever reads the client's error find the
	// server's log line; the stack stays in the log.
	return status.Errorf(codes.Internal, "internal error serving %s: recovered panic: %s (stack in the server log)", method, pe.value())
}

// UnaryServerInterceptor is New(reg, log).UnaryServerInterceptor(), for
// wiring a server in one line. Guards made this way on one registry share
// their counter.
func UnaryServerInterceptor(reg prometheus.Registerer, log *slog.Logger) grpc.UnaryServerInterceptor {
	return New(reg, log).UnaryServerInterceptor()
}

// StreamServerInterceptor is New(reg, log).StreamServerInterceptor().
func StreamServerInterceptor(reg prometheus.Registerer, log *slog.Logger) grpc.StreamServerInterceptor {
	return New(reg, log).StreamServerInterceptor()
}
