package client

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Sentinels. Errors returned by the client match at most one of them with
// errors.Is (ErrInvalidName also matches ErrInvalidArgument).
var (
	ErrNotFound         = errors.New("not found")
	ErrExists           = errors.New("already exists")
	ErrInvalidArgument  = errors.New("invalid argument")
	ErrInvalidName      = fmt.Errorf("invalid name: %w", ErrInvalidArgument)
	ErrNotEmpty         = errors.New("not empty")
	ErrPrecondition     = errors.New("failed precondition")
	ErrLimit            = errors.New("limit exceeded")
	ErrUnavailable      = errors.New("service unavailable")
	ErrCorrupt          = errors.New("data corrupt on every replica")
	ErrWriteFailed      = errors.New("write failed after retries")
	ErrPermissionDenied = errors.New("permission denied")
)

// Error is an error from a Basalt service (or the client's own checks)
// for one operation.
type Error struct {
	Op   string     // e.g. "create bucket /vol/b"
	Code codes.Code // gRPC code, codes.Unknown if not from a service
	Msg  string     // server message; names the input
	kind error      // sentinel
}

func (e *Error) Error() string { return e.Op + ": " + e.Msg }

// Unwrap returns the sentinel the error matches.
func (e *Error) Unwrap() error { return e.kind }

// Is lets ErrInvalidName match every invalid-argument error: the services
// answer InvalidArgument for bad names, and name checks are what users hit.
func (e *Error) Is(target error) bool {
	return target == ErrInvalidName && e.kind == ErrInvalidArgument
}

// wrapErr turns a gRPC error into an *Error for op. Context errors of the
// caller are returned as they are, wrapped with op, so errors.Is(err,
// context.Canceled) keeps working.
func wrapErr(op string, err error) error {
	if err == nil {
		return nil
	}
	var ce *Error
	if errors.As(err, &ce) {
		return err
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%s: %w", op, err)
	}
	st, ok := status.FromError(err)
	if !ok {
		return fmt.Errorf("%s: %w", op, err)
	}
	e := &Error{Op: op, Code: st.Code(), Msg: st.Message()}
	switch st.Code() {
	case codes.NotFound:
		e.kind = ErrNotFound
	case codes.AlreadyExists:
		e.kind = ErrExists
	case codes.InvalidArgument, codes.OutOfRange:
		e.kind = ErrInvalidArgument
	case codes.FailedPrecondition:
		e.kind = ErrPrecondition
		if containsFold(st.Message(), "not empty") {
			e.kind = ErrNotEmpty
		}
	case codes.ResourceExhausted:
		e.kind = ErrLimit
	case codes.Unavailable:
		e.kind = ErrUnavailable
	case codes.DeadlineExceeded:
		e.kind = context.DeadlineExceeded
	case codes.Canceled:
		e.kind = context.Canceled
	case codes.PermissionDenied, codes.Unauthenticated:
		e.kind = ErrPermissionDenied
	case codes.DataLoss:
		e.kind = ErrCorrupt
	default:
		e.kind = errors.New(st.Code().String())
	}
	return e
}

func containsFold(s, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		match := true
		for j := 0; j < len(sub); j++ {
			a, b := s[i+j], sub[j]
			if 'A' <= a && a <= 'Z' {
				a += 'a' - 'A'
			}
			if a != b {
				match = false
				break
			}
		}
		if match {
			return true
		}
	}
	return false
}

func invalidf(op, format string, args ...any) error {
	return &Error{Op: op, Code: codes.InvalidArgument, Msg: fmt.Sprintf(format, args...), kind: ErrInvalidArgument}
}

// FromRPC converts an error of a raw service call (Client.Scm,
// Client.Namespace) into an *Error for op, as the client's own methods do.
func FromRPC(op string, err error) error { return wrapErr(op, err) }
