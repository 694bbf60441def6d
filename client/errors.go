package client

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Sentinels. Errors returned by the client match at most one of them with
// errors.Is, except that ErrInvalidName also matches ErrInvalidArgument and
// the Err*NotFound errors, which say what is missing, also match
// ErrNotFound.
var (
	ErrNotFound        = errors.New("not found")
	ErrVolumeNotFound  = fmt.Errorf("volume %w", ErrNotFound)
	ErrBucketNotFound  = fmt.Errorf("bucket %w", ErrNotFound)
	ErrKeyNotFound     = fmt.Errorf("key %w", ErrNotFound)
	ErrUploadNotFound  = fmt.Errorf("multipart upload %w", ErrNotFound)
	ErrExists          = errors.New("already exists")
	ErrInvalidArgument = errors.New("invalid argument")
	ErrInvalidName     = fmt.Errorf("invalid name: %w", ErrInvalidArgument)
	ErrNotEmpty        = errors.New("not empty")
	ErrPrecondition    = errors.New("failed precondition")
	ErrLimit           = errors.New("limit exceeded")
	ErrNoSpace         = fmt.Errorf("out of space: %w", ErrLimit) // the datanodes have no room for new data
	ErrUnavailable     = errors.New("service unavailable")
	ErrCorrupt         = errors.New("data corrupt on every replica")
	ErrWriteFailed     = errors.New("write failed after retries")
	// ErrOutcomeUnknown: a write reached a replicated log and then the
	// service lost track of it (a deadline, a stop, a leadership change):
	// it may or may not have been applied. The operation is failed, never
	// reported as done, nor retried as if it had not happened.
	ErrOutcomeUnknown   = errors.New("outcome unknown: the write may or may not have been applied")
	ErrPermissionDenied = errors.New("permission denied")
	// ErrInternal: the client's own consistency check failed (a bug or a
	// misbehaving server), not anything the caller asked for.
	ErrInternal = errors.New("internal error")
)

// Error is an error from a Basalt service (or the client's own checks)
// for one operation.
type Error struct {
	Op   string     // e.g. "create bucket /vol/b"
	Code codes.Code // gRPC code, codes.Unknown if not from a service
	Msg  string     // server message; names the input
	// Reason is the namespace's reason for the error (metapb.Reason*, ""
	// if it gave none): what is missing, which multipart check failed.
	Reason string
	kind   error // sentinel
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
	e := &Error{Op: op, Code: st.Code(), Msg: st.Message(), Reason: reasonOf(st)}
	if de := dnErrorOf(err); de != nil && de.Kind == datanodepb.Error_OUTCOME_UNKNOWN ||
		st.Code() == codes.Unknown && containsFold(st.Message(), "outcome unknown") {
		e.kind = ErrOutcomeUnknown
		return e
	}
	switch st.Code() {
	case codes.NotFound:
		switch e.Reason {
		case metapb.ReasonNoSuchVolume:
			e.kind = ErrVolumeNotFound
		case metapb.ReasonNoSuchBucket:
			e.kind = ErrBucketNotFound
		case metapb.ReasonNoSuchKey:
			e.kind = ErrKeyNotFound
		case metapb.ReasonNoSuchUpload:
			e.kind = ErrUploadNotFound
		default:
			e.kind = ErrNotFound
		}
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
		if containsFold(st.Message(), "out of space") {
			e.kind = ErrNoSpace
		}
	case codes.Unavailable:
		e.kind = ErrUnavailable
	case codes.DeadlineExceeded:
		// A server's (or one attempt's) timeout, not the caller's
		// deadline: that one arrives as a context error (above), because
		// the client checks ctx.Err() of the call's own context. A
		// datanode's REPLICAS_LAG carries this code too.
		e.kind = ErrUnavailable
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

// reasonOf returns the namespace's ErrorInfo reason in st's details.
func reasonOf(st *status.Status) string {
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.Domain == metapb.ReasonDomain {
			return ei.Reason
		}
	}
	return ""
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
