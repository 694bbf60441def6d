package webhdfs

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/namespace"
)

// Java exception classes the WebHDFS client maps back into exceptions
// (RemoteException.unwrapRemoteException instantiates IOException
// subclasses by name; UnsupportedOperationException is thrown as such).
const (
	classFileNotFound      = "java.io.FileNotFoundException"
	classAlreadyExists     = "org.apache.hadoop.fs.FileAlreadyExistsException"
	classParentNotDir      = "org.apache.hadoop.fs.ParentNotDirectoryException"
	classNotEmpty          = "org.apache.hadoop.fs.PathIsNotEmptyDirectoryException"
	classAccessControl     = "org.apache.hadoop.security.AccessControlException"
	classIllegalArgument   = "java.lang.IllegalArgumentException"
	classUnsupported       = "java.lang.UnsupportedOperationException"
	classEOF               = "java.io.EOFException"
	classIO                = "java.io.IOException"
	classRetriable         = "org.apache.hadoop.ipc.RetriableException"
	classInvalidPathExcept = "org.apache.hadoop.fs.InvalidPathException"
)

// remoteError is an error the client sees as a RemoteException.
type remoteError struct {
	status int
	class  string
	msg    string
}

func (e *remoteError) Error() string { return e.class + ": " + e.msg }

// Statuses as the NameNode's ExceptionHandler sets them: FORBIDDEN for
// IOExceptions (and access control), NOT_FOUND for FileNotFoundException,
// BAD_REQUEST for illegal arguments and unsupported operations.
func remote(class, format string, args ...any) *remoteError {
	st := http.StatusForbidden
	switch class {
	case classFileNotFound:
		st = http.StatusNotFound
	case classIllegalArgument, classUnsupported, classInvalidPathExcept:
		st = http.StatusBadRequest
	case classRetriable:
		st = http.StatusServiceUnavailable
	}
	return &remoteError{status: st, class: class, msg: fmt.Sprintf(format, args...)}
}

func notFound(p fsPath) *remoteError {
	return remote(classFileNotFound, "File does not exist: %s", p)
}

func badParam(format string, args ...any) *remoteError {
	return remote(classIllegalArgument, format, args...)
}

func unsupported(format string, args ...any) *remoteError {
	return remote(classUnsupported, format, args...)
}

// toRemote turns a client error about p into the exception Hadoop expects.
// A FailedPrecondition from the namespace is a file standing where a
// directory is needed (the only precondition the fs calls check besides
// emptiness); callers that can tell it apart better check first.
func toRemote(p fsPath, err error) *remoteError {
	var re *remoteError
	if errors.As(err, &re) {
		return re
	}
	if re := delegationErr(err); re != nil {
		// The metadata service refused the request's delegation token
		// (token.go): Hadoop's client may fetch a new one.
		return remote(classInvalidToken, "%s: %v", p, err)
	}
	switch {
	case errors.Is(err, client.ErrNotFound):
		return remote(classFileNotFound, "%s: %v", p, err)
	case errors.Is(err, client.ErrExists):
		return remote(classAlreadyExists, "%s: %v", p, err)
	case errors.Is(err, client.ErrNotEmpty):
		return remote(classNotEmpty, "%s is non empty: %v", p, err)
	case errors.Is(err, client.ErrInvalidArgument):
		return remote(classIllegalArgument, "%s: %v", p, err)
	case errors.Is(err, client.ErrPermissionDenied):
		return remote(classAccessControl, "%s: %v", p, err)
	case errors.Is(err, client.ErrPrecondition) && isPreconditionFailed(err):
		// A CREATE without overwrite lost to a file created meanwhile.
		return remote(classAlreadyExists, "%s: %v", p, err)
	case errors.Is(err, client.ErrPrecondition) && isNotDirectory(err):
		return remote(classParentNotDir, "%s: %v", p, err)
	case errors.Is(err, client.ErrUnavailable), errors.Is(err, client.ErrLimit), errors.Is(err, context.DeadlineExceeded):
		return remote(classRetriable, "%s: %v", p, err)
	}
	return &remoteError{status: http.StatusInternalServerError, class: classIO, msg: fmt.Sprintf("%s: %v", p, err)}
}

// isPreconditionFailed: a KeyPrecondition (create-if-absent) did not hold.
func isPreconditionFailed(err error) bool {
	var ce *client.Error
	return errors.As(err, &ce) && ce.Reason == namespace.ReasonPreconditionFailed
}

// isNotDirectory: the namespace's "is a file, not a directory". It has no
// reason code for it yet (see docs/WEBHDFS.md, meta changes), so this is
// the one place that reads a message.
func isNotDirectory(err error) bool {
	return strings.Contains(err.Error(), "not a directory")
}

type remoteExceptionJSON struct {
	RemoteException struct {
		Exception     string `json:"exception"`
		JavaClassName string `json:"javaClassName"`
		Message       string `json:"message"`
	} `json:"RemoteException"`
}

func writeRemote(w http.ResponseWriter, e *remoteError) {
	var j remoteExceptionJSON
	j.RemoteException.JavaClassName = e.class
	j.RemoteException.Exception = e.class[strings.LastIndexByte(e.class, '.')+1:]
	j.RemoteException.Message = e.msg
	writeJSON(w, e.status, j)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		b = []byte(`{"RemoteException":{"exception":"IOException","javaClassName":"java.io.IOException","message":"encoding the response failed"}}`)
		status = http.StatusInternalServerError
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", fmt.Sprint(len(b)))
	w.WriteHeader(status)
	w.Write(b)
}
