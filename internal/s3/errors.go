package s3

import (
	"context"
	"encoding/xml"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/namespace"
)

// Error is an S3 error: the code and HTTP status S3 itself would answer
// with (https://docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html).
type Error struct {
	Code    string
	Status  int
	Message string
	// Region, if set, goes in the error document (and as
	// x-amz-bucket-region): the region a wrongly scoped request must use.
	Region string
}

func (e *Error) Error() string { return e.Code + ": " + e.Message }

func errorf(code string, st int, format string, args ...any) *Error {
	return &Error{Code: code, Status: st, Message: fmt.Sprintf(format, args...)}
}

// The errors this gateway answers with.
func errAccessDenied(msg string) *Error { return errorf("AccessDenied", 403, "%s", msg) }
func errInvalidArgument(format string, args ...any) *Error {
	return errorf("InvalidArgument", 400, format, args...)
}
func errInvalidRequest(format string, args ...any) *Error {
	return errorf("InvalidRequest", 400, format, args...)
}
func errNotImplemented(what string) *Error {
	return errorf("NotImplemented", 501, "%s is not implemented by this gateway", what)
}
func errMalformedXML(err error) *Error {
	return errorf("MalformedXML", 400, "The XML you provided was not well-formed or did not validate against our published schema: %v", err)
}

var (
	errNoSuchBucket = func(b string) *Error {
		return errorf("NoSuchBucket", 404, "The specified bucket does not exist: %s", b)
	}
	errNoSuchKey = func(k string) *Error {
		return errorf("NoSuchKey", 404, "The specified key does not exist: %s", k)
	}
	errNoSuchUpload = func(id string) *Error {
		return errorf("NoSuchUpload", 404, "The specified multipart upload does not exist: %s", id)
	}
	errPreconditionFailed = errorf("PreconditionFailed", 412, "At least one of the pre-conditions you specified did not hold")
	errMethodNotAllowed   = errorf("MethodNotAllowed", 405, "The specified method is not allowed against this resource")
	errInternal           = func(err error) *Error {
		return errorf("InternalError", 500, "We encountered an internal error: %v", err)
	}
)

// errorBody is S3's XML error document.
type errorBody struct {
	XMLName   xml.Name `xml:"Error"`
	Code      string   `xml:"Code"`
	Message   string   `xml:"Message"`
	Resource  string   `xml:"Resource,omitempty"`
	Region    string   `xml:"Region,omitempty"`
	RequestID string   `xml:"RequestId"`
}

