package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	_ "net/http/pprof"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"

	"github.com/basalt-store/basalt/internal/datanode"
	"github.com/basalt-store/basalt/internal/meta"
	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/meta/scm"
	"github.com/basalt-store/basalt/internal/storage"
	"github.com/basalt-store/basalt/internal/storage/zoned"
)

// serveMetrics serves /metrics and /debug/pprof on addr ("" = off).
func serveMetrics(addr string, reg *prometheus.Registry) func() {
	if addr == "" {
		return func() {}
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.Handle("/debug/pprof/", http.DefaultServeMux)
	srv := &http.Server{Addr: addr, Handler: mux}
	go srv.ListenAndServe()
	return func() { srv.Close() }
}

func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

func serverLogger(level string) *slog.Logger {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		l = slog.LevelWarn
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: l}))
}

// parsePeers reads "1=raftAddr/grpcAddr,2=...".
func parsePeers(s string) (map[uint64]meta.Peer, error) {
	out := map[uint64]meta.Peer{}
	if s == "" {
		return out, nil
	}
	for _, part := range strings.Split(s, ",") {
		id, addrs, ok := strings.Cut(part, "=")
		raftAddr, grpcAddr, ok2 := strings.Cut(addrs, "/")
		n, err := strconv.ParseUint(id, 10, 64)
		if !ok || !ok2 || err != nil || n == 0 {
			return nil, fmt.Errorf("bad --peers entry %q: want ID=RAFT_ADDR/GRPC_ADDR", part)
		}
		out[n] = meta.Peer{RaftAddr: raftAddr, GRPCAddr: grpcAddr}
	}
	return out, nil
}

