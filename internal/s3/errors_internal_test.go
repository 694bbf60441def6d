package s3

import (
	"fmt"
	"testing"

	"github.com/basalt-store/basalt/client"
)

// TestClientInternalErrorIs500: the client's internal failures (e.g. the
// key CRC32C it could not combine) are the gateway's fault: 500
// InternalError, not 400 InvalidRequest as when they were tagged
// ErrPrecondition.
func TestClientInternalErrorIs500(t *testing.T) {
	e := fromBasalt(fmt.Errorf("put key: %w", client.ErrInternal), "b", "k")
	if e.Status != 500 || e.Code != "InternalError" {
		t.Fatalf("client.ErrInternal: %d %s, want 500 InternalError", e.Status, e.Code)
	}
	if e := fromBasalt(fmt.Errorf("put key: %w", client.ErrPrecondition), "b", "k"); e.Status != 400 {
		t.Fatalf("client.ErrPrecondition: %d %s, want 400", e.Status, e.Code)
	}
}

// TestMaxUploadBytesDefault: the uploads' shared buffer budget defaults to
// 512 MiB (not MaxUploads × UploadBufferBytes = 2 GiB) and refuses a
// negative value.
func TestMaxUploadBytesDefault(t *testing.T) {
	c := Config{MetaAddrs: []string{"127.0.0.1:1"}}
	if err := c.setDefaults(); err != nil || c.MaxUploadBytes != 512<<20 {
		t.Fatalf("default MaxUploadBytes %d (%v), want 512 MiB", c.MaxUploadBytes, err)
	}
	c = Config{MetaAddrs: []string{"127.0.0.1:1"}, MaxUploadBytes: -1}
	if err := c.setDefaults(); err == nil {
		t.Fatal("negative MaxUploadBytes accepted")
	}
}
