package pki

import (
	"bufio"
	"context"
	"crypto/aes"
	"crypto/cipher"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// The server CPU of serving bulk data over gRPC, measured apart from the
// client: BenchmarkGRPCServe runs the server in a child process (this test
// binary, re-run with PKI_BENCH_SERVER set) and reads its CPU time from
// /proc. Both ends in one process, as in BenchmarkBatchedTLS, mix the
// receiver's decryption into the sender's cost.

func TestMain(m *testing.M) {
	if mode := os.Getenv("PKI_BENCH_SERVER"); mode != "" {
		if err := benchServer(mode, os.Getenv("PKI_BENCH_DIR")); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// benchDesc is a server-streaming method: the request names how many
// 1 MiB messages to send.
var benchDesc = grpc.ServiceDesc{
	ServiceName: "pkibench.Blob",
	HandlerType: (*any)(nil),
	Streams: []grpc.StreamDesc{{StreamName: "Get", ServerStreams: true, Handler: func(_ any, ss grpc.ServerStream) error {
		var req []byte
		if err := ss.RecvMsg(&req); err != nil {
			return err
		}
		n, err := strconv.Atoi(string(req))
		if err != nil {
			return err
		}
		for range n {
			if err := ss.SendMsg(&benchMsg); err != nil {
				return err
			}
		}
		return nil
	}}},
}

var benchMsg = make([]byte, 1<<20)

// benchServer serves benchDesc on loopback in mode "plain", "tls" (crypto/
// tls as gRPC's credentials use it) or "batched" (BatchedTLS), with the
// write buffer given after a colon ("tls:32768"), and prints its address.
func benchServer(mode, dir string) error {
	kind, wbuf, _ := strings.Cut(mode, ":")
	size, err := strconv.Atoi(wbuf)
	if err != nil {
		return err
	}
	opts := []grpc.ServerOption{grpc.ForceServerCodec(bytesCodec{}), grpc.WriteBufferSize(size), grpc.SharedWriteBuffer(true)}
	if kind != "plain" {
		c, err := Load(dir)
		if err != nil {
			return err
		}
		creds := credentials.NewTLS(c.ServerTLS())
		if kind == "batched" {
			creds = BatchedTLS(c.ServerTLS())
		}
		opts = append(opts, grpc.Creds(creds))
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	s := grpc.NewServer(opts...)
	s.RegisterService(&benchDesc, nil)
	if p := os.Getenv("PKI_BENCH_CPUPROFILE"); p != "" {
		f, err := os.Create(fmt.Sprintf("%s.%s", p, strings.ReplaceAll(mode, ":", "-")))
		if err != nil {
			return err
		}
		pprof.StartCPUProfile(f)
		defer f.Close()
		defer pprof.StopCPUProfile()
	}
	fmt.Println(ln.Addr())
	go func() {
		io.Copy(io.Discard, os.Stdin) // the parent went away: stop
		s.Stop()
	}()
	return s.Serve(ln)
}

// BenchmarkAESGCM is the floor under any TLS hop: sealing 16 KiB records
// with AES-128-GCM (the suite crypto/tls picks here), one core.
func BenchmarkAESGCM(b *testing.B) {
	blk, err := aes.NewCipher(make([]byte, 16))
	if err != nil {
		b.Fatal(err)
	}
	g, err := cipher.NewGCM(blk)
	if err != nil {
		b.Fatal(err)
	}
	nonce := make([]byte, g.NonceSize())
	rec := make([]byte, 16<<10)
	out := make([]byte, 0, len(rec)+g.Overhead())
	b.SetBytes(int64(len(rec)))
	// CPU time, not wall time: this machine is shared.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	t0 := threadCPU()
	for range b.N {
		out = g.Seal(out[:0], nonce, rec, nil)
	}
	b.ReportMetric((threadCPU()-t0).Seconds()/(float64(b.N)*float64(len(rec))/(1<<30)), "cpu-s/GiB")
}

// procCPU is a process's user and system CPU time from /proc.
func procCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * (time.Second / 100), nil // USER_HZ
}

// BenchmarkGRPCServe streams 1 MiB messages from a server process:
// server-cpu-s/GiB is what a datanode pays per GiB read.
func BenchmarkGRPCServe(b *testing.B) {
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		b.Skip("no /proc")
	}
	ca, err := NewCA("bench")
	if err != nil {
		b.Fatal(err)
	}
	dir := b.TempDir()
	srvC, _ := ca.Issue(Identity{Role: RoleDatanode, ID: "1"}, time.Hour)
	cliC, _ := ca.Issue(Identity{Role: RoleClient, ID: "c"}, time.Hour)
	if err := srvC.Save(filepath.Join(dir, "srv")); err != nil {
		b.Fatal(err)
	}
	for _, mode := range strings.Fields(benchModes) {
		b.Run(strings.ReplaceAll(mode, ":", "-wbuf"), func(b *testing.B) {
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), "PKI_BENCH_SERVER="+mode, "PKI_BENCH_DIR="+filepath.Join(dir, "srv"))
			stdin, _ := cmd.StdinPipe()
			stdout, _ := cmd.StdoutPipe()
			cmd.Stderr = os.Stderr
			if err := cmd.Start(); err != nil {
				b.Fatal(err)
			}
			defer func() { stdin.Close(); cmd.Wait() }()
			addr, err := bufio.NewReader(stdout).ReadString('\n')
			if err != nil {
				b.Fatal(err)
			}
			dial := cliC.GRPCDialOption(RoleDatanode)
			if strings.HasPrefix(mode, "plain") {
				dial = grpc.WithTransportCredentials(insecure.NewCredentials())
			}
			conn, err := grpc.NewClient(strings.TrimSpace(addr), dial,
				grpc.WithDefaultCallOptions(grpc.ForceCodec(bytesCodec{}), grpc.MaxCallRecvMsgSize(4<<20)),
				grpc.WithInitialWindowSize(16<<20), grpc.WithInitialConnWindowSize(64<<20), grpc.WithReadBufferSize(0))
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Close()
			get := func(n int) {
				st, err := conn.NewStream(context.Background(), &benchDesc.Streams[0], "/pkibench.Blob/Get")
				if err != nil {
					b.Fatal(err)
				}
				req := []byte(strconv.Itoa(n))
				if err := st.SendMsg(&req); err != nil {
					b.Fatal(err)
				}
				st.CloseSend()
				for {
					var m []byte
					if err := st.RecvMsg(&m); errors.Is(err, io.EOF) {
						return
					} else if err != nil {
						b.Fatal(err)
					}
				}
			}
			get(4) // connect and warm up
			b.SetBytes(1 << 20)
			b.ResetTimer()
			cpu0, _ := procCPU(cmd.Process.Pid)
			get(b.N)
			cpu1, err := procCPU(cmd.Process.Pid)
			if err != nil {
				b.Fatal(err)
			}
			b.ReportMetric((cpu1-cpu0).Seconds()/(float64(b.N)/1024), "server-cpu-s/GiB")
		})
	}
}

// benchModes are BenchmarkGRPCServe's server set-ups: credentials, then
// gRPC's write buffer size ($PKI_BENCH_MODES replaces the list).
var benchModes = func() string {
	if m := os.Getenv("PKI_BENCH_MODES"); m != "" {
		return m
	}
	return "plain:32768 tls:32768 tls:1048576 batched:32768 batched:1048576"
}()
