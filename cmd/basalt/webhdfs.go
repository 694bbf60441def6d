package main

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/basalt-store/basalt/internal/webhdfs"
)

// webhdfsCmd runs a WebHDFS gateway. Gateways keep no state: run as many
// as needed.
func webhdfsCmd() *cobra.Command {
	var cfg webhdfs.Config
	var metas, metricsAddr, logLevel string
	var tf tlsFlags
	cmd := &cobra.Command{
		Use:   "webhdfs",
		Short: "Run a WebHDFS gateway (Hadoop FileSystem over fs buckets)",
		Long: `Run a stateless WebHDFS REST gateway over the cluster, for Hadoop clients
(webhdfs://HOST:PORT/). Paths are /volume/bucket/path as in Ozone's ofs:
"/" lists volumes, "/volume" its buckets; buckets must have the FS layout.
MKDIRS creates missing volumes and buckets (FS layout).`,
		Example: `  basalt webhdfs --meta 10.0.0.1:9862 --listen :9870 --tls-dir /etc/basalt/webhdfs-tls
  hadoop fs -ls webhdfs://gateway:9870/vol1/bucket1/`,
		RunE: func(cmd *cobra.Command, args []string) error {
			cfg.MetaAddrs = splitList(metas)
			cfg.Logger = serverLogger(logLevel)
			var err error
			if cfg.Credentials, err = tf.load(nil); err != nil {
				return err
			}
			g, err := webhdfs.New(cfg)
			if err != nil {
				return err
			}
			defer g.Close()
			stop, _, err := serveDebug(metricsAddr, newRegistry())
			if err != nil {
				return err
			}
			defer stop()
			errc := make(chan error, 1)
			go func() { errc <- g.Serve() }()
			fmt.Printf("basalt webhdfs: http://%s%s (webhdfs://%s/)\n", g.Addr(), webhdfs.Prefix, g.Addr())
			go func() { waitSignal(); errc <- nil }()
			return <-errc
		},
	}
	cmd.Flags().StringVar(&metas, "meta", "127.0.0.1:9862", "metadata service address(es), comma-separated")
	cmd.Flags().StringVar(&cfg.Listen, "listen", fmt.Sprintf(":%d", webhdfs.DefaultPort), "HTTP listen address")
	cmd.Flags().IntVar(&cfg.MaxTransfers, "max-transfers", webhdfs.DefaultMaxTransfers, "OPEN and CREATE requests moving data at once (each holds up to a 16 MiB buffer); more wait")
	cmd.Flags().DurationVar(&cfg.TransferWait, "transfer-wait", webhdfs.DefaultTransferWait, "how long a transfer waits for a slot before RetriableException (503)")
	debugFlags(cmd, &metricsAddr)
	cmd.Flags().StringVar(&logLevel, "log-level", "warn", "debug, info, warn or error")
	tf.register(cmd, false, false)
	return cmd
}
