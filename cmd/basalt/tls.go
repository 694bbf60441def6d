package main

// TLS flags and the `basalt admin ca` commands: every internal port of a
// Basalt cluster is mutual TLS with certificates from the cluster CA
// (internal/pki), so every process, the CLI included, needs a TLS
// directory (ca.pem, cert.pem, key.pem).

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"

	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/pki"
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

func adminCACmd() *cobra.Command {
	root := &cobra.Command{
		Use:   "ca",
		Short: "The cluster CA: make it, issue node and client certificates",
		Long: `Every internal port of a cluster (meta and datanode gRPC, raft, V2 streams)
requires a certificate from the cluster CA, and the role in it (meta,
datanode, client) decides what its holder may do.

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
	return root
}
