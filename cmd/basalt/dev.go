package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	_ "net/http/pprof"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"

	"github.com/basalt-store/basalt/internal/cluster"
)

// devBasePort: the embedded cluster's fixed ports, so that clients find it
// (`--meta 127.0.0.1:9862` is the default everywhere) and a restart keeps
// its addresses.
const devBasePort = 9862

func devCmd() *cobra.Command {
	var dataDir, metricsAddr string
	var datanodes, basePort int
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Run the embedded default cluster (1 meta node, 3 datanodes on two racks) in one process",
		Long: `Run the embedded default cluster in one process: one metadata node and
three datanodes with their own directories, ports and network locations
(/dc1/rack1 and /dc1/rack2). Data lives under --data-dir and survives a
restart. Stop it with Ctrl-C.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runDev(dataDir, metricsAddr, datanodes, basePort)
		},
	}
	cmd.Flags().StringVar(&dataDir, "data-dir", "./basalt-data", "where the cluster keeps its data")
	cmd.Flags().StringVar(&metricsAddr, "metrics", "127.0.0.1:9860", "Prometheus /metrics and /debug/pprof address")
	cmd.Flags().IntVar(&datanodes, "datanodes", 3, "number of datanodes")
	cmd.Flags().IntVar(&basePort, "base-port", devBasePort, "meta gRPC port; the other ports follow it")
	return cmd
}

func runDev(dataDir, metricsAddr string, datanodes, basePort int) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	fmt.Printf("basalt dev: starting 1 meta node and %d datanodes, data in %s\n", datanodes, dataDir)
	sctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	c, err := cluster.Start(sctx, cluster.Config{Dir: dataDir, Datanodes: datanodes, BasePort: basePort, Registerer: reg, Logger: logger})
	cancel()
	if err != nil {
		return err
	}
	defer c.Close()
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.Handle("/debug/pprof/", http.DefaultServeMux)
	srv := &http.Server{Addr: metricsAddr, Handler: mux}
	go srv.ListenAndServe()
	defer srv.Close()
	fmt.Printf("  meta      %s   (clients: --meta %s)\n", c.MetaAddr(), c.MetaAddr())
	for i := 0; i < datanodes; i++ {
		dn := c.Datanode(i)
		fmt.Printf("  datanode  id %d  data %s  raft %s\n", dn.ID(), dn.Addr(), dn.RaftAddr())
	}
	fmt.Printf("  metrics   http://%s/metrics\n", metricsAddr)
	fmt.Println("ready. Try: basalt sh volume create /vol1 && basalt sh bucket create /vol1/bucket1 && basalt sh key put /vol1/bucket1/hello README.md")
	<-ctx.Done()
	fmt.Println("basalt dev: stopping")
	return nil
}
