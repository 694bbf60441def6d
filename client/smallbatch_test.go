package client_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
)

// TestSmallFilesCoalesced: 32 writers of small keys against real
// datanodes: the client sends their files in fewer PutSmallFiles calls
// than files (each file still acknowledged on its own and readable), the
// datanodes propose every one of them from those calls; with
// SmallFilesInFlight < 0 every key is its own PutSmallFile again.
func TestSmallFilesCoalesced(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cl, err := cluster.Start(ctx, cluster.Config{Dir: t.TempDir(), Datanodes: 3,
		HeartbeatInterval: 200 * time.Millisecond, TickInterval: 50 * time.Millisecond,
		BlockSize: 4 << 20, ContainerSize: 512 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if err := cl.WaitWritable(ctx); err != nil {
		t.Fatal(err)
	}
	dnFiles := func() (calls, files uint64) {
		for i := range cl.Datanodes {
			if dn := cl.Datanode(i); dn != nil {
				c, f := dn.SmallFileBatches()
				calls, files = calls+c, files+f
			}
		}
		return calls, files
	}
	const writers, each = 32, 16
	run := func(name string, inFlight int) (calls, files uint64) {
		c, err := client.New(client.Config{MetaAddrs: []string{cl.MetaAddr()}, Credentials: cl.ClientCredentials(),
			Location: "/dc1/rack1", SmallFilesInFlight: inFlight})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if name == "batched" {
			if _, err := c.CreateVolume(ctx, "vol", ""); err != nil {
				t.Fatal(err)
			}
			if _, err := c.CreateBucket(ctx, "vol", "bkt", client.BucketOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		var wg sync.WaitGroup
		for w := range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range each {
					key := fmt.Sprintf("%s/%d/%d", name, w, i)
					data := bytes.Repeat([]byte{byte(w), byte(i)}, 2048)
					if _, err := c.PutKey(ctx, "vol", "bkt", key, bytes.NewReader(data), client.PutOptions{}); err != nil {
						t.Errorf("put %s: %v", key, err)
						return
					}
				}
			}()
		}
		wg.Wait()
		for w := range writers {
			key := fmt.Sprintf("%s/%d/%d", name, w, each-1)
			kr, err := c.GetKey(ctx, "vol", "bkt", key)
			if err != nil {
				t.Fatal(err)
			}
			got, err := io.ReadAll(kr)
			if err != nil || !bytes.Equal(got, bytes.Repeat([]byte{byte(w), byte(each - 1)}, 2048)) {
				t.Fatalf("get %s: %d bytes, %v", key, len(got), err)
			}
		}
		return c.SmallFileBatches()
	}
	calls, files := run("batched", 0)
	dc, df := dnFiles()
	t.Logf("coalesced: %d files in %d PutSmallFiles calls (datanodes: %d files from %d calls)", files, calls, df, dc)
	if files < writers*each || calls*3 > files*2 {
		t.Fatalf("%d files in %d calls: want every file sent in a batch, at most 2/3 as many calls as files", files, calls)
	}
	// (Files sent to a member that is not the leader are refused there,
	// each NOT_LEADER, and sent again to the leader.)
	if df < writers*each || df > files || dc > calls {
		t.Fatalf("datanodes proposed %d files from %d calls, the client sent %d in %d", df, dc, files, calls)
	}
	if calls, files := run("alone", -1); calls != 0 || files != 0 {
		t.Fatalf("coalescing off: %d files in %d calls", files, calls)
	}
	if c2, f2 := dnFiles(); c2 != dc || f2 != df {
		t.Fatalf("coalescing off: the datanodes saw PutSmallFiles calls (%d/%d → %d/%d)", dc, df, c2, f2)
	}
}
