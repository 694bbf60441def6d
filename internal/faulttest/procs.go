package faulttest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Proc is one server process the harness started. It is signalled only
// through the PID of the process it started; a process that exits without
// the harness asking for it is recorded as a crash.
type Proc struct {
	Name    string
	Bin     string
	Args    []string
	LogPath string

	// onCrash, if set, is called (on the waiting goroutine) when the
	// process exits without Kill having been called for it.
	onCrash func(p *Proc, err error, tail string)

	mu       sync.Mutex
	cmd      *exec.Cmd
	done     chan struct{}
	exitErr  error
	expected bool // the harness killed it: not a crash
	stopped  bool // SIGSTOP sent, no SIGCONT yet
	starts   int
}

// Start starts the process, appending its output to LogPath.
func (p *Proc) Start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil && !isDone(p.done) {
		return fmt.Errorf("%s: already running (pid %d)", p.Name, p.cmd.Process.Pid)
	}
	f, err := os.OpenFile(p.LogPath, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	fmt.Fprintf(f, "=== harness %s: start #%d: %s %s\n", time.Now().UTC().Format(time.RFC3339Nano), p.starts+1, p.Bin, strings.Join(p.Args, " "))
	cmd := exec.Command(p.Bin, p.Args...)
	cmd.Stdout, cmd.Stderr = f, f
	// If the test binary dies (a go test timeout), the kernel kills the
	// servers too, so no process outlives the test.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("%s: start: %w", p.Name, err)
	}
	p.starts++
	p.cmd, p.done, p.exitErr, p.expected, p.stopped = cmd, make(chan struct{}), nil, false, false
	done := p.done
	go func() {
		err := cmd.Wait()
		fmt.Fprintf(f, "=== harness %s: exited: %v\n", time.Now().UTC().Format(time.RFC3339Nano), err)
		f.Close()
		p.mu.Lock()
		p.exitErr = err
		expected := p.expected
		cb := p.onCrash
		p.mu.Unlock()
		close(done)
		if !expected && cb != nil {
			cb(p, err, tailFile(p.LogPath, 40))
		}
	}()
	return nil
}

// Pid returns the PID of the running process (0 if none).
func (p *Proc) Pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || isDone(p.done) {
		return 0
	}
	return p.cmd.Process.Pid
}

// Running reports whether the process started last has not exited.
func (p *Proc) Running() bool { return p.Pid() != 0 }

// Kill sends SIGKILL to the process (resuming it first is not needed:
// SIGKILL ends a stopped process too) and waits up to 10 s for it to exit.
func (p *Proc) Kill() error {
	p.mu.Lock()
	if p.cmd == nil || isDone(p.done) {
		p.mu.Unlock()
		return nil
	}
	p.expected = true
	pid, done := p.cmd.Process.Pid, p.done
	err := syscall.Kill(pid, syscall.SIGKILL)
	p.mu.Unlock()
	if err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("%s: kill %d: %w", p.Name, pid, err)
	}
	select {
	case <-done:
		return nil
	case <-time.After(10 * time.Second):
		return fmt.Errorf("%s: pid %d did not exit within 10s of SIGKILL", p.Name, pid)
	}
}

// Stop sends SIGSTOP; Cont sends SIGCONT.
func (p *Proc) Stop() error { return p.signal(syscall.SIGSTOP, true) }
func (p *Proc) Cont() error { return p.signal(syscall.SIGCONT, false) }

func (p *Proc) signal(sig syscall.Signal, stopped bool) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || isDone(p.done) {
		return fmt.Errorf("%s: not running", p.Name)
	}
	if err := syscall.Kill(p.cmd.Process.Pid, sig); err != nil {
		return fmt.Errorf("%s: %v to pid %d: %w", p.Name, sig, p.cmd.Process.Pid, err)
	}
	p.stopped = stopped
	return nil
}

// Restart kills the process if it runs and starts it again with the same
// arguments (same ports, same data directory).
func (p *Proc) Restart() error {
	if err := p.Kill(); err != nil {
		return err
	}
	return p.Start()
}

func isDone(c chan struct{}) bool {
	if c == nil {
		return true
	}
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// tailFile returns the last n lines of a file.
func tailFile(path string, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > 4*n {
			lines = append(lines[:0], lines[len(lines)-n:]...)
		}
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// grepCount counts the lines of a file containing any of the substrings
// (case-insensitive) and returns up to max of them.
func grepCount(path string, max int, subs ...string) (int, []string) {
	f, err := os.Open(path)
	if err != nil {
		return 0, nil
	}
	defer f.Close()
	n := 0
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		l := strings.ToLower(sc.Text())
		for _, s := range subs {
			if strings.Contains(l, strings.ToLower(s)) {
				n++
				if len(out) < max {
					out = append(out, truncate(sc.Text(), 400))
				}
				break
			}
		}
	}
	return n, out
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// freePorts reserves n distinct loopback ports by listening on port 0 and
// closing the listeners; servers are restarted on the same ports, so the
// ports must be fixed up front.
func freePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	var out []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		out = append(out, l.Addr().(*net.TCPAddr).Port)
	}
	return out, nil
}

// waitPort waits until addr accepts TCP connections.
func waitPort(ctx context.Context, addr string) error {
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s not accepting connections: %w (last: %v)", addr, ctx.Err(), err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// buildBinary builds cmd/basalt into dir, unless BASALT_BIN names a binary.
func buildBinary(dir string) (string, error) {
	if b := os.Getenv("BASALT_BIN"); b != "" {
		return filepath.Abs(b)
	}
	bin := filepath.Join(dir, "basalt")
	cmd := exec.Command("go", "build", "-o", bin, "github.com/basalt-store/basalt/cmd/basalt")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build: %v\n%s", err, out)
	}
	return bin, nil
}
