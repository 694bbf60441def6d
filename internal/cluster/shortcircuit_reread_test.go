package cluster_test

import (
	"bytes"
	"context"
	"io"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
)

// BenchmarkShortCircuitReRead: one client reading the same 32 MiB key (8
// blocks of 4 MiB, on this host) again and again with a new reader each
// time, as the S3 gateway serves repeated GETs: WriteTo to io.Discard (the
// mapped path: verify, no copy) and ReadAt into a buffer (verify + copy).
// Without the client's cache every reader fetched, mapped and populated
// each block file again.
func BenchmarkShortCircuitReRead(b *testing.B) {
	c, _ := startSC(b, false)
	cl, err := client.New(client.Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: c.ClientCredentials(),
		Location: "/dc1/rack1", RPCTimeout: 20 * time.Second, WaitAllTimeout: 10 * time.Second})
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	ctx := context.Background()
	if _, err := cl.CreateVolume(ctx, "vol", ""); err != nil {
		b.Fatal(err)
	}
	if _, err := cl.CreateBucket(ctx, "vol", "bkt", client.BucketOptions{}); err != nil {
		b.Fatal(err)
	}
	const size = 32 << 20
	if _, err := cl.PutKey(ctx, "vol", "bkt", "k", bytes.NewReader(randData(34, size)), client.PutOptions{}); err != nil {
		b.Fatal(err)
	}
	buf := make([]byte, size)
	for _, mode := range []string{"WriteTo", "ReadAt"} {
		b.Run(mode, func(b *testing.B) {
			b.SetBytes(size)
			for b.Loop() {
				r, err := cl.GetKey(ctx, "vol", "bkt", "k")
				if err != nil {
					b.Fatal(err)
				}
				if mode == "WriteTo" {
					_, err = r.WriteTo(io.Discard)
				} else {
					_, err = r.ReadAt(buf, 0)
				}
				r.Close()
				if err != nil && err != io.EOF {
					b.Fatal(err)
				}
			}
		})
	}
}
