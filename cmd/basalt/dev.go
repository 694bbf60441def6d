package main

import (
	"context"
	"fmt"
	"log/slog"
	_ "net/http/pprof"
	"os"
	"os/signal"
	"os/user"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/meta"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/s3"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/storage/zoned"
	"github.com/basalt-store/basalt/internal/vfs"
	"github.com/basalt-store/basalt/internal/webhdfs"
)

// devBasePort: the embedded cluster's fixed ports, so that clients find it
// (`--meta 127.0.0.1:9862` is the default everywhere) and a restart keeps
// its addresses.
const devBasePort = 9862

func devCmd() *cobra.Command {
	var dataDir, metricsAddr, s3Addr, webhdfsAddr, zonedSpec, admins, cacheDir, cacheSize string
	var s3TLS [2]string
	var datanodes, basePort int
	var insecure bool
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Run the embedded default cluster (1 meta node, 3 datanodes on two racks) in one process",
		Long: `Run the embedded default cluster in one process: one metadata node and
three datanodes with their own directories, ports and network locations
(/dc1/rack1 and /dc1/rack2). Data lives under --data-dir and survives a
restart. Stop it with Ctrl-C.

Every internal port is mutual TLS: the first start makes a cluster CA and a
certificate for every component under DATA_DIR/tls (kept across restarts),
including DATA_DIR/tls/client-cli, which basalt sh, admin and bench find by
themselves when run from the same directory (else --tls-dir or $` + envTLSDir + `).
The metadata service also records that CA in Raft, so ` + "`basalt admin ca token create`" + `
makes bootstrap tokens for more datanodes (basalt datanode --bootstrap-token).`,
		RunE: func(cmd *cobra.Command, args []string) error {
			var so storage.Options
			if zonedSpec != "" {
				nb, err := devZoned(zonedSpec, datanodes)
				if err != nil {
					return usagef("%v", err)
				}
				so.NewBackend = nb
			}
			if (s3TLS[0] == "") != (s3TLS[1] == "") {
				return usagef("--s3-tls-cert and --s3-tls-key go together")
			}
			cacheBytes, err := parseSize(cacheSize)
			if err != nil || cacheBytes <= 0 {
				return usagef("--cache-bytes %q: want a positive size such as 1GiB", cacheSize)
			}
			return runDev(dataDir, metricsAddr, s3Addr, webhdfsAddr, cmd.Flags().Changed("webhdfs"), datanodes, basePort, insecure, so, splitList(admins), s3TLS, cmd.Flags().Changed("metrics"), cacheDir, cacheBytes)
		},
	}
	cmd.Flags().StringVar(&dataDir, "data-dir", "./basalt-data", "where the cluster keeps its data")
	cmd.Flags().StringVar(&metricsAddr, "metrics", "127.0.0.1:9860", "Prometheus /metrics and /debug/pprof address (\":PORT\" is loopback only)")
	cmd.Flags().StringVar(&s3Addr, "s3", "127.0.0.1:9878", "S3 gateway address")
	cmd.Flags().StringVar(&s3TLS[0], "s3-tls-cert", "", "the S3 gateway serves HTTPS with this certificate (PEM) instead of HTTP")
	cmd.Flags().StringVar(&s3TLS[1], "s3-tls-key", "", "the private key (PEM) of --s3-tls-cert")
	cmd.Flags().StringVar(&webhdfsAddr, "webhdfs", fmt.Sprintf("127.0.0.1:%d", webhdfs.DefaultPort), "WebHDFS gateway address (the NameNode's HTTP port); \"\" = off")
	cmd.Flags().IntVar(&datanodes, "datanodes", 3, "number of datanodes")
	cmd.Flags().StringVar(&cacheDir, "cache-dir", "", "the datanodes' cache tiers under DIR/dnN (a DAX-mounted pmem file system; docs/CACHE.md) instead of DATA_DIR/dnN/cache")
	cmd.Flags().StringVar(&cacheSize, "cache-bytes", "1GiB", "capacity of each datanode's cache tier")
	cmd.Flags().IntVar(&basePort, "base-port", devBasePort, "meta gRPC port; the other ports follow it")
	cmd.Flags().StringVar(&admins, "admins", loginName(), "administrators besides the CLI's certificate (client-"+cluster.ClientID.ID+"), comma-separated: by default your login name, so that Hadoop clients (WebHDFS user.name) may create volumes")
	cmd.Flags().BoolVar(&insecure, "insecure-no-tls", false, "DANGEROUS: run every port in plaintext with no authentication (only to measure what TLS costs; clients need --insecure-no-tls too)")
	cmd.Flags().StringVar(&zonedSpec, "zoned", "", "store block data on zoned volumes: --zoned alone emulates a zonefs per datanode (DATA_DIR/dnN/data/basalt/zonefs); --zoned=/mnt/z1,/mnt/z2,/mnt/z3 uses one real zonefs mount per datanode")
	cmd.Flags().Lookup("zoned").NoOptDefVal = "emulate"
	return cmd
}

