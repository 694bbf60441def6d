package s3

import (
	"bytes"
	"context"
	"encoding/base64"
	"io"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// cancelAtEOF is a request body that cancels the request's context as it
// returns its end: the write path fails after the body's EOF, before the
// commit (stream close, PutBlock).
type cancelAtEOF struct {
	r      io.Reader
	cancel context.CancelFunc
}

func (c *cancelAtEOF) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	if err == io.EOF {
		c.cancel()
	}
	return n, err
}

// TestLateDigestWriteFailsAfterEOF (review of session 13): a late body
// with a wrong Content-MD5 whose write fails after its end never reaches
// BeforeCommit; putData still settles it, so the client gets BadDigest
// (400) as when the digests were checked at EOF, not the write path's
// error (retryable: here RequestTimeout, the canceled context; a 5xx for
// a datanode failure). Real cluster (3 datanodes), the gateway's putData.
func TestLateDigestWriteFailsAfterEOF(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	c, err := cluster.Start(ctx, cluster.Config{Dir: t.TempDir(), Datanodes: 3, HeartbeatInterval: 200 * time.Millisecond,
		TickInterval: 50 * time.Millisecond, BlockSize: 4 << 20, ContainerSize: 512 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	cl, err := client.New(client.Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: c.ClientCredentials(), RPCTimeout: 20 * time.Second,
		WaitAllTimeout: 10 * time.Second, ServiceToken: c.ServiceToken()})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	g, err := New(Config{Client: cl, Listen: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if _, err := cl.CreateVolume(ctx, g.cfg.Volume, "tester"); err != nil {
		t.Logf("volume: %v", err) // the gateway may have made it
	}
	if _, err := cl.CreateBucket(ctx, g.cfg.Volume, "late", client.BucketOptions{}); err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("late-digest-body"), 3<<20/16)
	for _, badMD5 := range []bool{true, false} {
		rctx, rcancel := context.WithCancel(ctx)
		r, a := plainRequest(nil)
		r = r.WithContext(rctx)
		r.ContentLength = int64(len(data))
		r.Body = io.NopCloser(&cancelAtEOF{r: bytes.NewReader(data), cancel: rcancel})
		if badMD5 {
			r.Header.Set("Content-Md5", base64.StdEncoding.EncodeToString(make([]byte, 16)))
		}
		b, e := newBody(r, a, MaxObjectSize, true)
		if e != nil {
			t.Fatal(e)
		}
		req := &request{r: r, bucket: "late", key: "k", op: "PutObject"}
		_, err := g.putData(req, "k", b, int64(len(data)), &metapb.ObjectMeta{}, nil, nil, b.etag)
		rcancel()
		if err == nil {
			b.close()
			t.Fatal("the write succeeded with its context canceled at the body's end")
		}
		e = bodyOr(b, err, req)
		b.close()
		t.Logf("bad MD5 %v: write error %v; reported %s (%d)", badMD5, err, e.Code, e.Status)
		switch {
		case badMD5 && (e.Code != "BadDigest" || e.Status != 400):
			t.Fatalf("a bad digest with a failed write: %s (%d), want BadDigest (400)", e.Code, e.Status)
		case !badMD5 && e.Code == "BadDigest":
			t.Fatal("a good digest reported as BadDigest")
		}
	}
}
