package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/basalt-store/basalt/internal/raft"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
)

func devCmd() *cobra.Command {
	var dataDir, metricsAddr string
	var groups int
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Run the embedded default cluster in one process",
		Long: `Run the embedded default cluster in one process, with its data under --data-dir.

At this stage of the project the cluster is the replication layer: three
multi-raft hosts on loopback, each in --groups Raft groups of three replicas,
with a small proposal load so that progress shows. Metrics are served on
--metrics.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runDev(cmd.Context(), dataDir, metricsAddr, groups)
		},
	}
	cmd.Flags().StringVar(&dataDir, "data-dir", "./basalt-data", "where the cluster keeps its data")
	cmd.Flags().StringVar(&metricsAddr, "metrics", "127.0.0.1:9876", "Prometheus /metrics address")
	cmd.Flags().IntVar(&groups, "groups", 16, "Raft groups to host")
	return cmd
}

// devSM is the demo state machine: it counts applied entries.
type devSM struct{ applied uint64 }

func (s *devSM) Apply(ents []raft.Entry) []any {
	s.applied = ents[len(ents)-1].Index
	return nil
}
func (s *devSM) AppliedIndex() uint64 { return 0 } // in memory only: replay the log on restart
func (s *devSM) Snapshot() (uint64, io.ReadCloser, error) {
	return 0, nil, fmt.Errorf("dev state machine has no snapshots")
}
func (s *devSM) Restore(uint64, io.Reader) error { return nil }

func runDev(ctx context.Context, dataDir, metricsAddr string, groups int) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	reg := prometheus.NewRegistry()
	reg.MustRegister(prometheus.NewGoCollector(), prometheus.NewProcessCollector(prometheus.ProcessCollectorOpts{}))
	addrs := map[uint64]string{}
	resolve := func(id uint64) (string, error) {
		a, ok := addrs[id]
		if !ok {
			return "", fmt.Errorf("unknown host %d", id)
		}
		return a, nil
	}
	var hosts []*raft.Host
	defer func() {
		for _, h := range hosts {
			h.Close()
		}
	}()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	for id := uint64(1); id <= 3; id++ {
		h, err := raft.NewHost(raft.HostConfig{
			ID: id, LogDirs: []string{filepath.Join(dataDir, fmt.Sprintf("host%d", id), "raft")},
			ListenAddr: "127.0.0.1:0", Resolve: resolve, Registerer: reg, Logger: logger,
		})
		if err != nil {
			return err
		}
		addrs[id] = h.Addr()
		hosts = append(hosts, h)
	}
	for _, h := range hosts {
		for g := 1; g <= groups; g++ {
			if _, err := h.AddGroup(raft.GroupConfig{ID: uint64(g), Peers: []uint64{1, 2, 3}, StateMachine: &devSM{}}); err != nil {
				return err
			}
		}
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Addr: metricsAddr, Handler: mux}
	go srv.ListenAndServe()
	defer srv.Close()
	fmt.Printf("basalt dev: 3 raft hosts, %d groups, data in %s\n", groups, dataDir)
	for i, h := range hosts {
		fmt.Printf("  host %d  raft %s\n", i+1, h.Addr())
	}
	fmt.Printf("  metrics http://%s/metrics\n", metricsAddr)
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			fmt.Println("basalt dev: stopping")
			return nil
		case <-t.C:
		}
		committed := 0
		for g := 1; g <= groups; g++ {
			for _, h := range hosts {
				grp, err := h.Group(uint64(g))
				if err != nil || !grp.IsLeader() {
					continue
				}
				pctx, cancel := context.WithTimeout(ctx, time.Second)
				if _, err := grp.Propose(pctx, []byte("tick"), nil); err == nil {
					committed++
				}
				cancel()
			}
		}
		fmt.Printf("%s  groups with a leader that committed this second: %d/%d\n", time.Now().Format("15:04:05"), committed, groups)
	}
}
