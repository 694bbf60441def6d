package meta

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/basalt-store/basalt/internal/meta/metaclient"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/pki"
)

// testCA signs the certificates of this package's test servers and
// clients.
var testCA = sync.OnceValue(func() *pki.CA {
	ca, err := pki.NewCA("meta test CA")
	if err != nil {
		panic(err)
	}
	return ca
})

func testCreds(role pki.Role, id string) *pki.Credentials {
	c, err := testCA().Issue(pki.Identity{Role: role, ID: id}, time.Hour)
	if err != nil {
		panic(err)
	}
	return c
}

// nodeCreds are meta node id's credentials.
func nodeCreds(id uint64) *pki.Credentials { return testCreds(pki.RoleMeta, fmt.Sprint(id)) }

// testAdmins are the test servers' admins: the test client ("test") and
// the benchmark child ("bench").
var testAdmins = []string{"test", "bench"}

// clientDial authenticates a test client (role client) to meta nodes.
func clientDial() []grpc.DialOption {
	return []grpc.DialOption{testCreds(pki.RoleClient, "test").GRPCDialOption(pki.RoleMeta)}
}

// fleet is the fake datanodes registered through one test client: each
// talks to the meta nodes with its own datanode certificate, as SCM only
// lets a datanode register and heartbeat in its own name.
type fleet struct {
	mu    sync.Mutex
	addrs []string
	byID  map[uint64]*metaclient.Client
}

var fleets sync.Map // *metaclient.Client → *fleet

// dnClient returns a client with datanode uuid's certificate, to the
// meta nodes cl talks to.
func dnClient(t testing.TB, cl *metaclient.Client, uuid string) *metaclient.Client {
	t.Helper()
	f, ok := fleets.Load(cl)
	if !ok {
		t.Fatal("the client was not made by cluster.client")
	}
	dc, err := metaclient.New(metaclient.Config{Addrs: f.(*fleet).addrs, CallTimeout: 20 * time.Second,
		DialOptions: []grpc.DialOption{testCreds(pki.RoleDatanode, uuid).GRPCDialOption(pki.RoleMeta)}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dc.Close() })
	return dc
}

// dnScm is the SCM API as datanode id (registered by registerDatanodes
// through cl) calls it.
func dnScm(t testing.TB, cl *metaclient.Client, id uint64) metapb.ScmClient {
	f, _ := fleets.Load(cl)
	fl := f.(*fleet)
	fl.mu.Lock()
	defer fl.mu.Unlock()
	dc, ok := fl.byID[id]
	if !ok {
		t.Fatalf("datanode %d was not registered through this client", id)
	}
	return dc.Scm
}
