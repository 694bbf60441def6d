package main

// Helpers shared by the client tools (sh, admin, bench): connection flags,
// path parsing, tables or JSON, exit codes and a progress bar.

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/basalt-store/basalt/client"
)

// Exit codes of sh, admin and bench (documented in their help).
const (
	exitError    = 1 // any other failure
	exitUsage    = 2 // bad arguments, flags or paths
	exitNotFound = 3 // volume, bucket or key not found
	exitExists   = 4 // already exists
	exitInvalid  = 5 // the service rejected a name or argument
)

const exitCodesHelp = `
Exit codes: 0 ok, 1 error, 2 usage (bad arguments or paths), 3 not found,
4 already exists, 5 invalid name or argument.`

// usageError is a mistake in the command line.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return &usageError{fmt.Sprintf(format, args...)} }

func exitCode(err error) int {
	var ue *usageError
	switch {
	case errors.As(err, &ue):
		return exitUsage
	case errors.Is(err, client.ErrNotFound):
		return exitNotFound
	case errors.Is(err, client.ErrExists):
		return exitExists
	case errors.Is(err, client.ErrInvalidArgument):
		return exitInvalid
	}
	return exitError
}

// runE wraps a command so that its error is printed and the process exits
// with a code that says what kind of failure it was (main only knows 1).
func runE(f func(cmd *cobra.Command, args []string) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		err := f(cmd, args)
		if err == nil {
			return nil
		}
		fmt.Fprintln(os.Stderr, "basalt:", err)
		var ue *usageError
		if errors.As(err, &ue) {
			fmt.Fprintf(os.Stderr, "usage: %s\n", cmd.UseLine())
		}
		os.Exit(exitCode(err))
		return nil
	}
}

// exactArgs checks the argument count inside RunE so that a wrong count is
// a usage error (exit 2).
func exactArgs(args []string, n int, what string) error {
	if len(args) != n {
		return usagef("want %d argument(s) (%s), got %d", n, what, len(args))
	}
	return nil
}

// connFlags are the flags every client tool takes.
type connFlags struct {
	meta     string
	location string
	json     bool
	tls      tlsFlags
	// S3 keys and the CA instead of a client certificate (user tokens).
	accessKey, secretKey, caCert string
}

func (f *connFlags) register(cmd *cobra.Command) {
	pf := cmd.PersistentFlags()
	pf.StringVar(&f.meta, "meta", "127.0.0.1:9862", "metadata service address(es), comma-separated host:port")
	pf.StringVar(&f.location, "location", "", `this client's network location, e.g. "/dc1/rack1" (orders replicas by distance)`)
	pf.BoolVar(&f.json, "json", false, "print JSON instead of tables")
	f.tls.register(cmd, true, true)
	pf.StringVar(&f.accessKey, "access-key", "", "authenticate with this S3 access key instead of a client certificate (a user token from the metadata service; default $BASALT_ACCESS_KEY, with --ca-cert also $AWS_ACCESS_KEY_ID); needs --ca-cert")
	pf.StringVar(&f.secretKey, "secret-key", "", "the access key's secret (default $BASALT_SECRET_KEY, else $AWS_SECRET_ACCESS_KEY); prefer the environment: flags show in ps")
	pf.StringVar(&f.caCert, "ca-cert", "", "the cluster CA certificate (ca.pem) to check the servers against when authenticating with an access key (no client certificate); default $BASALT_CA_CERT")
	// Flag errors are usage errors too.
	cmd.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		fmt.Fprintln(os.Stderr, "basalt:", err)
		fmt.Fprintf(os.Stderr, "usage: %s\n", c.UseLine())
		os.Exit(exitUsage)
		return err
	})
}

func (f *connFlags) config() (client.Config, error) {
	var addrs []string
	for a := range strings.SplitSeq(f.meta, ",") {
		if a = strings.TrimSpace(a); a != "" {
			addrs = append(addrs, a)
		}
	}
	if len(addrs) == 0 {
		return client.Config{}, usagef("--meta: no addresses in %q", f.meta)
	}
	if ak, sk, ca, ok := f.keys(); ok {
		if ak == "" || sk == "" {
			return client.Config{}, usagef("an access key needs its secret key (--secret-key or $BASALT_SECRET_KEY)")
		}
		if ca == "" {
			return client.Config{}, usagef("--access-key needs --ca-cert (the cluster CA, ca.pem; basalt dev keeps it in DATA_DIR/tls)")
		}
		return client.Config{MetaAddrs: addrs, Location: f.location, AccessKey: ak, SecretKey: sk, CACertFile: ca}, nil
	}
	creds, err := f.tls.load(nil)
	if err != nil {
		return client.Config{}, err
	}
	return client.Config{MetaAddrs: addrs, Location: f.location, Credentials: creds}, nil
}

// keys decides whether the tool authenticates with S3 keys (ok) rather
// than a certificate: --access-key or --ca-cert given, or
// $BASALT_ACCESS_KEY set and no --tls-dir. The AWS variables are a
// fallback only with --ca-cert (many shells have them set for other
// tools).
func (f *connFlags) keys() (ak, sk, ca string, ok bool) {
	ca = f.caCert
	if ca == "" {
		ca = os.Getenv("BASALT_CA_CERT")
	}
	first := func(vs ...string) string {
		for _, v := range vs {
			if v != "" {
				return v
			}
		}
		return ""
	}
	awsAK, awsSK := "", ""
	if f.caCert != "" {
		awsAK, awsSK = os.Getenv("AWS_ACCESS_KEY_ID"), os.Getenv("AWS_SECRET_ACCESS_KEY")
	}
	ak = first(f.accessKey, os.Getenv("BASALT_ACCESS_KEY"), awsAK)
	sk = first(f.secretKey, os.Getenv("BASALT_SECRET_KEY"), awsSK)
	ok = f.accessKey != "" || f.caCert != "" || (os.Getenv("BASALT_ACCESS_KEY") != "" && f.tls.dir == "")
	return ak, sk, ca, ok
}

