package main

// TLS flags and the `basalt admin ca` commands: every internal port of a
// Basalt cluster is mutual TLS with certificates from the cluster CA
// (internal/pki), so every process, the CLI included, needs a TLS
// directory (ca.pem, cert.pem, key.pem).

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/pki/enroll"
)

// envTLSDir names a TLS directory for every command that takes --tls-dir.
const envTLSDir = "BASALT_TLS_DIR"

// devClientTLSDir is where `basalt dev` (default --data-dir) keeps the
// CLI's certificate; client tools use it when nothing else is given.
var devClientTLSDir = filepath.Join(cluster.TLSDir("./basalt-data"), string(cluster.ClientID.Role)+"-"+cluster.ClientID.ID)

// tlsFlags: --tls-dir and the loud --insecure-no-tls.
type tlsFlags struct {
	dir      string
	insecure bool
}

// register adds the flags to cmd (persistent: to its subcommands too).
// client: the command is a client tool, which finds basalt dev's
// certificate by itself.
func (f *tlsFlags) register(cmd *cobra.Command, persistent, client bool) {
	fs := cmd.Flags()
	if persistent {
		fs = cmd.PersistentFlags()
	}
	def := "$" + envTLSDir
	if client {
		def += ", else " + devClientTLSDir + " (basalt dev's)"
	}
	fs.StringVar(&f.dir, "tls-dir", "", "TLS directory: ca.pem (the cluster CA), cert.pem and key.pem (this process's certificate; `basalt admin ca issue`). Default "+def)
	fs.BoolVar(&f.insecure, "insecure-no-tls", false, "DANGEROUS: no TLS, no authentication (only to measure what TLS costs, against a cluster started the same way)")
}

// load reads the credentials: --tls-dir, $BASALT_TLS_DIR, or fallback()
// (a default directory; nil: none).
func (f *tlsFlags) load(fallback func() string) (*pki.Credentials, error) {
	if f.insecure {
		fmt.Fprintln(os.Stderr, "basalt: WARNING: --insecure-no-tls: TLS and authentication are OFF; anyone on the network can read, change and delete everything")
		return pki.Insecure(), nil
	}
	dir := f.dir
	if dir == "" {
		dir = os.Getenv(envTLSDir)
	}
	if dir == "" && fallback != nil {
		dir = fallback()
	}
	if dir == "" {
		if _, err := os.Stat(filepath.Join(devClientTLSDir, pki.CertFile)); err == nil {
			dir = devClientTLSDir
		}
	}
	if dir == "" {
		return nil, usagef("no TLS directory: pass --tls-dir (ca.pem, cert.pem, key.pem; see `basalt admin ca issue`) or set $%s; `basalt dev` keeps one in DATA_DIR/tls/client-cli", envTLSDir)
	}
	return pki.Load(dir)
}

