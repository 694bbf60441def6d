//go:build linux || darwin || freebsd || netbsd || openbsd || dragonfly

package stream

import (
	"errors"
	"io"
	"net"
	"syscall"
)

// peekClosed peeks at raw's socket without blocking (MSG_PEEK|MSG_DONTWAIT).
func peekClosed(raw net.Conn) error {
	sc, ok := raw.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return err
	}
	var n int
	var perr error
	var b [1]byte
	err = rc.Read(func(fd uintptr) bool {
		n, _, perr = syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		return true // never wait for readiness
	})
	switch {
	case err != nil:
		return err // closed on our side
	case perr == nil && n == 0:
		return io.EOF
	case perr == nil:
		return errPeerSentData
	case errors.Is(perr, syscall.EAGAIN) || errors.Is(perr, syscall.EWOULDBLOCK) || errors.Is(perr, syscall.EINTR):
		return nil
	}
	return perr
}