func metaCmd() *cobra.Command {
	var dataDir, raftAddr, grpcAddr, peers, metricsAddr, logLevel, tokenFile, admins, groupsSpec, groupsFile, metaBootstrapToken string
	var id uint64
	var join bool
	var tf tlsFlags
	var caf metaCAFlags
	var uploadExpiry time.Duration
	var lookupCache int64
	var ballast int64
	var scmCfg scm.Config
	cmd := &cobra.Command{
		Use:   "meta",
		Short: "Run a metadata service node (namespace manager + storage container manager)",
		Long: `Run one node of the metadata service: the namespace manager and the storage
container manager, two Raft groups on one host. Deploy 1, 3 or 5 nodes; every
node gets the same --peers list (empty for a single node). To add or replace
a node later, start it with --join and a new --id, then run
basalt admin meta add (see basalt admin meta --help).`,
		Example: `  basalt meta --id 1 --data-dir /var/lib/basalt/meta --tls-dir /etc/basalt/meta1-tls --raft 10.0.0.1:9863 --grpc 10.0.0.1:9862 \
    --peers 1=10.0.0.1:9863/10.0.0.1:9862,2=10.0.0.2:9863/10.0.0.2:9862,3=10.0.0.3:9863/10.0.0.3:9862`,
		RunE: func(cmd *cobra.Command, args []string) error {
			p, err := parsePeers(peers)
			if err != nil {
				return &usageError{err.Error()}
			}
			if scmCfg.StaleInterval <= 0 || scmCfg.DeadInterval <= scmCfg.StaleInterval || scmCfg.MaxCopiesPerTarget <= 0 || scmCfg.CopyTimeout <= 0 {
				return usagef("want 0 < --stale-interval (%v) < --dead-interval (%v), --replication-copies-per-datanode (%d) > 0 and --replication-copy-timeout (%v) > 0",
					scmCfg.StaleInterval, scmCfg.DeadInterval, scmCfg.MaxCopiesPerTarget, scmCfg.CopyTimeout)
			}
			if join {
				if _, ok := p[id]; len(p) == 0 || (ok && len(p) == 1) {
					return usagef("--join needs --peers naming the current members (their addresses: the bootstrap token is spent there, and they send this node the groups' state)")
				}
				if _, err := os.Stat(filepath.Join(dataDir, "raft")); err == nil {
					return usagef("--join with data directory %s, which holds Raft state: a node joins with an empty data directory; a member restarts without --join", dataDir)
				}
			}
			adminList := splitList(admins)
			var others []string // the other members' gRPC addresses (a bootstrap token is spent there)
			for pid, peer := range p {
				if pid != id && peer.GRPCAddr != "" {
					others = append(others, peer.GRPCAddr)
				}
			}
			creds, ca, tlsDir, err := metaCredentials(&tf, &caf, dataDir, id, len(p), &adminList, metaBootstrapToken, others)
			if err != nil {
				return err
			}
			secret, err := caf.secret()
			if err != nil {
				return err
			}
			groups, err := meta.ParseGroups(groupsSpec)
			if err != nil {
				return &usageError{err.Error()}
			}
			if groupsFile != "" {
				more, err := meta.LoadGroupsFile(groupsFile)
				if err != nil {
					return err
				}
				for u, g := range more {
					groups[u] = append(groups[u], g...)
				}
			}
			if _, err := os.Stat(filepath.Join(dataDir, "raft")); !join && len(p) > 1 && errors.Is(err, os.ErrNotExist) {
				// A first start, or a member restarted on an empty disk:
				// the other members' tables tell (meta.New runs the
				// stricter check for --join itself).
				if err := meta.CheckNotWiped(context.Background(), creds, id, p, 5*time.Second, false); err != nil {
					return err
				}
			}
			reg := newRegistry()
			ms, err := meta.New(meta.Config{NodeID: id, DataDir: dataDir, RaftAddr: raftAddr, GRPCAddr: grpcAddr, Peers: p, Join: join, TLS: creds,
				CA: ca, CAKeySecret: secret, CertValidity: caf.validity, CertRenewed: saveRenewed(tlsDir),
				ServiceTokenFile: tokenFile, Admins: adminList, Groups: groups, Namespace: namespace.Config{UploadExpiry: uploadExpiry}, SCM: scmCfg,
				BallastBytes: ballast, LookupCacheBytes: lookupCache, Registerer: reg, Logger: serverLogger(logLevel)})
			if err != nil {
				return err
			}
			if err := ms.Start(); err != nil {
				ms.Close()
				return err
			}
			defer ms.Close()
			stop := serveMetrics(metricsAddr, reg)
			defer stop()
			if tokenFile == "" {
				tokenFile = filepath.Join(dataDir, meta.ServiceTokenFile)
			}
			fmt.Printf("basalt meta: node %d, gRPC %s, raft %s, data %s, service token in %s\n", id, ms.GRPCAddr(), ms.RaftAddr(), dataDir, tokenFile)
			sig := make(chan struct{})
			go func() { waitSignal(); close(sig) }()
			select {
			case <-sig:
				return nil
			case <-ms.Failed():
				// Fail-stop (its raft log directory failed): exit
				// non-zero so that the supervisor restarts the node.
				return ms.Err()
			}
		},
	}
	cmd.Flags().Uint64Var(&id, "id", 1, "node ID (nonzero, stable)")
	cmd.Flags().StringVar(&metaBootstrapToken, "bootstrap-token", "", "one-time token for this node (`basalt admin ca token create --role meta --id ID`; or $"+envBootstrapToken+"): with no certificate in the TLS directory, get one from the cluster CA through the other --peers and write it there")
	cmd.Flags().StringVar(&dataDir, "data-dir", "./basalt-meta", "data directory")
	cmd.Flags().StringVar(&raftAddr, "raft", "127.0.0.1:9863", "Raft transport listen address")
	cmd.Flags().StringVar(&grpcAddr, "grpc", "127.0.0.1:9862", "gRPC listen address (clients, datanodes)")
	cmd.Flags().StringVar(&peers, "peers", "", "all members: ID=RAFT_ADDR/GRPC_ADDR,... (empty: single node); with --join, the current members; members added later (basalt admin meta add) are learned from the replicated member table")
	cmd.Flags().BoolVar(&join, "join", false, "join a running cluster as a new member: bootstrap nothing and wait to be added (basalt admin meta add ID RAFT/GRPC); needs an empty data directory and a new node ID (docs/ARCHITECTURE.md, \"Meta membership\")")
	cmd.Flags().Int64Var(&lookupCache, "lookup-cache-bytes", namespace.DefaultLookupCacheBytes, "bound of the cache of key records for lookups (negative: none)")
	cmd.Flags().DurationVar(&uploadExpiry, "upload-expiry", namespace.DefaultUploadExpiry, "abort incomplete S3 multipart uploads older than this (negative: never)")
	cmd.Flags().StringVar(&tokenFile, "service-token-file", "", "file of the cluster service token S3 gateways and admin tools present (default DATA_DIR/"+meta.ServiceTokenFile+"; if it does not exist the node adopts the token the cluster recorded, made by the first leader, and writes it there)")
	cmd.Flags().StringVar(&metricsAddr, "metrics", "", "serve /metrics and /debug/pprof on this address")
	cmd.Flags().StringVar(&logLevel, "log-level", "warn", "debug, info, warn or error")
	cmd.Flags().StringVar(&admins, "admins", "", "administrators: users (client certificate IDs, or end users named by a gateway) who may do everything, comma-separated")
	cmd.Flags().StringVar(&groupsSpec, "groups", "", "group membership for ACLs and bucket policies: 'alice=analysts,etl;bob=etl' (every meta node needs the same)")
	cmd.Flags().StringVar(&groupsFile, "groups-file", "", "file of group membership, one 'user=group,group' a line (# comments); added to --groups")
	cmd.Flags().Int64Var(&ballast, "ballast-bytes", storage.DefaultBallast, "emergency ballast kept beside each Pebble store and the Raft log, removed at start on a full disk so the node comes up (0: none)")
	cmd.Flags().DurationVar(&scmCfg.StaleInterval, "stale-interval", 30*time.Second, "a datanode not heard from for this long is STALE (its pipelines close; it gets no new writes)")
	cmd.Flags().DurationVar(&scmCfg.DeadInterval, "dead-interval", 90*time.Second, "a datanode not heard from for this long is DEAD (its pipelines close, its replicas are copied elsewhere)")
	cmd.Flags().IntVar(&scmCfg.MaxCopiesPerTarget, "replication-copies-per-datanode", 2, "container copies in flight into one datanode (replication manager)")
	cmd.Flags().Uint64Var(&scmCfg.MaxCopyBytesPerTarget, "replication-bytes-per-datanode", 0, "bytes of the container copies in flight into one datanode (0: twice the container size; one copy always goes)")
	cmd.Flags().Uint64Var(&scmCfg.CopyBandwidthPerTarget, "replication-bandwidth-per-datanode", 0, "bytes per second one datanode takes in container copies, shared by its copies in flight (0: no cap)")
	cmd.Flags().DurationVar(&scmCfg.CopyTimeout, "replication-copy-timeout", 10*time.Minute, "a container copy not done by then is given up and scheduled on another datanode")
	cmd.Flags().DurationVar(&scmCfg.SlowDisk.CloseInterval, "slow-disk-close-interval", 2*time.Minute, "close (and so replace) at most one pipeline per this interval whose Raft log or open container is on a datanode's slow disk (negative: never)")
	tf.register(cmd, false, false)
	caf.register(cmd)
	return cmd
}

