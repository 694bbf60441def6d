package s3_test

import (
	"bytes"
	"fmt"
	"io"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
)

// TestGetWritesFromMappedBlockFiles: a GET whose blocks are on this host
// is written to the connection from the mapped block files (the gateway's
// client counts the bytes passed on from mappings: none copied through
// its buffers), whole and ranged (a range inside checksum windows), with
// the right bytes.
func TestGetWritesFromMappedBlockFiles(t *testing.T) {
	e := setup(t)
	e.mkBucket(t, "sendfile")
	data := randBytes(31, 9<<20+4321) // three blocks of 4 MiB
	e.put(t, "sendfile", "obj", data)
	before := e.gcl.ShortCircuitBlockStats()
	if got := e.get(t, "sendfile", "obj"); !bytes.Equal(got, data) {
		t.Fatalf("GET: %d bytes, want the %d put", len(got), len(data))
	}
	st := e.gcl.ShortCircuitBlockStats()
	if st.Mapped-before.Mapped != uint64(len(data)) || st.Bytes-before.Bytes != uint64(len(data)) {
		t.Fatalf("GET: gateway client %+v after %+v: want all %d bytes from mapped block files", st, before, len(data))
	}
	start, end := int64(4<<20-999), int64(8<<20+12345)
	out, err := e.s3.GetObject(e.ctx, &s3.GetObjectInput{Bucket: aws.String("sendfile"), Key: aws.String("obj"),
		Range: aws.String(fmt.Sprintf("bytes=%d-%d", start, end))})
	if err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(out.Body)
	out.Body.Close()
	if err != nil || !bytes.Equal(got, data[start:end+1]) {
		t.Fatalf("ranged GET: %d bytes, %v", len(got), err)
	}
	if st2 := e.gcl.ShortCircuitBlockStats(); st2.Mapped-st.Mapped != uint64(end+1-start) {
		t.Fatalf("ranged GET: %+v after %+v: want %d bytes from mappings", st2, st, end+1-start)
	}
}