func adminCACmd(f *connFlags) *cobra.Command {
	root := &cobra.Command{
		Use:   "ca",
		Short: "The cluster CA: make it, issue certificates, bootstrap tokens, revocation",
		Long: `Every internal port of a cluster (meta and datanode gRPC, raft, V2 streams)
requires a certificate from the cluster CA, and the role in it (meta,
datanode, client) decides what its holder may do. The metadata service
keeps the CA in Raft: a new node gets a certificate with a one-time
bootstrap token, nodes renew theirs, admins revoke:

  basalt admin ca token create --role datanode --ttl 1h
  basalt datanode --bootstrap-token TOKEN --meta 10.0.0.1:9862 ...
  basalt admin ca token create --role client --id alice
  basalt admin ca enroll --bootstrap-token TOKEN --out alice-tls
  basalt admin ca revoke 3f9a...   (a serial)  |  basalt://datanode/UUID
  basalt admin ca revoked

With files instead (operator-run CA; --ca-dir DIR on meta imports it):

  basalt admin ca init --dir /etc/basalt/ca
  basalt admin ca issue --dir /etc/basalt/ca --role meta --id 1 --out /etc/basalt/tls
  basalt admin ca issue --dir /etc/basalt/ca --role datanode --out dn1-tls   # new UUID
  basalt admin ca issue --dir /etc/basalt/ca --role client --id alice --out alice-tls

Keep ca-key.pem off the nodes; each process needs only its --tls-dir
(ca.pem, cert.pem, key.pem).`,
	}
	var dir string
	root.PersistentFlags().StringVar(&dir, "dir", "", "the CA directory (ca.pem, ca-key.pem)")
	initCmd := &cobra.Command{
		Use:   "init",
		Short: "Make a new cluster CA (ECDSA P-256) in --dir",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if dir == "" {
				return usagef("--dir is required")
			}
			ca, err := pki.NewCA("basalt cluster CA")
			if err != nil {
				return err
			}
			if err := ca.Save(dir); err != nil {
				return err
			}
			fmt.Printf("CA written to %s (%s, %s: keep the key secret)\n", dir, pki.CACertFile, pki.CAKeyFile)
			return nil
		}),
	}
	var role, id, out string
	var validity time.Duration
	issue := &cobra.Command{
		Use:   "issue",
		Short: "Issue a certificate for a meta node, datanode or client",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if dir == "" {
				return usagef("--dir is required")
			}
			r := pki.Role(role)
			if !r.Valid() {
				return usagef("--role %q: want meta, datanode or client", role)
			}
			if id == "" {
				if r != pki.RoleDatanode {
					return usagef("--id is required for role %s (a meta node's ID, a client's name)", r)
				}
				var u [16]byte
				rand.Read(u[:])
				id = hex.EncodeToString(u[:])
			}
			ca, err := pki.LoadCA(dir)
			if err != nil {
				return err
			}
			ident := pki.Identity{Role: r, ID: id}
			if err := ident.Validate(); err != nil {
				return &usageError{err.Error()}
			}
			if out == "" {
				out = filepath.Join(dir, string(r)+"-"+id)
			}
			if _, err := os.Stat(filepath.Join(out, pki.KeyFile)); err == nil {
				return errors.New("issue: " + out + " already holds a key; not replacing it")
			}
			creds, err := ca.Issue(ident, validity)
			if err != nil {
				return err
			}
			if err := creds.Save(out); err != nil {
				return err
			}
			fmt.Printf("%s: certificate until %s in %s (use --tls-dir %s)\n", ident, creds.NotAfter.Format(time.DateOnly), out, out)
			return nil
		}),
	}
	issue.Flags().StringVar(&role, "role", "", "meta, datanode or client")
	issue.Flags().StringVar(&id, "id", "", "meta: the node ID; datanode: its UUID (default: a new one; an existing datanode's is in DATA_DIR/datanode.json); client: a name")
	issue.Flags().StringVar(&out, "out", "", "TLS directory to write (default DIR/ROLE-ID)")
	issue.Flags().DurationVar(&validity, "validity", pki.NodeValidity, "how long the certificate is valid")
	root.AddCommand(initCmd, issue)
	root.AddCommand(caAdminCmds(f)...)
	return root
}

// ------------------------------------------------ the CA kept in Raft

// envBootstrapToken gives --bootstrap-token.
const envBootstrapToken = "BASALT_BOOTSTRAP_TOKEN"

// tlsDirOf is the TLS directory a server uses: --tls-dir,
// $BASALT_TLS_DIR, else DATA_DIR/tls.
func (f *tlsFlags) dirOr(def string) string {
	if f.dir != "" {
		return f.dir
	}
	if d := os.Getenv(envTLSDir); d != "" {
		return d
	}
	return def
}

func hasCert(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, pki.CertFile))
	return err == nil
}