func datanodeCmd() *cobra.Command {
	var cfg datanode.Config
	var metas, volumes, logDirs, metricsAddr, logLevel, scrubRate, cacheDirs, cacheBytes string
	var volumeList []string
	var ballast int64
	var tf tlsFlags
	var bootstrapToken string
	cmd := &cobra.Command{
		Use:   "datanode",
		Short: "Run a datanode",
		Long: `Run a datanode: it registers with the storage container manager, joins the
Raft groups of the pipelines it is put in, stores containers on its data
volumes and serves reads, V1 writes (gRPC) and V2 streams.`,
		Example: `  basalt datanode --data-dir /var/lib/basalt/dn --volumes /disk1/basalt,/disk2/basalt,zoned:/mnt/zonefs0 \
    --raft-log-dirs /disk1/raft,/disk2/raft --location /dc1/rack2 --meta 10.0.0.1:9862 \
    --listen 10.0.0.5:9872 --raft 10.0.0.5:9873 --stream 10.0.0.5:9874 --tls-dir /etc/basalt/dn-tls`,
		RunE: func(cmd *cobra.Command, args []string) error {
			cfg.MetaAddrs = splitList(metas)
			specs := append(splitList(volumes), volumeList...)
			cfg.Volumes, cfg.Storage.NewBackend = zoned.Volumes(specs, filepath.Join(cfg.DataDir, "zoned"), cfg.Storage.DirectIO, nil)
			cfg.LogDirs = splitList(logDirs)
			cfg.Storage.BallastBytes, cfg.LogBallastBytes = ballast, ballast
			rate, err := parseSize(scrubRate)
			if err != nil {
				return fmt.Errorf("--scrub-rate: %w", err)
			}
			cfg.ScrubRate = rate
			cfg.CacheDirs = splitList(cacheDirs)
			if cacheBytes != "" {
				if cfg.CacheBytes, err = parseSize(cacheBytes); err != nil {
					return fmt.Errorf("--cache-bytes: %w", err)
				}
			}
			if len(cfg.CacheDirs) > 0 && cfg.CacheBytes == 0 {
				return fmt.Errorf("--cache-dir needs --cache-bytes (the capacity of each cache directory)")
			}
			if rate == 0 {
				cfg.ScrubRate = -1 // disabled
			}
			reg := newRegistry()
			cfg.Registerer = reg
			cfg.Logger = serverLogger(logLevel)
			var tlsDir string
			if cfg.TLS, tlsDir, err = datanodeCredentials(&tf, cfg.DataDir, bootstrapToken, cfg.MetaAddrs); err != nil {
				return err
			}
			dn, err := datanode.New(cfg)
			if err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			err = dn.Start(ctx)
			cancel()
			if err != nil {
				dn.Close()
				return err
			}
			defer dn.Close()
			defer startCertAgent(cfg.TLS, cfg.MetaAddrs, tlsDir, cfg.Logger)()
			stop := serveMetrics(metricsAddr, reg)
			defer stop()
			fmt.Printf("basalt datanode: id %d, data %s, raft %s, location %s\n", dn.ID(), dn.Addr(), dn.RaftAddr(), cfg.Location)
			waitSignal()
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.DataDir, "data-dir", "./basalt-datanode", "identity, pipeline list and default volume/log directories")
	f.StringVar(&volumes, "volumes", "", "data volumes, comma-separated (default DATA_DIR/data); zoned:<zonefs mount> is a zoned device (SMR or ZNS) through zonefs, its metadata under DATA_DIR/zoned")
	f.StringArrayVar(&volumeList, "volume", nil, "a data volume (repeatable; as in --volumes), e.g. --volume zoned:/mnt/zonefs0")
	f.StringVar(&logDirs, "raft-log-dirs", "", "Raft log directories, comma-separated (default DATA_DIR/raft)")
	f.BoolVar(&cfg.SmallDataInLog, "small-data-in-log", false, "keep small files' data in their Raft log entries (the log fsync makes them durable; no volume flush before the append ack); costs log disk space, may help where volume flushes are slow")
	f.BoolVar(&cfg.SlowDisk.Disabled, "no-slow-disk-detection", false, "do not time flushes per log directory and volume, mark slow disks, avoid them for new Raft groups and containers, or report them to SCM")
	f.StringVar(&cfg.Location, "location", "/default-rack", "network location, e.g. /dc1/rack2")
	f.StringVar(&metas, "meta", "127.0.0.1:9862", "metadata service gRPC address(es), comma-separated")
	f.StringVar(&cfg.ListenAddr, "listen", "127.0.0.1:0", "client gRPC listen address")
	f.StringVar(&cfg.RaftAddr, "raft", "127.0.0.1:0", "pipelines' Raft transport listen address")
	f.StringVar(&cfg.StreamAddr, "stream", "127.0.0.1:0", "V2 streaming listen address")
	f.StringVar(&cfg.Hostname, "hostname", "", "host name reported to SCM (default: os.Hostname)")
	f.StringVar(&metricsAddr, "metrics", "", "serve /metrics and /debug/pprof on this address")
	f.StringVar(&logLevel, "log-level", "warn", "debug, info, warn or error")
	f.Int64Var(&ballast, "ballast-bytes", storage.DefaultBallast, "emergency ballast kept beside each volume's Pebble DB and each Raft log directory, removed at start on a full disk so the datanode comes up with writes refused (0: none)")
	f.StringVar(&scrubRate, "scrub-rate", "32MiB", "bytes per second the scrubber reads to verify every stored block's checksums in the background (suffix KiB, MiB, GiB; 0: no background scrubbing)")
	f.DurationVar(&cfg.ScrubInterval, "scrub-interval", datanode.DefaultScrubInterval, "time from the start of one scrubber pass over all data to the start of the next")
	f.DurationVar(&cfg.VolumeCheckInterval, "volume-check-interval", datanode.DefaultVolumeCheckInterval, "how often each data volume's health is checked (probe file created, written, fsynced, read back, removed); a failed check fails the volume")
	f.DurationVar(&cfg.VolumeCheckTimeout, "volume-check-timeout", datanode.DefaultVolumeCheckTimeout, "a volume health check not done by then fails the volume (a hung disk)")
	f.StringVar(&cacheDirs, "cache-dir", "", "cache tier directories, comma-separated: a DAX-mounted pmem file system (or tmpfs); cached blocks survive restarts (docs/CACHE.md)")
	f.StringVar(&bootstrapToken, "bootstrap-token", "", "one-time token (`basalt admin ca token create`; or $"+envBootstrapToken+"): with no certificate in the TLS directory, get one from the cluster CA and write it there")
	f.StringVar(&cacheBytes, "cache-bytes", "", "capacity of each cache directory (e.g. 4GiB); without --cache-dir, the size of a DRAM cache (locked memory, not persistent)")
	f.StringVar(&cfg.ShortCircuitSocket, "short-circuit-socket", "", "Unix socket through which readers on this host get block files (short-circuit local reads; default DATA_DIR/short-circuit.sock; \"-\": none)")
	tf.register(cmd, false, false)
	return cmd
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

func waitSignal() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	<-ctx.Done()
}
