package main

import (
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
)

// Gateways' debug endpoints (/metrics and /debug/pprof): pprof shows the
// process's memory and stacks, so they listen on loopback unless the
// address names another host.

// debugListenAddr makes a host-less address (":9879") a loopback one;
// "0.0.0.0:9879" or a named host is taken as asked.
func debugListenAddr(addr string) (string, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("debug address %q: %w", addr, err)
	}
	if host == "" {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(host, port), nil
}

// serveDebug serves /metrics and /debug/pprof on addr ("" = off), made
// loopback-only by debugListenAddr. It fails when addr cannot be
// listened on, rather than running without them.
func serveDebug(addr string, reg *prometheus.Registry) (stop func(), bound string, err error) {
	if addr == "" {
		return func() {}, "", nil
	}
	if addr, err = debugListenAddr(addr); err != nil {
		return nil, "", err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, "", fmt.Errorf("debug endpoints: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.Handle("/debug/pprof/", http.DefaultServeMux)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(ln)
	return func() { srv.Close() }, ln.Addr().String(), nil
}

// debugFlags registers --debug-addr and its older name --metrics.
func debugFlags(cmd *cobra.Command, addr *string) {
	cmd.Flags().StringVar(addr, "debug-addr", "", "serve /metrics and /debug/pprof on this address (off by default; \":PORT\" is loopback only, name a host such as 0.0.0.0:PORT to expose them)")
	cmd.Flags().StringVar(addr, "metrics", "", "old name of --debug-addr")
	cmd.Flags().MarkHidden("metrics")
}