// fromBasalt maps an error of the client or the namespace manager to the
// S3 error for the resource (bucket, key) the request named.
func fromBasalt(err error, bucket, key string) *Error {
	var se *Error
	if errors.As(err, &se) {
		return se
	}
	reason := namespace.Reason(rpcCause(err))
	var ce *client.Error
	if reason == "" && errors.As(err, &ce) {
		reason = ce.Reason
	}
	switch reason {
	case namespace.ReasonNoSuchUpload:
		return errNoSuchUpload("")
	case namespace.ReasonInvalidPart:
		return errorf("InvalidPart", 400, "One or more of the specified parts could not be found, or its entity tag did not match: %s", message(err))
	case namespace.ReasonInvalidPartOrder:
		return errorf("InvalidPartOrder", 400, "The list of parts was not in ascending order: %s", message(err))
	case namespace.ReasonEntityTooSmall:
		return errorf("EntityTooSmall", 400, "Your proposed upload is smaller than the minimum allowed object size: %s", message(err))
	case namespace.ReasonPreconditionFailed:
		return errPreconditionFailed
	case namespace.ReasonVersionChanged:
		return errorf("OperationAborted", 409, "A conflicting conditional operation is in progress against this resource: %s", message(err))
	}
	if _, ok := status.FromError(err); ok && !errors.As(err, &ce) {
		err = client.FromRPC("namespace", err) // a raw RPC error: classify it
	}
	msg := message(err)
	switch {
	case errors.Is(err, context.Canceled):
		return errorf("RequestTimeout", 400, "The request was canceled: %v", err)
	case errors.Is(err, context.DeadlineExceeded):
		return errorf("ServiceUnavailable", 503, "Timed out: %v", err)
	// The namespace says what is missing (client.Err*NotFound); the
	// gateway's volume missing means no bucket exists yet.
	case errors.Is(err, client.ErrUploadNotFound):
		return errNoSuchUpload("")
	case errors.Is(err, client.ErrBucketNotFound), errors.Is(err, client.ErrVolumeNotFound):
		return errNoSuchBucket(bucket)
	case errors.Is(err, client.ErrKeyNotFound):
		return errNoSuchKey(key)
	case errors.Is(err, client.ErrNotFound):
		// Not named (e.g. an open key that expired during the write): the
		// resource the request addressed.
		if key == "" {
			return errNoSuchBucket(bucket)
		}
		return errNoSuchKey(key)
	case errors.Is(err, client.ErrPermissionDenied):
		// The namespace manager's own check (namespace.Authorizer).
		return errAccessDenied("Access Denied: " + msg)
	case errors.Is(err, client.ErrNotEmpty):
		return errorf("BucketNotEmpty", 409, "The bucket you tried to delete is not empty: %s", bucket)
	case errors.Is(err, client.ErrExists):
		return errorf("BucketAlreadyOwnedByYou", 409, "Your previous request to create the named bucket succeeded and you already own it: %s", bucket)
	case errors.Is(err, client.ErrInvalidArgument):
		if containsAny(msg, "key name") {
			return errorf("KeyTooLongError", 400, "%s", msg)
		}
		return errInvalidArgument("%s", msg)
	case errors.Is(err, client.ErrPrecondition):
		return errorf("InvalidRequest", 400, "%s", msg)
	case errors.Is(err, client.ErrNoSpace):
		return errorf("InsufficientStorage", 507, "The cluster has no room for the data: %s", msg)
	case errors.Is(err, client.ErrLimit):
		return errorf("EntityTooLarge", 400, "%s", msg)
	case errors.Is(err, client.ErrUnavailable), errors.Is(err, client.ErrWriteFailed):
		return errorf("ServiceUnavailable", 503, "Please reduce your request rate or retry: %s", msg)
	}
	return errInternal(err)
}

// rpcCause returns the gRPC status error inside err, for its details.
func rpcCause(err error) error {
	for e := err; e != nil; e = errors.Unwrap(e) {
		if _, ok := status.FromError(e); ok && status.Code(e) != codes.Unknown {
			return e
		}
	}
	var ce *client.Error
	if errors.As(err, &ce) {
		return status.Error(ce.Code, ce.Msg)
	}
	return err
}

func message(err error) string {
	var ce *client.Error
	if errors.As(err, &ce) {
		return ce.Msg
	}
	if st, ok := status.FromError(err); ok {
		return st.Message()
	}
	return err.Error()
}

func containsAny(s string, subs ...string) bool {
	for _, sub := range subs {
		if strings.Contains(s, sub) {
			return true
		}
	}
	return false
}

// writeError sends e as S3 does: XML body except for HEAD.
func writeError(w http.ResponseWriter, r *http.Request, e *Error, reqID string) {
	h := w.Header()
	h.Set("Content-Type", "application/xml")
	h.Set("x-amz-request-id", reqID)
	if e.Region != "" {
		h.Set("x-amz-bucket-region", e.Region)
	}
	if r.Method == http.MethodHead {
		w.WriteHeader(e.Status)
		return
	}
	body, _ := xml.Marshal(errorBody{Code: e.Code, Message: e.Message, Resource: r.URL.Path, Region: e.Region, RequestID: reqID})
	w.WriteHeader(e.Status)
	w.Write([]byte(xml.Header))
	w.Write(body)
}
