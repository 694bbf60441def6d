package s3

import (
	"context"
	"net/http"
	"testing"
	"time"
)

// BenchmarkRequestChecks times what issue 13 added to every request
// before its operation runs: the signed-header check, the sub-resource
// and header checks, versionId, and the bucket owner (a cache hit).
//
//	go test -run '^$' -bench RequestChecks ./internal/s3/
func BenchmarkRequestChecks(b *testing.B) {
	r, _ := http.NewRequest("PUT", "http://gw.test/bkt/key?x-id=PutObject", nil)
	for _, h := range []string{"X-Amz-Date", "X-Amz-Content-Sha256", "X-Amz-Meta-A", "X-Amz-Meta-B", "X-Amz-Checksum-Crc32", "Content-Type", "Content-Md5"} {
		r.Header.Set(h, "v")
	}
	signed := []string{"content-md5", "content-type", "host", "x-amz-checksum-crc32", "x-amz-content-sha256", "x-amz-date", "x-amz-meta-a", "x-amz-meta-b"}
	oc := &ownerCache{ttl: time.Hour, now: time.Now, m: map[string]ownerEntry{"bkt": {owner: "alice", fetched: time.Now()}}}
	a := &auth{owner: "alice"}
	ctx := context.Background()
	b.ReportAllocs()
	for range b.N {
		if unsignedAmzHeaders(r, signed) != nil || unservedSubResource("PutObject", r.URL.RawQuery) != "" ||
			unsupportedHeaders("PutObject", r.Header) != nil || checkVersionID(r.URL.Query()) != nil {
			b.Fatal("refused")
		}
		owner, ok, err := oc.get(ctx, "s3v", "bkt")
		if err != nil || !ok || !a.mayAccess(owner) {
			b.Fatal("denied")
		}
	}
}

// BenchmarkRequesterContext times naming the requester and the request's
// attributes on the metadata calls (every request).
//
//	go test -run '^$' -bench RequesterContext ./internal/s3/
func BenchmarkRequesterContext(b *testing.B) {
	g := &Gateway{}
	r, _ := http.NewRequest("GET", "http://gw.test/bkt/key", nil)
	r.RemoteAddr = "10.1.2.3:5555"
	r.Header.Set("User-Agent", "aws-sdk-go-v2/1.36.3 os/linux lang/go#1.24 md/GOOS#linux api/s3#1.79.2")
	a := &auth{owner: "alice"}
	b.ReportAllocs()
	for range b.N {
		if g.requesterContext(r.Context(), r, a) == nil {
			b.Fatal("no context")
		}
	}
}
