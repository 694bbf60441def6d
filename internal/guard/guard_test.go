package guard

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// syncBuffer is a log sink the server's goroutines may share.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func newTestGuard(t *testing.T) (*Guard, *prometheus.Registry, *syncBuffer) {
	t.Helper()
	reg := prometheus.NewRegistry()
	var logs syncBuffer
	return New(reg, slog.New(slog.NewTextHandler(&logs, nil))), reg, &logs
}

// panicky is a health service whose calls panic for the service "boom".
type panicky struct {
	healthpb.UnimplementedHealthServer
}

func (panicky) Check(_ context.Context, r *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	if r.Service == "boom" {
		var m map[string]int
		m["x"] = 1 // a nil-map write: a runtime error, as a real bug would be
	}
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}

func (panicky) Watch(r *healthpb.HealthCheckRequest, s grpc.ServerStreamingServer[healthpb.HealthCheckResponse]) error {
	if r.Service == "boom" {
		panic("watch exploded")
	}
	return s.Send(&healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING})
}

func TestGRPCPanicBecomesInternal(t *testing.T) {
	g, reg, logs := newTestGuard(t)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(g.UnaryServerInterceptor()), grpc.ChainStreamInterceptor(g.StreamServerInterceptor()))
	healthpb.RegisterHealthServer(srv, panicky{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(lis)
	defer srv.Stop()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	hc := healthpb.NewHealthClient(cc)
	ctx := context.Background()

	const check = "/grpc.health.v1.Health/Check"
	for i := 1; i <= 2; i++ {
		_, err = hc.Check(ctx, &healthpb.HealthCheckRequest{Service: "boom"})
		st := status.Convert(err)
		if st.Code() != codes.Internal || !strings.Contains(st.Message(), check) {
			t.Fatalf("panicking call: got %v, want Internal naming %s", err, check)
		}
		if strings.Contains(st.Message(), "goroutine") || strings.Contains(st.Message(), ".go:") {
			t.Fatalf("the client's error carries the stack: %q", st.Message())
		}
		// The server still serves the next call.
		if r, err := hc.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil || r.Status != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("call after the panic: %v, %v", r, err)
		}
		if got := g.Recovered(check); got != uint64(i) {
			t.Fatalf("recovered count %d after %d panics", got, i)
		}
	}

	ws, err := hc.Watch(ctx, &healthpb.HealthCheckRequest{Service: "boom"})
	if err == nil {
		_, err = ws.Recv()
	}
	if st := status.Convert(err); st.Code() != codes.Internal || !strings.Contains(st.Message(), "/grpc.health.v1.Health/Watch") {
		t.Fatalf("panicking stream: got %v", err)
	}
	ws, err = hc.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err == nil {
		_, err = ws.Recv()
	}
	if err != nil {
		t.Fatalf("stream after the panic: %v", err)
	}

	if n := testutil.CollectAndCount(reg, "basalt_panics_recovered_total"); n != 2 {
		t.Fatalf("registry exports %d series of basalt_panics_recovered_total, want 2 (Check, Watch)", n)
	}
	out := logs.String()
	for _, want := range []string{"assignment to entry in nil map", "watch exploded", "guard_test.go", "goroutine"} {
		if !strings.Contains(out, want) {
			t.Fatalf("log lacks %q (the panic and its stack):\n%s", want, out)
		}
	}
}

func TestHTTP(t *testing.T) {
	g, _, _ := newTestGuard(t)
	h := g.HTTP("s3", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/boom":
			panic("handler bug")
		case "/late":
			w.WriteHeader(http.StatusOK)
			io.WriteString(w, "partial")
			w.(http.Flusher).Flush()
			panic("bug after the response started")
		case "/abort":
			panic(http.ErrAbortHandler)
		}
		io.WriteString(w, "ok")
	}), func(w http.ResponseWriter, r *http.Request, err *PanicError) {
		w.WriteHeader(http.StatusInternalServerError)
		io.WriteString(w, "<Error><Code>InternalError</Code></Error>")
	})
	srv := httptest.NewServer(h)
	defer srv.Close()
	get := func(path string) (int, string, error) {
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b), err
	}
	code, body, err := get("/boom")
	if err != nil || code != 500 || !strings.Contains(body, "InternalError") {
		t.Fatalf("panicking request: %d %q %v", code, body, err)
	}
	if code, body, err := get("/ok"); err != nil || code != 200 || body != "ok" {
		t.Fatalf("request after the panic: %d %q %v", code, body, err)
	}
	// A response already under way is cut off, not completed as a 200.
	if _, body, err := get("/late"); err == nil {
		t.Fatalf("a response that panicked midway read as complete: %q", body)
	}
	if _, _, err := get("/abort"); err == nil {
		t.Fatal("ErrAbortHandler did not abort")
	}
	if got := g.Recovered("s3"); got != 2 {
		t.Fatalf("recovered %d, want 2 (ErrAbortHandler is not a bug)", got)
	}
}

func TestRunAndGo(t *testing.T) {
	g, _, _ := newTestGuard(t)
	want := errors.New("plain")
	if err := g.Run("conn", func() error { return want }); err != want {
		t.Fatalf("Run returned %v, want fn's error", err)
	}
	err := g.Run("conn", func() error {
		var s []int
		_ = s[3]
		return nil
	})
	var pe *PanicError
	var re runtime.Error
	if !errors.As(err, &pe) || pe.Where != "conn" || !errors.As(err, &re) || !bytes.Contains(pe.Stack, []byte("guard_test.go")) {
		t.Fatalf("Run of a panicking fn: %v", err)
	}
	done := make(chan *PanicError)
	g.Go("conn", func() { panic("in a goroutine") }, func(pe *PanicError) { done <- pe })
	if pe := <-done; pe.Value != "in a goroutine" {
		t.Fatalf("Go reported %v", pe)
	}
	if g.Recovered("conn") != 2 {
		t.Fatalf("recovered %d, want 2", g.Recovered("conn"))
	}
	// A nil guard still recovers.
	var ng *Guard
	if err := ng.Run("x", func() error { panic(1) }); !errors.As(err, &pe) {
		t.Fatalf("nil guard: %v", err)
	}
}

// TestSharedRegistry: guards made one per server on one registry export
// one counter instead of failing to register.
func TestSharedRegistry(t *testing.T) {
	reg := prometheus.NewRegistry()
	a, b := New(reg, slog.New(slog.DiscardHandler)), New(reg, slog.New(slog.DiscardHandler))
	a.Run("a", func() error { panic("x") })
	b.Run("b", func() error { panic("x") })
	if n := testutil.CollectAndCount(reg, "basalt_panics_recovered_total"); n != 2 {
		t.Fatalf("%d series exported, want 2", n)
	}
}
