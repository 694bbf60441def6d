package main

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/basalt-store/basalt/internal/s3"
)

// s3Cmd runs an S3 gateway. Gateways keep no state: run as many as needed.
func s3Cmd() *cobra.Command {
	var cfg s3.Config
	var metas, domains, metricsAddr, logLevel, tokenFile, proxies string
	var tf tlsFlags
	cmd := &cobra.Command{
		Use:   "s3",
		Short: "Run an S3 REST gateway",
		Long: `Run a stateless S3 REST gateway over the cluster. Buckets are the buckets of
volume s3v (created on first use). Requests are signed with AWS Signature V4
using access keys made by 'basalt admin s3 create-key'. Virtual-host-style
requests work for hosts "<bucket>.<domain>" of the --domain list. Unsigned
requests are anonymous: served only where a bucket's ACL or policy grants
anonymous access. With --tls-cert and --tls-key the gateway serves HTTPS
only. /metrics and /debug/pprof (--debug-addr) listen on loopback unless the
address names a host.`,
		Example: `  basalt s3 --meta 10.0.0.1:9862 --listen :9878 --domain s3.example.com --debug-addr :9879 \
    --service-token-file /etc/basalt/service-token --tls-dir /etc/basalt/s3-tls \
    --tls-cert /etc/basalt/s3-https/cert.pem --tls-key /etc/basalt/s3-https/key.pem`,
		RunE: func(cmd *cobra.Command, args []string) error {
			cfg.MetaAddrs = splitList(metas)
			cfg.Domains = splitList(domains)
			cfg.TrustedProxies = splitList(proxies)
			if (cfg.TLSCertFile == "") != (cfg.TLSKeyFile == "") {
				return &usageError{"--tls-cert and --tls-key go together"}
			}
			tok, err := readServiceToken(tokenFile)
			if err != nil {
				return err
			}
			if tok == "" {
				return &usageError{"no service token: pass --service-token-file (the meta node's DATA_DIR/service-token) or set " + envServiceToken}
			}
			cfg.ServiceToken = tok
			if cfg.Credentials, err = tf.load(nil); err != nil {
				return err
			}
			reg := newRegistry()
			cfg.Registerer = reg
			cfg.Logger = serverLogger(logLevel)
			g, err := s3.New(cfg)
			if err != nil {
				return err
			}
			defer g.Close()
			stop, debugAddr, err := serveDebug(metricsAddr, reg)
			if err != nil {
				return err
			}
			defer stop()
			errc := make(chan error, 1)
			go func() { errc <- g.Serve() }()
			scheme := "http"
			if g.TLS() {
				scheme = "https"
			}
			fmt.Printf("basalt s3: %s://%s (region %s, volume %s)\n", scheme, g.Addr(), cfg.Region, cfg.Volume)
			if debugAddr != "" {
				fmt.Printf("basalt s3: /metrics and /debug/pprof on http://%s\n", debugAddr)
			}
			go func() { waitSignal(); errc <- nil }()
			return <-errc
		},
	}
	cmd.Flags().StringVar(&metas, "meta", "127.0.0.1:9862", "metadata service address(es), comma-separated")
	cmd.Flags().StringVar(&cfg.Listen, "listen", ":9878", "HTTP listen address")
	cmd.Flags().StringVar(&cfg.Region, "region", s3.DefaultRegion, "the gateway's region: requests must be signed for it; GetBucketLocation reports it")
	cmd.Flags().StringVar(&tokenFile, "service-token-file", "", "file holding the cluster service token (a meta node's DATA_DIR/service-token; default $"+envServiceTokenFile+", or the token in $"+envServiceToken+")")
	cmd.Flags().IntVar(&cfg.MaxUploads, "max-uploads", 32, "data-moving PUTs served at once (each holds up to a 16 MiB write buffer); more wait")
	cmd.Flags().DurationVar(&cfg.UploadWait, "upload-wait", s3.DefaultUploadWait, "how long a PUT waits for an upload slot before SlowDown (503)")
	cmd.Flags().DurationVar(&cfg.BodyIdleTimeout, "body-idle-timeout", s3.DefaultBodyIdleTimeout, "fail a request whose body sends nothing (or cut a response nobody reads) for this long")
	cmd.Flags().DurationVar(&cfg.ReadHeaderTimeout, "read-header-timeout", s3.DefaultReadHeaderTimeout, "how long a client may take to send a request's headers")
	cmd.Flags().DurationVar(&cfg.BucketOwnerTTL, "bucket-owner-ttl", s3.DefaultOwnerTTL, "how long a bucket's owner is cached for access checks")
	cmd.Flags().StringVar(&domains, "domain", "", "comma-separated domains for virtual-host-style requests (<bucket>.<domain>)")
	cmd.Flags().StringVar(&cfg.Volume, "volume", s3.DefaultVolume, "volume holding the S3 buckets")
	cmd.Flags().StringVar(&cfg.TLSCertFile, "tls-cert", "", "serve HTTPS with this certificate (PEM, with its chain); plain HTTP is then not served")
	cmd.Flags().StringVar(&cfg.TLSKeyFile, "tls-key", "", "the private key (PEM) of --tls-cert")
	cmd.Flags().StringVar(&proxies, "trusted-proxy", "", "comma-separated addresses or CIDRs of reverse proxies whose X-Forwarded-For names the client (for bucket policies' aws:SourceIp); by default the connection's peer is the client")
	debugFlags(cmd, &metricsAddr)
	cmd.Flags().StringVar(&logLevel, "log-level", "warn", "debug, info, warn or error")
	tf.register(cmd, false, false)
	return cmd
}

// Where S3 gateways and admin tools find the cluster service token: the
// --service-token-file flag, else $BASALT_SERVICE_TOKEN (the token), else
// $BASALT_SERVICE_TOKEN_FILE.
const (
	envServiceToken     = "BASALT_SERVICE_TOKEN"
	envServiceTokenFile = "BASALT_SERVICE_TOKEN_FILE"
)

// readServiceToken returns the service token ("" if none is configured).
func readServiceToken(file string) (string, error) {
	if file == "" {
		if tok := strings.TrimSpace(os.Getenv(envServiceToken)); tok != "" {
			return tok, nil
		}
		file = os.Getenv(envServiceTokenFile)
	}
	if file == "" {
		return "", nil
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return "", fmt.Errorf("reading the service token: %w", err)
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return "", errors.New("service token file " + file + " is empty")
	}
	return tok, nil
}
