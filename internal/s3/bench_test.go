package s3_test

import (
	"bytes"
	"fmt"
	"io"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
)

// BenchmarkSmallOps times 4 KiB PUT, GET and HEAD through the SDK on an
// in-process cluster: the cost of the per-request checks (signed headers,
// sub-resources, the bucket owner, cached) against the Raft round trips.
//
//	go test -run '^$' -bench SmallOps -benchtime 300x ./internal/s3/
func BenchmarkSmallOps(b *testing.B) {
	e := setup(b)
	e.mkBucket(b, "bench")
	data := bytes.Repeat([]byte("x"), 4096)
	b.Run("put", func(b *testing.B) {
		for i := range b.N {
			if _, err := e.s3.PutObject(e.ctx, &s3.PutObjectInput{Bucket: aws.String("bench"), Key: aws.String(fmt.Sprint("k", i)), Body: bytes.NewReader(data)}); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("get", func(b *testing.B) {
		for range b.N {
			out, err := e.s3.GetObject(e.ctx, &s3.GetObjectInput{Bucket: aws.String("bench"), Key: aws.String("k0")})
			if err != nil {
				b.Fatal(err)
			}
			io.Copy(io.Discard, out.Body)
			out.Body.Close()
		}
	})
	b.Run("head", func(b *testing.B) {
		for range b.N {
			if _, err := e.s3.HeadObject(e.ctx, &s3.HeadObjectInput{Bucket: aws.String("bench"), Key: aws.String("k0")}); err != nil {
				b.Fatal(err)
			}
		}
	})
}