func (f *connFlags) client(mod func(*client.Config)) (*client.Client, error) {
	cfg, err := f.config()
	if err != nil {
		return nil, err
	}
	if mod != nil {
		mod(&cfg)
	}
	return client.New(cfg)
}

// objPath is a parsed Ozone-style path: /volume[/bucket[/key]].
type objPath struct {
	Volume, Bucket, Key string
}

func (p objPath) String() string {
	s := "/" + p.Volume
	if p.Bucket != "" {
		s += "/" + p.Bucket
	}
	if p.Key != "" {
		s += "/" + p.Key
	}
	return s
}

// Path depths.
const (
	depthVolume = 1
	depthBucket = 2
	depthKey    = 3
)

// parsePath parses "/vol", "/vol/bucket" or "/vol/bucket/key" (the key may
// contain slashes) and requires exactly depth levels. An "o3://host/" style
// prefix is not supported; --meta says which cluster.
func parsePath(s string, depth int) (objPath, error) {
	what := [...]string{"", "/volume", "/volume/bucket", "/volume/bucket/key"}[depth]
	if !strings.HasPrefix(s, "/") {
		return objPath{}, usagef("path %q must start with \"/\" (want %s)", s, what)
	}
	rest := s[1:]
	var p objPath
	parts := strings.SplitN(rest, "/", 3)
	switch {
	case depth == depthVolume:
		rest = strings.TrimSuffix(rest, "/")
		if rest == "" || strings.Contains(rest, "/") {
			return objPath{}, usagef("path %q: want %s", s, what)
		}
		p.Volume = rest
	case depth == depthBucket:
		rest = strings.TrimSuffix(rest, "/")
		parts = strings.Split(rest, "/")
		if len(parts) != 2 || parts[0] == "" || parts[1] == "" {
			return objPath{}, usagef("path %q: want %s", s, what)
		}
		p.Volume, p.Bucket = parts[0], parts[1]
	default:
		if len(parts) != 3 || parts[0] == "" || parts[1] == "" || parts[2] == "" {
			return objPath{}, usagef("path %q: want %s", s, what)
		}
		p.Volume, p.Bucket, p.Key = parts[0], parts[1], parts[2]
	}
	return p, nil
}

// printJSON writes v as indented JSON.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// table prints aligned columns.
type table struct{ tw *tabwriter.Writer }

func newTable(w io.Writer, header ...string) *table {
	t := &table{tw: tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)}
	t.row(toAny(header)...)
	return t
}

func toAny(s []string) []any {
	out := make([]any, len(s))
	for i, v := range s {
		out[i] = v
	}
	return out
}

func (t *table) row(cells ...any) {
	for i, c := range cells {
		if i > 0 {
			fmt.Fprint(t.tw, "\t")
		}
		fmt.Fprint(t.tw, c)
	}
	fmt.Fprintln(t.tw)
}

func (t *table) flush() error { return t.tw.Flush() }

func fmtTime(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.Local().Format("2006-01-02 15:04:05")
}

// fmtBytes prints a size in binary units.
func fmtBytes(n uint64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := uint64(unit), 0
	for m := n / unit; m >= unit && exp < 5; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// isTerminal reports whether f is a character device (a terminal).
func isTerminal(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// progress is a one-line progress bar on stderr, redrawn at most 10 times
// a second. total < 0 means unknown.
type progress struct {
	mu    sync.Mutex
	w     io.Writer
	label string
	total int64
	done  int64
	start time.Time
	last  time.Time
	unit  string // "bytes" or "ops"
}

func newProgress(enabled bool, label string, total int64, unit string) *progress {
	if !enabled {
		return nil
	}
	return &progress{w: os.Stderr, label: label, total: total, start: time.Now(), unit: unit}
}

// set records the absolute amount done.
func (p *progress) set(n int64) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done = n
	p.draw(false)
}

// add records more done.
func (p *progress) add(n int64) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done += n
	p.draw(false)
}

func (p *progress) finish() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.draw(true)
	fmt.Fprintln(p.w)
}

func (p *progress) amount(n int64) string {
	if p.unit == "bytes" {
		return fmtBytes(uint64(n))
	}
	return fmt.Sprint(n)
}

func (p *progress) draw(force bool) {
	now := time.Now()
	if !force && now.Sub(p.last) < 100*time.Millisecond {
		return
	}
	p.last = now
	el := now.Sub(p.start).Seconds()
	rate := ""
	if el > 0 {
		r := float64(p.done) / el
		if p.unit == "bytes" {
			rate = fmtBytes(uint64(r)) + "/s"
		} else {
			rate = fmt.Sprintf("%.0f ops/s", r)
		}
	}
	const width = 30
	if p.total > 0 {
		frac := min(float64(p.done)/float64(p.total), 1)
		fill := int(frac * width)
		fmt.Fprintf(p.w, "\r%s [%s%s] %3.0f%% %s/%s %s   ", p.label, strings.Repeat("=", fill), strings.Repeat(" ", width-fill),
			frac*100, p.amount(p.done), p.amount(p.total), rate)
		return
	}
	fmt.Fprintf(p.w, "\r%s %s %s   ", p.label, p.amount(p.done), rate)
}