// devZoned is the backend hook of basalt dev --zoned: an emulated zonefs
// in each datanode's volume, or the given mounts, one per datanode.
func devZoned(spec string, datanodes int) (func(fs vfs.FS, dir string) (storage.BlockFiles, error), error) {
	if spec == "emulate" {
		return zoned.Emulated(zoned.DevGeometry, nil), nil
	}
	mounts := splitList(spec)
	if len(mounts) != datanodes {
		return nil, fmt.Errorf("--zoned names %d mounts for %d datanodes", len(mounts), datanodes)
	}
	return func(fs vfs.FS, dir string) (storage.BlockFiles, error) {
		// dir is DATA_DIR/dnN/data/basalt/containers.
		var n int
		if _, err := fmt.Sscanf(filepath.Base(filepath.Dir(filepath.Dir(filepath.Dir(dir)))), "dn%d", &n); err != nil || n < 1 || n > len(mounts) {
			return nil, fmt.Errorf("no zoned mount for volume %s", dir)
		}
		root := filepath.Dir(dir)
		return zoned.New(zoned.Config{Mount: mounts[n-1], MetaDir: filepath.Join(root, "zoned"), MetaFS: fs})
	}, nil
}

// devS3Key returns the dev cluster's access key, creating it on first use.
func devS3Key(ctx context.Context, metaAddr, token string, creds *pki.Credentials) (string, string, error) {
	const id = "basalt-dev"
	cl, err := client.New(client.Config{MetaAddrs: []string{metaAddr}, ServiceToken: token, Credentials: creds})
	if err != nil {
		return "", "", err
	}
	defer cl.Close()
	// The dev key is an admin: it acts on every bucket, including those
	// made before buckets had owners. A key from before admins existed is
	// made one again, with the same secret, so clients keep working.
	secret := ""
	if s, err := cl.Namespace().GetS3Secret(ctx, &metapb.GetS3SecretRequest{AccessKeyId: id}); err == nil {
		if s.Admin {
			return id, s.GetSecretAccessKey(), nil
		}
		secret = s.GetSecretAccessKey()
		if _, err := cl.Namespace().DeleteS3Secret(ctx, &metapb.DeleteS3SecretRequest{AccessKeyId: id}); err != nil {
			return "", "", fmt.Errorf("dev: making the S3 key an admin: %w", err)
		}
	}
	s, err := cl.Namespace().CreateS3Secret(ctx, &metapb.CreateS3SecretRequest{AccessKeyId: id, Owner: "dev", SecretAccessKey: secret, Admin: true})
	if err != nil {
		return "", "", fmt.Errorf("dev: creating the S3 key: %w", err)
	}
	return id, s.GetSecretAccessKey(), nil
}

