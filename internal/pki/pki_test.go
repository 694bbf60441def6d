package pki

import (
	"crypto/tls"
	"io"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"
)

func mustCA(t *testing.T) *CA {
	t.Helper()
	ca, err := NewCA("test CA")
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

func mustIssue(t *testing.T, ca *CA, role Role, id string) *Credentials {
	t.Helper()
	c, err := ca.Issue(Identity{Role: role, ID: id}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// handshake runs a TLS server with srv on loopback and dials it with cli
// (nil: plaintext). It returns the server's and client's errors and the
// identity the server saw.
func handshake(t *testing.T, srv, cli *tls.Config) (serr, cerr error, seen Identity) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			serr = err
			return
		}
		defer c.Close()
		tc := tls.Server(c, srv)
		tc.SetDeadline(time.Now().Add(10 * time.Second))
		if serr = tc.Handshake(); serr == nil {
			cs := tc.ConnectionState()
			seen, serr = PeerIdentity(&cs)
			tc.Write([]byte("ok"))
		}
	}()
	c, err := net.DialTimeout("tcp", ln.Addr().String(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if cli == nil {
		c.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
		_, cerr = io.ReadAll(c)
		if cerr == nil {
			cerr = io.EOF
		}
	} else {
		tc := tls.Client(c, cli)
		if cerr = tc.Handshake(); cerr == nil {
			// TLS 1.3: the server's verdict on our certificate arrives with
			// the first read.
			var b [2]byte
			_, cerr = io.ReadFull(tc, b[:])
		}
	}
	<-done
	return serr, cerr, seen
}

func TestMutualTLS(t *testing.T) {
	ca := mustCA(t)
	other := mustCA(t)
	meta := mustIssue(t, ca, RoleMeta, "1")
	dn := mustIssue(t, ca, RoleDatanode, "3f2a")
	cl := mustIssue(t, ca, RoleClient, "cli")
	stranger := mustIssue(t, other, RoleDatanode, "3f2a")

	noCert := dn.ClientTLS()
	noCert.GetClientCertificate = nil

	cases := []struct {
		name     string
		srv, cli *tls.Config
		ok       bool
		want     Identity
	}{
		{"member", dn.ServerTLS(), cl.ClientTLS(RoleDatanode), true, cl.Identity},
		{"role allowed", meta.ServerTLS(RoleDatanode), dn.ClientTLS(RoleMeta), true, dn.Identity},
		{"role refused by server", meta.ServerTLS(RoleDatanode), cl.ClientTLS(RoleMeta), false, Identity{}},
		{"role refused by client", dn.ServerTLS(), cl.ClientTLS(RoleMeta), false, Identity{}},
		{"wrong CA client", dn.ServerTLS(), stranger.ClientTLS(), false, Identity{}},
		{"wrong CA server", stranger.ServerTLS(), dn.ClientTLS(), false, Identity{}},
		{"no client certificate", dn.ServerTLS(), noCert, false, Identity{}},
		{"plaintext", dn.ServerTLS(), nil, false, Identity{}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			serr, cerr, seen := handshake(t, tc.srv, tc.cli)
			if tc.ok {
				if serr != nil || cerr != nil {
					t.Fatalf("server %v, client %v", serr, cerr)
				}
				if seen != tc.want {
					t.Fatalf("server saw %v, want %v", seen, tc.want)
				}
				return
			}
			if serr == nil && cerr == nil {
				t.Fatalf("connection accepted; server saw %v", seen)
			}
		})
	}
}

func TestIdentityParsing(t *testing.T) {
	for _, s := range []string{"basalt://meta/1", "basalt://datanode/0a1b-2c", "basalt://client/s3.gw_1"} {
		id, err := ParseIdentity(s)
		if err != nil || id.String() != s {
			t.Errorf("%s: %v %v", s, id, err)
		}
	}
	for _, s := range []string{"https://meta/1", "basalt://admin/1", "basalt://meta/", "basalt://meta/a/b", "basalt://meta/1?x=1", "basalt://u@meta/1",
		"basalt://client/" + strings.Repeat("a", 200)} {
		if id, err := ParseIdentity(s); err == nil {
			t.Errorf("%s parsed as %v", s, id)
		}
	}
	if _, err := (&CA{}).Issue(Identity{Role: "root", ID: "x"}, 0); err == nil {
		t.Error("issued a certificate of an unknown role")
	}
}

func TestFilesRoundTrip(t *testing.T) {
	dir := t.TempDir()
	p, err := NewProvisioner(dir)
	if err != nil {
		t.Fatal(err)
	}
	id := Identity{Role: RoleDatanode, ID: "abc"}
	c1, err := p.Credentials(id)
	if err != nil {
		t.Fatal(err)
	}
	// A second provisioner on the same directory keeps the CA and the
	// node's certificate.
	p2, err := NewProvisioner(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !p2.CA().Cert.Equal(p.CA().Cert) {
		t.Fatal("the CA was replaced")
	}
	c2, err := Load(p2.DirOf(id))
	if err != nil {
		t.Fatal(err)
	}
	if string(c2.certPEM) != string(c1.certPEM) || c2.Identity != id {
		t.Fatal("the node certificate changed")
	}
	if err := p.CA().Save(dir + "/ca"); err == nil {
		t.Fatal("Save replaced an existing CA")
	}
	// A certificate from another CA in the directory is refused.
	other := mustCA(t)
	oc := mustIssue(t, other, RoleClient, "x")
	oc.caPEM = c1.caPEM
	d := t.TempDir()
	if err := oc.Save(d); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(d); err == nil {
		t.Fatal("loaded a certificate the CA file does not sign")
	}
}

// BenchmarkLoopback moves 1 MiB writes over a loopback connection, with
// mutual TLS 1.3 and in plaintext: the cost of one TLS hop (encrypt on
// one side, decrypt on the other) per byte.
func BenchmarkLoopback(b *testing.B) {
	ca, err := NewCA("bench")
	if err != nil {
		b.Fatal(err)
	}
	srvC, _ := ca.Issue(Identity{Role: RoleDatanode, ID: "s"}, time.Hour)
	cliC, _ := ca.Issue(Identity{Role: RoleClient, ID: "c"}, time.Hour)
	for _, mode := range []string{"tls", "plain"} {
		b.Run(mode, func(b *testing.B) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			defer ln.Close()
			done := make(chan struct{})
			go func() {
				defer close(done)
				c, err := ln.Accept()
				if err != nil {
					return
				}
				if mode == "tls" {
					c = tls.Server(c, srvC.ServerTLS())
				}
				io.Copy(io.Discard, c)
				c.Close()
			}()
			c, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				b.Fatal(err)
			}
			if mode == "tls" {
				c = tls.Client(c, cliC.ClientTLS())
			}
			buf := make([]byte, 1<<20)
			b.SetBytes(int64(len(buf)))
			b.ResetTimer()
			cpu0 := cpuTime()
			for range b.N {
				if _, err := c.Write(buf); err != nil {
					b.Fatal(err)
				}
			}
			c.Close()
			<-done
			b.ReportMetric((cpuTime()-cpu0).Seconds()/(float64(b.N)/1024), "cpu-s/GiB")
			if tc, ok := c.(*tls.Conn); ok {
				b.ReportMetric(float64(tc.ConnectionState().CipherSuite), "suite")
			}
		})
	}
}

// cpuTime is the process's user and system CPU time (both ends of the
// benchmark's connection run in it).
func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
