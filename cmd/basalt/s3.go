package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/basalt-store/basalt/internal/s3"
)

// s3Cmd runs an S3 gateway. Gateways keep no state: run as many as needed.
func s3Cmd() *cobra.Command {
	var cfg s3.Config
	var metas, domains, metricsAddr, logLevel string
	cmd := &cobra.Command{
		Use:   "s3",
		Short: "Run an S3 REST gateway",
		Long: `Run a stateless S3 REST gateway over the cluster. Buckets are the buckets of
volume s3v (created on first use). Requests are signed with AWS Signature V4
using access keys made by 'basalt admin s3 create-key'. Virtual-host-style
requests work for hosts "<bucket>.<domain>" of the --domain list.`,
		Example: `  basalt s3 --meta 10.0.0.1:9862 --listen :9878 --domain s3.example.com --metrics :9879`,
		RunE: func(cmd *cobra.Command, args []string) error {
			cfg.MetaAddrs = splitList(metas)
			cfg.Domains = splitList(domains)
			reg := newRegistry()
			cfg.Registerer = reg
			cfg.Logger = serverLogger(logLevel)
			g, err := s3.New(cfg)
			if err != nil {
				return err
			}
			defer g.Close()
			stop := serveMetrics(metricsAddr, reg)
			defer stop()
			errc := make(chan error, 1)
			go func() { errc <- g.Serve() }()
			fmt.Printf("basalt s3: http://%s (region %s, volume %s)\n", g.Addr(), cfg.Region, cfg.Volume)
			go func() { waitSignal(); errc <- nil }()
			return <-errc
		},
	}
	cmd.Flags().StringVar(&metas, "meta", "127.0.0.1:9862", "metadata service address(es), comma-separated")
	cmd.Flags().StringVar(&cfg.Listen, "listen", ":9878", "HTTP listen address")
	cmd.Flags().StringVar(&cfg.Region, "region", s3.DefaultRegion, "region reported by GetBucketLocation")
	cmd.Flags().StringVar(&domains, "domain", "", "comma-separated domains for virtual-host-style requests (<bucket>.<domain>)")
	cmd.Flags().StringVar(&cfg.Volume, "volume", s3.DefaultVolume, "volume holding the S3 buckets")
	cmd.Flags().StringVar(&metricsAddr, "metrics", "", "serve /metrics and /debug/pprof on this address")
	cmd.Flags().StringVar(&logLevel, "log-level", "warn", "debug, info, warn or error")
	return cmd
}