func runDev(dataDir, metricsAddr, s3Addr, webhdfsAddr string, webhdfsAsked bool, datanodes, basePort int, insecure bool, so storage.Options, admins []string, s3TLS [2]string, metricsAsked bool, cacheDir string, cacheBytes int64) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	fmt.Printf("basalt dev: starting 1 meta node and %d datanodes, data in %s\n", datanodes, dataDir)
	sctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	if insecure {
		fmt.Println("basalt dev: WARNING: --insecure-no-tls: every port is PLAINTEXT and accepts ANYONE (for measuring what TLS costs only)")
	}
	agents := &devCertAgents{}
	c, err := cluster.Start(sctx, cluster.Config{Dir: dataDir, Admins: admins, Datanodes: datanodes, BasePort: basePort, Registerer: reg, Logger: logger, Insecure: insecure, Storage: so,
		CacheBytes: cacheBytes, CacheRoot: cacheDir, // a cache tier per datanode (docs/CACHE.md)
		DatanodeConfig: agents.hook})
	cancel()
	if err != nil {
		return err
	}
	defer c.Close()
	// As `basalt datanode` does: each datanode renews its certificate and
	// keeps the revoked serials current (stopped before the cluster).
	defer agents.start(c.MetaAddr(), cluster.TLSDir(dataDir), logger)()
	// As for WebHDFS: the default port may be another dev cluster's.
	stopDebug, debugAddr, err := serveDebug(metricsAddr, reg)
	if err != nil && metricsAsked {
		return err
	}
	if err != nil {
		fmt.Printf("  metrics   not served: %v (pass --metrics ADDR)\n", err)
	} else {
		defer stopDebug()
	}
	fmt.Printf("  meta      %s   (clients: --meta %s)\n", c.MetaAddr(), c.MetaAddr())
	for i := 0; i < datanodes; i++ {
		dn := c.Datanode(i)
		fmt.Printf("  datanode  id %d  data %s  raft %s\n", dn.ID(), dn.Addr(), dn.RaftAddr())
	}
	// The S3 gateway, with a ready access key (made once, kept in the
	// namespace manager like any other).
	keyID, secret, err := devS3Key(ctx, c.MetaAddr(), c.ServiceToken(), c.ClientCredentials())
	if err != nil {
		return err
	}
	s3Creds, err := c.GatewayCredentials("s3")
	if err != nil {
		return err
	}
	gw, err := s3.New(s3.Config{MetaAddrs: []string{c.MetaAddr()}, ServiceToken: c.ServiceToken(), Listen: s3Addr, Registerer: reg, Credentials: s3Creds,
		TLSCertFile: s3TLS[0], TLSKeyFile: s3TLS[1]})
	if err != nil {
		return err
	}
	go gw.Serve()
	defer gw.Close()
	scheme := "http"
	if gw.TLS() {
		scheme = "https"
	}
	fmt.Printf("  s3        %s://%s   access key %s  secret %s\n", scheme, gw.Addr(), keyID, secret)
	if webhdfsAddr != "" {
		// The default port may be taken by another dev cluster on the
		// machine (scripts that pass only --base-port): then the cluster
		// runs without the gateway. An address asked for must work.
		whCreds, err := c.GatewayCredentials("webhdfs")
		if err != nil {
			return err
		}
		wh, err := webhdfs.New(webhdfs.Config{MetaAddrs: []string{c.MetaAddr()}, Listen: webhdfsAddr, Logger: logger, Credentials: whCreds})
		switch {
		case err == nil:
			go wh.Serve()
			defer wh.Close()
			fmt.Printf("  webhdfs   http://%s%s   (hadoop fs -ls webhdfs://%s/)\n", wh.Addr(), webhdfs.Prefix, wh.Addr())
		case webhdfsAsked:
			return err
		default:
			fmt.Printf("  webhdfs   not started: %v (pass --webhdfs ADDR)\n", err)
		}
	}
	fmt.Printf("  token     %s   (basalt admin s3 --service-token-file ...)\n", filepath.Join(dataDir, "meta", meta.ServiceTokenFile))
	if d := c.ClientTLSDir(); d != "" {
		fmt.Printf("  tls       CA and certificates in %s; CLI certificate %s (--tls-dir)\n", cluster.TLSDir(dataDir), d)
		fmt.Printf("  by key    no certificate needed: BASALT_SECRET_KEY=%s basalt sh --access-key %s --ca-cert %s ...\n",
			secret, keyID, filepath.Join(d, pki.CACertFile))
	}
	if debugAddr != "" {
		fmt.Printf("  metrics   http://%s/metrics\n", debugAddr)
	}
	fmt.Println("ready. Try: basalt sh volume create /vol1 && basalt sh bucket create /vol1/bucket1 && basalt sh key put /vol1/bucket1/hello README.md")
	<-ctx.Done()
	fmt.Println("basalt dev: stopping")
	return nil
}

// devCertAgents runs, for each of basalt dev's in-process datanodes, the
// certificate agent `basalt datanode` runs (pki/enroll.Agent): renewal
// before expiry (saved in the datanode's TLS directory) and the revoked
// serials polled from the metadata service, so a long-running dev cluster
// renews its certificates and its datanodes refuse revoked ones.
type devCertAgents struct {
	mu    sync.Mutex
	creds []*pki.Credentials
}

// hook is cluster.Config.DatanodeConfig: it notes each datanode's
// credentials (the very object its servers use).
func (a *devCertAgents) hook(_ int, dc *datanode.Config) {
	a.mu.Lock()
	a.creds = append(a.creds, dc.TLS)
	a.mu.Unlock()
}

// start starts an agent per datanode noted; the func stops them.
func (a *devCertAgents) start(metaAddr, tlsRoot string, log *slog.Logger) func() {
	a.mu.Lock()
	defer a.mu.Unlock()
	prov := &pki.Provisioner{Dir: tlsRoot}
	var stops []func()
	for _, cr := range a.creds {
		if cr.IsInsecure() {
			continue
		}
		stops = append(stops, startCertAgent(cr, []string{metaAddr}, prov.DirOf(cr.Identity), log))
	}
	return func() {
		for _, stop := range stops {
			stop()
		}
	}
}

// loginName is the user running basalt dev ($USER, else the OS's name for
// the process's user: CI and service managers often leave $USER unset,
// while Hadoop's client still sends the OS user as user.name).
func loginName() string {
	if u := os.Getenv("USER"); u != "" {
		return u
	}
	if u, err := user.Current(); err == nil {
		return u.Username
	}
	return ""
}