// datanodeCredentials are a datanode's credentials: its TLS directory's
// files, or, when there are none and a bootstrap token is given, a
// certificate the metadata service issues against the token (written to
// the TLS directory, so a restart needs no token).
func datanodeCredentials(tf *tlsFlags, dataDir, token string, metas []string) (*pki.Credentials, string, error) {
	if tf.insecure {
		c, err := tf.load(nil)
		return c, "", err
	}
	dir := tf.dirOr(filepath.Join(dataDir, "tls"))
	if token == "" {
		token = os.Getenv(envBootstrapToken)
	}
	if hasCert(dir) || token == "" {
		c, err := tf.load(func() string { return dir })
		return c, dir, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := enroll.Bootstrap(ctx, metas, token, pki.RoleDatanode)
	if err != nil {
		return nil, "", fmt.Errorf("bootstrap token: %w", err)
	}
	if err := c.Save(dir); err != nil {
		return nil, "", err
	}
	fmt.Printf("basalt datanode: certificate for %s issued against the bootstrap token, saved in %s\n", c.Identity, dir)
	return c, dir, nil
}

// metaBootstrap spends a meta bootstrap token at the other members and
// checks that the certificate is this node's.
func metaBootstrap(token string, others []string, self pki.Identity) (*pki.Credentials, error) {
	if len(others) == 0 {
		return nil, usagef("--bootstrap-token: a meta node gets its certificate through the other members: give --peers")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := enroll.Bootstrap(ctx, others, token, pki.RoleMeta)
	if err != nil {
		return nil, fmt.Errorf("bootstrap token: %w", err)
	}
	if c.Identity != self {
		return nil, fmt.Errorf("bootstrap token: it is for %s, this node is %s (make one with --id %s)", c.Identity, self, self.ID)
	}
	return c, nil
}

// startCertAgent renews the certificate before it expires (saving it in
// dir) and keeps the revoked serials current; the returned func stops it.
func startCertAgent(creds *pki.Credentials, metas []string, dir string, log *slog.Logger) func() {
	if creds.IsInsecure() {
		return func() {}
	}
	a := &enroll.Agent{Creds: creds, Addrs: metas, Logger: log}
	if dir != "" {
		a.Save = func(c *pki.Credentials) error { return c.Save(dir) }
	}
	if err := a.Start(); err != nil {
		log.Warn("certificate agent", "err", err)
		return func() {}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { a.Run(ctx); close(done) }()
	return func() { cancel(); <-done; a.Close() }
}

// metaCAFlags: where a meta node's CA comes from.
type metaCAFlags struct {
	caDir, secretFile string
	validity          time.Duration
}

func (f *metaCAFlags) register(cmd *cobra.Command) {
	fs := cmd.Flags()
	fs.StringVar(&f.caDir, "ca-dir", "", "the operator's CA directory (ca.pem, ca-key.pem; `basalt admin ca init`): imported into Raft by the first leader if the cluster has no CA, and used to issue this node's certificate if its TLS directory has none")
	fs.StringVar(&f.secretFile, "ca-key-secret-file", "", "a secret file (same on every meta node) that seals the CA key in the Raft log and store (AES-256-GCM); without it the key is protected only by the data directories' permissions")
	fs.DurationVar(&f.validity, "cert-validity", pki.NodeValidity, "life of the certificates the cluster CA issues (bootstrap tokens, renewals)")
}

// metaCredentials are a meta node's credentials and the CA to record (nil:
// none to record): its TLS directory's files; else a certificate from
// --ca-dir; else, for the first start of a new single-node cluster, a
// new CA made here (its key goes only into Raft) with this node's
// certificate and an admin client certificate written to DATA_DIR.
//
// With a bootstrap token (--bootstrap-token, role meta, made for this
// node's ID) and no certificate yet, the certificate comes from the
// cluster CA through the other members (others: their gRPC addresses).
func metaCredentials(tf *tlsFlags, cf *metaCAFlags, dataDir string, id uint64, peers int, admins *[]string, token string, others []string) (creds *pki.Credentials, ca *pki.CA, dir string, err error) {
	if tf.insecure {
		c, err := tf.load(nil)
		return c, nil, "", err
	}
	if cf.caDir != "" {
		if ca, err = pki.LoadCA(cf.caDir); err != nil {
			return nil, nil, "", err
		}
	}
	dir = tf.dirOr(filepath.Join(dataDir, "tls"))
	self := pki.Identity{Role: pki.RoleMeta, ID: strconv.FormatUint(id, 10)}
	if hasCert(dir) {
		c, err := tf.load(func() string { return dir })
		return c, ca, dir, err
	}
	if token == "" {
		token = os.Getenv(envBootstrapToken)
	}
	if token != "" {
		c, err := metaBootstrap(token, others, self)
		if err != nil {
			return nil, nil, "", err
		}
		if err := c.Save(dir); err != nil {
			return nil, nil, "", err
		}
		fmt.Printf("basalt meta: certificate for %s issued against the bootstrap token, saved in %s\n", c.Identity, dir)
		return c, ca, dir, nil
	}
	if ca == nil {
		if _, err := os.Stat(filepath.Join(dataDir, "raft")); err == nil || peers > 1 {
			c, err := tf.load(func() string { return dir })
			if err != nil && peers > 1 {
				err = fmt.Errorf("%w (a new cluster of several meta nodes needs one CA: `basalt admin ca init --dir D`, then --ca-dir D on each node)", err)
			}
			return c, nil, dir, err
		}
		if ca, err = pki.NewCA("basalt cluster CA"); err != nil {
			return nil, nil, "", err
		}
		admin := "admin"
		if len(*admins) > 0 {
			admin = (*admins)[0]
		} else {
			*admins = []string{admin}
		}
		ac, err := ca.Issue(pki.Identity{Role: pki.RoleClient, ID: admin}, pki.NodeValidity)
		if err != nil {
			return nil, nil, "", err
		}
		adir := filepath.Join(dataDir, "admin-tls")
		if err := ac.Save(adir); err != nil {
			return nil, nil, "", err
		}
		fmt.Printf("basalt meta: new cluster CA (SHA-256 %s), kept in Raft; admin %q's certificate in %s (use --tls-dir %s)\n", ca.Fingerprint(), admin, adir, adir)
	}
	c, err := ca.Issue(self, pki.NodeValidity)
	if err != nil {
		return nil, nil, "", err
	}
	if err := c.Save(dir); err != nil {
		return nil, nil, "", err
	}
	return c, ca, dir, nil
}

// secret reads --ca-key-secret-file (nil: none).
func (f *metaCAFlags) secret() ([]byte, error) {
	if f.secretFile == "" {
		return nil, nil
	}
	b, err := os.ReadFile(f.secretFile)
	if err != nil {
		return nil, err
	}
	if len(bytes.TrimSpace(b)) < 16 {
		return nil, fmt.Errorf("--ca-key-secret-file %s: want at least 16 bytes of secret", f.secretFile)
	}
	return bytes.TrimSpace(b), nil
}

// caAdminCmds are `basalt admin ca token|revoke|revoked|enroll`, which
// talk to the metadata service.
func caAdminCmds(f *connFlags) []*cobra.Command {
	metaClient := func() (*metaclient.Client, error) {
		cfg, err := f.config()
		if err != nil {
			return nil, err
		}
		return metaclient.New(metaclient.Config{Addrs: cfg.MetaAddrs, CallTimeout: 30 * time.Second,
			DialOptions: []grpc.DialOption{cfg.Credentials.GRPCDialOption(pki.RoleMeta)}})
	}
	var role, id string
	var ttl time.Duration
	token := &cobra.Command{Use: "token", Short: "One-time bootstrap tokens for new datanodes and clients"}
	create := &cobra.Command{
		Use:   "create",
		Short: "Make a one-time bootstrap token (admins only)",
		Long: `Make a one-time bootstrap token. A new node given it gets its certificate
from the cluster CA kept by the metadata service, with no files:

  basalt datanode --bootstrap-token TOKEN --meta 10.0.0.1:9862 ...
  basalt meta --id 4 --peers ... --bootstrap-token TOKEN   # made with --role meta --id 4
  basalt admin ca enroll --bootstrap-token TOKEN --out alice-tls   # a client

The token carries the CA's SHA-256, with which the node authenticates the
metadata service before it sends the token. It works once, until --ttl.`,
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 0, "none"); err != nil {
				return err
			}
			mc, err := metaClient()
			if err != nil {
				return err
			}
			defer mc.Close()
			r, err := mc.Ca.CreateBootstrapToken(cmd.Context(), &metapb.CreateBootstrapTokenRequest{Role: role, TtlMs: ttl.Milliseconds(), IdentityId: id})
			if err != nil {
				return client.FromRPC("create bootstrap token", err)
			}
			if f.json {
				return printJSON(cmd.OutOrStdout(), map[string]any{"token": r.Token, "expires": time.UnixMilli(r.ExpiresUnixMs).UTC().Format(time.RFC3339)})
			}
			fmt.Fprintln(cmd.OutOrStdout(), r.Token)
			fmt.Fprintf(os.Stderr, "one use, until %s\n", time.UnixMilli(r.ExpiresUnixMs).UTC().Format(time.RFC3339))
			return nil
		}),
	}
	create.Flags().StringVar(&role, "role", "datanode", "datanode, client or meta (a meta token needs a client certificate: admins only)")
	create.Flags().DurationVar(&ttl, "ttl", time.Hour, "how long the token may be used (at most 168h)")
	create.Flags().StringVar(&id, "id", "", "the identity's ID: a client's name or a meta node's ID (required for both); a datanode's UUID to keep (default: a new one)")
	token.AddCommand(create)

	revoke := &cobra.Command{
		Use:   "revoke SERIAL|basalt://ROLE/ID",
		Short: "Revoke a certificate by serial, or every certificate the cluster CA issued to an identity (admins only)",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if err := exactArgs(args, 1, "a serial or an identity"); err != nil {
				return err
			}
			req := &metapb.RevokeCertificateRequest{Serial: args[0]}
			if strings.HasPrefix(args[0], "basalt://") {
				req = &metapb.RevokeCertificateRequest{Identity: args[0]}
			}
			mc, err := metaClient()
			if err != nil {
				return err
			}
			defer mc.Close()
			r, err := mc.Ca.RevokeCertificate(cmd.Context(), req)
			if err != nil {
				return client.FromRPC("revoke", err)
			}
			if f.json {
				return printJSON(cmd.OutOrStdout(), map[string]any{"revoked": r.Serials})
			}
			for _, s := range r.Serials {
				fmt.Fprintln(cmd.OutOrStdout(), "revoked", s)
			}
			if len(r.Serials) == 0 {
				fmt.Fprintln(cmd.OutOrStdout(), "nothing newly revoked")
			}
			return nil
		}),
	}
	revoked := &cobra.Command{
		Use:   "revoked",
		Short: "List the revoked serials (and the identities of removed meta nodes, basalt://meta/ID: every certificate naming one is refused)",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			mc, err := metaClient()
			if err != nil {
				return err
			}
			defer mc.Close()
			r, err := mc.Ca.GetRevocations(cmd.Context(), &metapb.GetRevocationsRequest{})
			if err != nil {
				return client.FromRPC("list revocations", err)
			}
			if f.json {
				return printJSON(cmd.OutOrStdout(), map[string]any{"serials": r.Serials, "version": r.Version})
			}
			for _, s := range r.Serials {
				fmt.Fprintln(cmd.OutOrStdout(), s)
			}
			return nil
		}),
	}
	var tok, out, erole string
	enrollCmd := &cobra.Command{
		Use:   "enroll",
		Short: "Get a certificate with a bootstrap token and write a TLS directory",
		RunE: runE(func(cmd *cobra.Command, args []string) error {
			if tok == "" || out == "" {
				return usagef("--bootstrap-token and --out are required")
			}
			if hasCert(out) {
				return errors.New("enroll: " + out + " already holds a certificate; not replacing it")
			}
			c, err := enroll.Bootstrap(cmd.Context(), splitList(f.meta), tok, pki.Role(erole))
			if err != nil {
				return err
			}
			if err := c.Save(out); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: certificate until %s in %s (use --tls-dir %s)\n", c.Identity, c.NotAfter.Format(time.DateOnly), out, out)
			return nil
		}),
	}
	enrollCmd.Flags().StringVar(&tok, "bootstrap-token", "", "the token (`basalt admin ca token create`)")
	enrollCmd.Flags().StringVar(&out, "out", "", "TLS directory to write")
	enrollCmd.Flags().StringVar(&erole, "role", "client", "the token's role: client or datanode")
	return []*cobra.Command{token, revoke, revoked, enrollCmd}
}

// saveRenewed writes a meta node's renewed certificate to its TLS
// directory ("" : nowhere).
func saveRenewed(dir string) func(*pki.Credentials) {
	return func(c *pki.Credentials) {
		if dir == "" {
			return
		}
		if err := c.Save(dir); err != nil {
			fmt.Fprintln(os.Stderr, "basalt meta: saving the renewed certificate:", err)
		}
	}
}
