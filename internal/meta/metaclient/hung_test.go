package metaclient

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TestMain lets the test binary act as a meta node in a child process
// (METACLIENT_TEST_SERVE=1): a test can then SIGSTOP a real process, the
// gray failure the prober exists for.
func TestMain(m *testing.M) {
	if os.Getenv("METACLIENT_TEST_SERVE") == "1" {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			fmt.Println("ERR", err)
			os.Exit(1)
		}
		g := grpc.NewServer()
		metapb.RegisterNamespaceServer(g, &scripted{})
		fmt.Println("ADDR", lis.Addr().String())
		g.Serve(lis)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// startStoppable starts a meta node stand-in in a child process and
// returns its address and PID (killed at cleanup).
func startStoppable(t *testing.T) (string, int) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "METACLIENT_TEST_SERVE=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL); cmd.Wait() })
	line := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if a, ok := strings.CutPrefix(sc.Text(), "ADDR "); ok {
				line <- a
				return
			}
		}
		close(line)
	}()
	select {
	case a, ok := <-line:
		if !ok {
			t.Fatal("child exited without serving")
		}
		return a, pid
	case <-time.After(30 * time.Second):
		t.Fatal("child did not start serving within 30s")
	}
	return "", 0
}

// A leader that hangs (SIGSTOP: its kernel keeps the connection open and
// takes the request, nothing answers) is abandoned within a few seconds:
// a read goes on to the next node and succeeds; a commit, which the hung
// node may still hold, comes back OUTCOME_UNKNOWN without being sent
// anywhere else; later calls avoid the hung node at once. A listener that
// accepts and never speaks is abandoned the same way. On the old client
// each call waited for its whole deadline.
func TestHungLeaderIsAbandoned(t *testing.T) {
	stopped, pid := startStoppable(t)
	healthy := &scripted{}
	good := serve(t, healthy)
	c, err := New(Config{Addrs: []string{stopped, good}, Backoff: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// The first call goes to the first address: the connection is made
	// and the stand-in answers while it runs.
	if _, err := c.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{}); err != nil || c.Leader("Namespace") != stopped {
		t.Fatalf("lookup before the stop: %v (leader %q)", err, c.Leader("Namespace"))
	}
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer syscall.Kill(pid, syscall.SIGCONT)
	waitStopped(t, pid)

	start := time.Now()
	if _, err := c.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{}); err != nil {
		t.Fatalf("lookup with the leader stopped: %v", err)
	}
	took := time.Since(start)
	t.Logf("read abandoned the stopped node and succeeded elsewhere in %v", took)
	if took > 5*time.Second || healthy.calls != 1 || !c.Suspect(stopped) {
		t.Fatalf("read took %v, %d calls on the healthy node, stopped node suspect %v", took, healthy.calls, c.Suspect(stopped))
	}
	// Now a node is suspect: a commit goes to the healthy node at once.
	start = time.Now()
	if _, err := c.Namespace.CommitKey(ctx, &metapb.CommitKeyRequest{}); err != nil || time.Since(start) > time.Second {
		t.Fatalf("commit with a suspect node: %v after %v", err, time.Since(start))
	}

	// A commit caught by the hung node: OUTCOME_UNKNOWN, never resent.
	c2, err := New(Config{Addrs: []string{stopped, good}, Backoff: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	before := healthy.calls
	start = time.Now()
	_, err = c2.Namespace.CommitKey(ctx, &metapb.CommitKeyRequest{})
	took = time.Since(start)
	if status.Code(err) != codes.Unknown || reason(err) != metapb.ReasonOutcomeUnknown || healthy.calls != before {
		t.Fatalf("commit to the stopped node: %v (reason %q) after %v, %d calls elsewhere; want OUTCOME_UNKNOWN and none", err, reason(err), took, healthy.calls-before)
	}
	if took > 5*time.Second {
		t.Fatalf("commit to the stopped node took %v to be abandoned", took)
	}
	t.Logf("commit to the stopped node abandoned as OUTCOME_UNKNOWN in %v", took)

	// A listener that accepts and never says a word.
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	go func() {
		var held []net.Conn
		defer func() {
			for _, c := range held {
				c.Close()
			}
		}()
		for {
			conn, err := lis.Accept()
			if err != nil {
				return
			}
			held = append(held, conn)
		}
	}()
	c3, err := New(Config{Addrs: []string{lis.Addr().String(), good}, Backoff: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c3.Close()
	start = time.Now()
	if _, err := c3.Namespace.LookupKey(ctx, &metapb.LookupKeyRequest{}); err != nil || time.Since(start) > 5*time.Second {
		t.Fatalf("lookup with a silent first node: %v after %v", err, time.Since(start))
	}
	t.Logf("silent listener abandoned in %v", time.Since(start))

	// After SIGCONT the node answers probes again and is used again.
	syscall.Kill(pid, syscall.SIGCONT)
	if !c.prober.Probe(c.conns[stopped][0]) {
		t.Fatal("the resumed node does not answer a probe")
	}
}

// waitStopped waits until every thread of pid is stopped (signal delivery
// is asynchronous: a running thread may still answer for a moment).
func waitStopped(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		stopped := len(tasks) > 0
		for _, task := range tasks {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, task.Name()))
			// The state follows the command name in parentheses.
			if i := strings.LastIndexByte(string(b), ')'); err != nil || i < 0 || i+2 >= len(b) || b[i+2] != 'T' && b[i+2] != 't' {
				stopped = false
				break
			}
		}
		if stopped {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("pid %d did not stop within 10s of SIGSTOP", pid)
}

// A slow but live node keeps its calls: probes are answered, so a call
// that takes longer than several probe periods is not abandoned.
func TestSlowNodeIsNotAbandoned(t *testing.T) {
	srv := &slow{delay: 3 * time.Second}
	addr := serve(t, srv)
	c, err := New(Config{Addrs: []string{addr}, ProbeAfter: 300 * time.Millisecond, ProbeTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := c.Namespace.CommitKey(ctx, &metapb.CommitKeyRequest{}); err != nil {
		t.Fatalf("slow commit: %v", err)
	}
	if srv.calls != 1 {
		t.Fatalf("%d calls, want 1", srv.calls)
	}
}

type slow struct {
	metapb.UnimplementedNamespaceServer
	delay time.Duration
	calls int
}

func (s *slow) CommitKey(ctx context.Context, _ *metapb.CommitKeyRequest) (*metapb.KeyInfo, error) {
	s.calls++
	select {
	case <-time.After(s.delay):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return &metapb.KeyInfo{}, nil
}
