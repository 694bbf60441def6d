package webhdfs_test

import (
	"bytes"
	"context"
	"crypto/md5"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/cluster"
	"github.com/basalt-store/basalt/internal/webhdfs"
)

// The gateway on an in-process cluster, driven over HTTP the way Hadoop's
// WebHdfsFileSystem drives it (the Maven module in hadoop/ runs the real
// client against a real `basalt dev`).

type env struct {
	url string // http://127.0.0.1:port/webhdfs/v1
	cl  *client.Client
	hc  *http.Client
}

var shared *env

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "webhdfs-test")
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	// The tests' user alice is an admin (she creates volumes); the gateway
	// has a gateway certificate, so the metadata service checks every
	// call for the user.name it names.
	c, err := cluster.Start(ctx, cluster.Config{Dir: dir, Admins: []string{"alice"}, Datanodes: 3, HeartbeatInterval: 200 * time.Millisecond,
		TickInterval: 50 * time.Millisecond, BlockSize: 4 << 20, ContainerSize: 512 << 20})
	cancel()
	if err != nil {
		panic(err)
	}
	cl, err := client.New(client.Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: c.ClientCredentials(), RPCTimeout: 20 * time.Second, WaitAllTimeout: 10 * time.Second})
	if err != nil {
		panic(err)
	}
	gwCreds, err := c.GatewayCredentials("webhdfs")
	if err != nil {
		panic(err)
	}
	gcl, err := client.New(client.Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: gwCreds, RPCTimeout: 20 * time.Second, WaitAllTimeout: 10 * time.Second})
	if err != nil {
		panic(err)
	}
	g, err := webhdfs.New(webhdfs.Config{Client: gcl, Listen: "127.0.0.1:0", MaxTransfers: 4, TransferWait: 5 * time.Second})
	if err != nil {
		panic(err)
	}
	go g.Serve()
	shared = &env{url: "http://" + g.Addr() + webhdfs.Prefix, cl: cl,
		hc: &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
	code := m.Run()
	g.Close()
	gcl.Close()
	cl.Close()
	c.Close()
	os.RemoveAll(dir)
	os.Exit(code)
}

type resp struct {
	code int
	hdr  http.Header
	body []byte
}

func (r resp) json(t *testing.T) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(r.body, &m); err != nil {
		t.Fatalf("response %d is not JSON: %v: %q", r.code, err, r.body)
	}
	return m
}

// exception returns the RemoteException's javaClassName ("" if none).
func (r resp) exception() string {
	var m struct {
		RemoteException struct{ JavaClassName, Exception, Message string }
	}
	if json.Unmarshal(r.body, &m) != nil {
		return ""
	}
	return m.RemoteException.JavaClassName
}

func (e *env) do(t *testing.T, method, path, op string, params url.Values, body io.Reader) resp {
	t.Helper()
	if params == nil {
		params = url.Values{}
	}
	params.Set("op", op)
	if params.Get("user.name") == "" {
		params.Set("user.name", "alice")
	}
	u := e.url + path + "?" + params.Encode()
	req, err := http.NewRequest(method, u, body)
	if err != nil {
		t.Fatal(err)
	}
	res, err := e.hc.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, u, err)
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		t.Fatalf("%s %s: reading the body: %v", method, u, err)
	}
	return resp{code: res.StatusCode, hdr: res.Header, body: b}
}

// create writes data at path with the two-step protocol and returns the
// data step's response (or the first step's if it did not redirect).
func (e *env) create(t *testing.T, path string, data []byte, params url.Values) resp {
	t.Helper()
	r := e.do(t, "PUT", path, "CREATE", params, nil)
	if r.code != http.StatusTemporaryRedirect {
		return r
	}
	loc := r.hdr.Get("Location")
	if !strings.Contains(loc, "data=true") {
		t.Fatalf("CREATE redirect %q lacks data=true", loc)
	}
	req, err := http.NewRequest("PUT", loc, bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/octet-stream")
	res, err := e.hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return resp{code: res.StatusCode, hdr: res.Header, body: b}
}

func expect(t *testing.T, what string, r resp, code int, exception string) {
	t.Helper()
	if r.code != code || r.exception() != exception {
		t.Fatalf("%s: got %d %q, want %d %q; body %s", what, r.code, r.exception(), code, exception, r.body)
	}
}

func fileStatus(t *testing.T, r resp) map[string]any {
	t.Helper()
	return r.json(t)["FileStatus"].(map[string]any)
}

func names(t *testing.T, r resp) []string {
	t.Helper()
	var out []string
	for _, s := range r.json(t)["FileStatuses"].(map[string]any)["FileStatus"].([]any) {
		out = append(out, s.(map[string]any)["pathSuffix"].(string))
	}
	return out
}

func randBytes(n int, seed int64) []byte {
	b := make([]byte, n)
	rand.New(rand.NewSource(seed)).Read(b)
	return b
}

const (
	nfe  = "java.io.FileNotFoundException"
	fae  = "org.apache.hadoop.fs.FileAlreadyExistsException"
	pnd  = "org.apache.hadoop.fs.ParentNotDirectoryException"
	pine = "org.apache.hadoop.fs.PathIsNotEmptyDirectoryException"
	iae  = "java.lang.IllegalArgumentException"
	uoe  = "java.lang.UnsupportedOperationException"
)

func TestNamespaceRoot(t *testing.T) {
	e := shared
	expect(t, "mkdirs volume+bucket+dirs", e.do(t, "PUT", "/rootv/bk1/x/y", "MKDIRS", nil, nil), 200, "")
	r := e.do(t, "GET", "/", "LISTSTATUS", nil, nil)
	expect(t, "list /", r, 200, "")
	if n := names(t, r); !contains(n, "rootv") {
		t.Fatalf("list / = %v, want the volume rootv", n)
	}
	r = e.do(t, "GET", "/rootv", "LISTSTATUS", nil, nil)
	if n := names(t, r); len(n) != 1 || n[0] != "bk1" {
		t.Fatalf("list /rootv = %v, want [bk1]", n)
	}
	st := fileStatus(t, e.do(t, "GET", "/rootv", "GETFILESTATUS", nil, nil))
	if st["type"] != "DIRECTORY" || st["owner"] != "alice" {
		t.Fatalf("volume status %v: want a directory owned by alice (its creator)", st)
	}
	b, err := e.cl.BucketInfo(context.Background(), "rootv", "bk1")
	if err != nil || b.Layout != client.LayoutFS {
		t.Fatalf("bucket made by MKDIRS: %+v %v, want FS layout", b, err)
	}
	expect(t, "stat missing volume", e.do(t, "GET", "/novol", "GETFILESTATUS", nil, nil), 404, nfe)
	expect(t, "stat missing bucket", e.do(t, "GET", "/rootv/nob", "GETFILESTATUS", nil, nil), 404, nfe)
	expect(t, "list missing volume", e.do(t, "GET", "/novol", "LISTSTATUS", nil, nil), 404, nfe)
	expect(t, "delete root", e.do(t, "DELETE", "/", "DELETE", url.Values{"recursive": {"true"}}, nil), 200, "")
	if e.do(t, "DELETE", "/", "DELETE", nil, nil).json(t)["boolean"] != false {
		t.Fatal("DELETE / must answer false")
	}
	expect(t, "delete non-empty bucket", e.do(t, "DELETE", "/rootv/bk1", "DELETE", nil, nil), 403, pine)
	expect(t, "delete non-empty volume", e.do(t, "DELETE", "/rootv", "DELETE", nil, nil), 403, pine)
	expect(t, "create file at bucket level", e.create(t, "/rootv/bk1", []byte("x"), nil), 403, fae)
	expect(t, "rename bucket", e.do(t, "PUT", "/rootv/bk1", "RENAME", url.Values{"destination": {"/rootv/bk2"}}, nil), 200, "")
	r = e.do(t, "DELETE", "/rootv", "DELETE", url.Values{"recursive": {"true"}}, nil)
	if r.code != 200 || r.json(t)["boolean"] != true {
		t.Fatalf("recursive delete of a volume: %d %s", r.code, r.body)
	}
	expect(t, "volume gone", e.do(t, "GET", "/rootv", "GETFILESTATUS", nil, nil), 404, nfe)
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

func TestFilesAndDirectories(t *testing.T) {
	e := shared
	expect(t, "mkdirs", e.do(t, "PUT", "/vol1/fsb/d1/d2", "MKDIRS", url.Values{"permission": {"755"}}, nil), 200, "")
	small := []byte("hello, webhdfs\n")
	expect(t, "create small", e.create(t, "/vol1/fsb/d1/small.txt", small, url.Values{"permission": {"600"}, "replication": {"3"}}), 201, "")
	big := randBytes(9<<20+12345, 1) // three 4 MiB blocks (the test cluster's), V2 path
	expect(t, "create big", e.create(t, "/vol1/fsb/d1/d2/big.bin", big, url.Values{"overwrite": {"false"}}), 201, "")

	st := fileStatus(t, e.do(t, "GET", "/vol1/fsb/d1/small.txt", "GETFILESTATUS", nil, nil))
	if st["type"] != "FILE" || st["length"] != float64(len(small)) || st["permission"] != "600" || st["owner"] != "alice" || st["replication"] != float64(3) {
		t.Fatalf("status of small.txt: %v", st)
	}
	if st["pathSuffix"] != "" {
		t.Fatalf("GETFILESTATUS pathSuffix %q, want empty", st["pathSuffix"])
	}
	st = fileStatus(t, e.do(t, "GET", "/vol1/fsb/d1", "GETFILESTATUS", nil, nil))
	if st["type"] != "DIRECTORY" {
		t.Fatalf("status of d1: %v", st)
	}

	// OPEN: whole, ranges, at EOF, past EOF.
	for _, c := range []struct {
		params url.Values
		want   []byte
	}{
		{nil, big},
		{url.Values{"offset": {"5000000"}}, big[5000000:]},
		{url.Values{"offset": {"4194300"}, "length": {"100"}}, big[4194300:4194400]},
		{url.Values{"length": {"0"}}, nil},
		{url.Values{"offset": {fmt.Sprint(len(big))}}, nil},
		{url.Values{"offset": {"10"}, "length": {fmt.Sprint(len(big) * 2)}}, big[10:]},
	} {
		r := e.do(t, "GET", "/vol1/fsb/d1/d2/big.bin", "OPEN", c.params, nil)
		if r.code != 200 || !bytes.Equal(r.body, c.want) || r.hdr.Get("Content-Length") != fmt.Sprint(len(c.want)) {
			t.Fatalf("OPEN %v: %d, %d bytes (Content-Length %s), want %d", c.params, r.code, len(r.body), r.hdr.Get("Content-Length"), len(c.want))
		}
	}
	if r := e.do(t, "GET", "/vol1/fsb/d1/d2/big.bin", "OPEN", url.Values{"offset": {fmt.Sprint(len(big) + 1)}}, nil); r.code != 200 || len(r.body) != 0 {
		t.Fatalf("open past EOF: %d, %d bytes; want 200 and nothing", r.code, len(r.body))
	}
	// Block locations: the 4 MiB blocks overlapping the range, with their
	// three replicas.
	bl := e.do(t, "GET", "/vol1/fsb/d1/d2/big.bin", "GETFILEBLOCKLOCATIONS", url.Values{"offset": {"5000000"}, "length": {"10"}}, nil)
	locs := bl.json(t)["BlockLocations"].(map[string]any)["BlockLocation"].([]any)
	if len(locs) != 1 || locs[0].(map[string]any)["offset"] != float64(4<<20) || len(locs[0].(map[string]any)["names"].([]any)) != 3 {
		t.Fatalf("block locations: %s", bl.body)
	}
	bl = e.do(t, "GET", "/vol1/fsb/d1/d2/big.bin", "GETFILEBLOCKLOCATIONS", nil, nil)
	if n := len(bl.json(t)["BlockLocations"].(map[string]any)["BlockLocation"].([]any)); n != 3 {
		t.Fatalf("block locations of the whole file: %d blocks, want 3", n)
	}
	expect(t, "block locations of a dir", e.do(t, "GET", "/vol1/fsb/d1", "GETFILEBLOCKLOCATIONS", nil, nil), 404, nfe)
	expect(t, "open a directory", e.do(t, "GET", "/vol1/fsb/d1", "OPEN", nil, nil), 404, nfe)
	expect(t, "open missing", e.do(t, "GET", "/vol1/fsb/d1/nope", "OPEN", nil, nil), 404, nfe)
	expect(t, "open bad offset", e.do(t, "GET", "/vol1/fsb/d1/small.txt", "OPEN", url.Values{"offset": {"-1"}}, nil), 400, iae)

	// CREATE errors, checked at the first step.
	expect(t, "create existing without overwrite", e.create(t, "/vol1/fsb/d1/small.txt", small, nil), 403, fae)
	expect(t, "create over a directory", e.create(t, "/vol1/fsb/d1/d2", small, url.Values{"overwrite": {"true"}}), 403, fae)
	expect(t, "create under a file", e.create(t, "/vol1/fsb/d1/small.txt/x", small, nil), 403, pnd)
	expect(t, "create in a missing bucket", e.create(t, "/vol1/newbucket/x", small, nil), 201, "")
	expect(t, "createflag overwrite", e.create(t, "/vol1/fsb/d1/small.txt", small, url.Values{"createflag": {"CREATE,OVERWRITE"}, "createparent": {"false"}}), 201, "")
	expect(t, "createparent=false without parent", e.create(t, "/vol1/fsb/nodir/x", small, url.Values{"createparent": {"false"}}), 404, nfe)
	expect(t, "createparent=false under a file", e.create(t, "/vol1/fsb/d1/small.txt/x", small, url.Values{"createparent": {"false"}}), 403, pnd)
	expect(t, "createflag append", e.create(t, "/vol1/fsb/d1/small.txt", small, url.Values{"createflag": {"APPEND"}}), 400, uoe)
	expect(t, "create bad replication", e.create(t, "/vol1/fsb/r", small, url.Values{"replication": {"zero"}}), 400, iae)
	// Overwrite replaces the file whole; parents are created.
	expect(t, "overwrite", e.create(t, "/vol1/fsb/d1/small.txt", []byte("v2"), url.Values{"overwrite": {"true"}}), 201, "")
	if r := e.do(t, "GET", "/vol1/fsb/d1/small.txt", "OPEN", nil, nil); string(r.body) != "v2" {
		t.Fatalf("after overwrite: %q", r.body)
	}
	expect(t, "create with new parents", e.create(t, "/vol1/fsb/new/parents/f", nil, nil), 201, "")
	if st := fileStatus(t, e.do(t, "GET", "/vol1/fsb/new/parents/f", "GETFILESTATUS", nil, nil)); st["length"] != float64(0) {
		t.Fatalf("empty file: %v", st)
	}
	// noredirect: the Location comes back in JSON.
	r := e.do(t, "PUT", "/vol1/fsb/nr", "CREATE", url.Values{"noredirect": {"true"}}, nil)
	if r.code != 200 || !strings.Contains(fmt.Sprint(r.json(t)["Location"]), "data=true") {
		t.Fatalf("noredirect CREATE: %d %s", r.code, r.body)
	}

	// MKDIRS errors.
	expect(t, "mkdirs over a file", e.do(t, "PUT", "/vol1/fsb/d1/small.txt", "MKDIRS", nil, nil), 403, fae)
	expect(t, "mkdirs under a file", e.do(t, "PUT", "/vol1/fsb/d1/small.txt/sub", "MKDIRS", nil, nil), 403, pnd)
	expect(t, "mkdirs existing", e.do(t, "PUT", "/vol1/fsb/d1", "MKDIRS", nil, nil), 200, "")

	// LISTSTATUS of a directory and of a file.
	if n := names(t, e.do(t, "GET", "/vol1/fsb/d1", "LISTSTATUS", nil, nil)); strings.Join(n, ",") != "d2,small.txt" {
		t.Fatalf("list d1 = %v", n)
	}
	if n := names(t, e.do(t, "GET", "/vol1/fsb/d1/small.txt", "LISTSTATUS", nil, nil)); len(n) != 1 || n[0] != "" {
		t.Fatalf("list of a file = %v, want the file itself", n)
	}
	expect(t, "list missing", e.do(t, "GET", "/vol1/fsb/missing", "LISTSTATUS", nil, nil), 404, nfe)
	expect(t, "stat under a file", e.do(t, "GET", "/vol1/fsb/d1/small.txt/x", "GETFILESTATUS", nil, nil), 404, nfe)

	// GETCONTENTSUMMARY
	cs := e.do(t, "GET", "/vol1/fsb/d1", "GETCONTENTSUMMARY", nil, nil).json(t)["ContentSummary"].(map[string]any)
	if cs["fileCount"] != float64(2) || cs["directoryCount"] != float64(2) || cs["length"] != float64(len(big)+2) {
		t.Fatalf("content summary of d1: %v", cs)
	}
	expect(t, "summary missing", e.do(t, "GET", "/vol1/fsb/zzz", "GETCONTENTSUMMARY", nil, nil), 404, nfe)

	// RENAME (old semantics): into an existing directory, to a new name,
	// failures as false.
	renamed := func(src, dst string) bool {
		t.Helper()
		r := e.do(t, "PUT", src, "RENAME", url.Values{"destination": {dst}}, nil)
		if r.code != 200 {
			t.Fatalf("rename %s %s: %d %s", src, dst, r.code, r.body)
		}
		return r.json(t)["boolean"] == true
	}
	if !renamed("/vol1/fsb/d1/d2", "/vol1/fsb/moved") {
		t.Fatal("rename of a directory failed")
	}
	if r := e.do(t, "GET", "/vol1/fsb/moved/big.bin", "OPEN", url.Values{"offset": {"1"}, "length": {"3"}}, nil); !bytes.Equal(r.body, big[1:4]) {
		t.Fatalf("read after directory rename: %d %q", r.code, r.body)
	}
	if !renamed("/vol1/fsb/moved", "/vol1/fsb/d1") || fileStatus(t, e.do(t, "GET", "/vol1/fsb/d1/moved/big.bin", "GETFILESTATUS", nil, nil))["length"] != float64(len(big)) {
		t.Fatal("rename into an existing directory")
	}
	for _, c := range [][2]string{
		{"/vol1/fsb/nothere", "/vol1/fsb/x"},                  // missing source
		{"/vol1/fsb/d1/small.txt", "/vol1/fsb/new/parents/f"}, // destination file exists
		{"/vol1/fsb/d1", "/vol1/fsb/d1/moved/inside"},         // into itself
		{"/vol1/fsb/d1/small.txt", "/vol1/fsb/no/such/dir/f"}, // missing parent
		{"/vol1/fsb/d1/small.txt", "/vol1/other/f"},           // across buckets
	} {
		if renamed(c[0], c[1]) {
			t.Fatalf("rename %s to %s succeeded", c[0], c[1])
		}
	}
	// rename2 (with options): exceptions instead of false.
	expect(t, "rename2 onto existing", e.do(t, "PUT", "/vol1/fsb/d1/small.txt", "RENAME", url.Values{"destination": {"/vol1/fsb/new/parents/f"}, "renameoptions": {"NONE"}}, nil), 403, fae)
	expect(t, "rename2 overwrite", e.do(t, "PUT", "/vol1/fsb/new/parents/f", "RENAME", url.Values{"destination": {"/vol1/fsb/nr2"}, "renameoptions": {"OVERWRITE"}}, nil), 200, "")
	expect(t, "rename2 missing source", e.do(t, "PUT", "/vol1/fsb/new/parents/f", "RENAME", url.Values{"destination": {"/vol1/fsb/x"}, "renameoptions": {"NONE"}}, nil), 404, nfe)
	expect(t, "rename2 file onto dir", e.do(t, "PUT", "/vol1/fsb/d1/small.txt", "RENAME", url.Values{"destination": {"/vol1/fsb/new"}, "renameoptions": {"OVERWRITE"}}, nil), 403, "java.io.IOException")
	expect(t, "rename without destination", e.do(t, "PUT", "/vol1/fsb/d1", "RENAME", nil, nil), 400, iae)

	// DELETE
	expect(t, "delete non-empty dir", e.do(t, "DELETE", "/vol1/fsb/d1", "DELETE", url.Values{"recursive": {"false"}}, nil), 403, pine)
	if r := e.do(t, "DELETE", "/vol1/fsb/nothere", "DELETE", nil, nil); r.json(t)["boolean"] != false {
		t.Fatalf("delete missing: %s", r.body)
	}
	if r := e.do(t, "DELETE", "/vol1/fsb/d1", "DELETE", url.Values{"recursive": {"true"}}, nil); r.json(t)["boolean"] != true {
		t.Fatalf("recursive delete: %s", r.body)
	}
	expect(t, "deleted", e.do(t, "GET", "/vol1/fsb/d1/moved/big.bin", "GETFILESTATUS", nil, nil), 404, nfe)
	expect(t, "bad recursive", e.do(t, "DELETE", "/vol1/fsb/x", "DELETE", url.Values{"recursive": {"maybe"}}, nil), 400, iae)
}

func TestListStatusBatch(t *testing.T) {
	e := shared
	expect(t, "mkdirs", e.do(t, "PUT", "/vol2/fsb/many", "MKDIRS", nil, nil), 200, "")
	const n = 1203
	ctx := context.Background()
	for i := 0; i < n; i++ {
		if _, err := e.cl.CreateDirectory(ctx, "vol2", "fsb", fmt.Sprintf("many/d%05d", i)); err != nil {
			t.Fatal(err)
		}
	}
	var got []string
	after := ""
	pages := 0
	for {
		if pages > 10 {
			t.Fatalf("batch listing: still paging after %d pages (startafter ignored?)", pages)
		}
		// The spelling Hadoop 3.4.1's Java client sends (StartAfterParam.NAME);
		// the REST documentation writes startAfter.
		r := e.do(t, "GET", "/vol2/fsb/many", "LISTSTATUS_BATCH", url.Values{"startafter": {after}}, nil)
		expect(t, "batch", r, 200, "")
		dl := r.json(t)["DirectoryListing"].(map[string]any)
		sts := dl["partialListing"].(map[string]any)["FileStatuses"].(map[string]any)["FileStatus"].([]any)
		for _, s := range sts {
			got = append(got, s.(map[string]any)["pathSuffix"].(string))
		}
		pages++
		if dl["remainingEntries"] == float64(0) {
			break
		}
		after = got[len(got)-1]
	}
	if len(got) != n || pages != 2 || got[0] != "d00000" || got[n-1] != fmt.Sprintf("d%05d", n-1) {
		t.Fatalf("batch listing: %d entries in %d pages, want %d in 2", len(got), pages, n)
	}
	// LISTSTATUS streams every page.
	if all := names(t, e.do(t, "GET", "/vol2/fsb/many", "LISTSTATUS", nil, nil)); len(all) != n {
		t.Fatalf("LISTSTATUS: %d entries, want %d", len(all), n)
	}
	r := e.do(t, "GET", "/vol2/fsb/empty", "LISTSTATUS_BATCH", nil, nil)
	expect(t, "batch of missing", r, 404, nfe)
}

func TestAttributes(t *testing.T) {
	e := shared
	expect(t, "create", e.create(t, "/vol3/fsb/f", []byte("attrs"), nil), 201, "")
	expect(t, "mkdirs", e.do(t, "PUT", "/vol3/fsb/dir", "MKDIRS", nil, nil), 200, "")
	before := fileStatus(t, e.do(t, "GET", "/vol3/fsb/f", "GETFILESTATUS", nil, nil))
	expect(t, "chmod", e.do(t, "PUT", "/vol3/fsb/f", "SETPERMISSION", url.Values{"permission": {"1750"}}, nil), 200, "")
	expect(t, "chown", e.do(t, "PUT", "/vol3/fsb/f", "SETOWNER", url.Values{"owner": {"bob"}, "group": {"staff"}}, nil), 200, "")
	st := fileStatus(t, e.do(t, "GET", "/vol3/fsb/f", "GETFILESTATUS", nil, nil))
	if st["permission"] != "1750" || st["owner"] != "bob" || st["group"] != "staff" {
		t.Fatalf("after chmod/chown: %v", st)
	}
	if st["modificationTime"] != before["modificationTime"] {
		t.Fatalf("chmod changed the modification time: %v → %v", before["modificationTime"], st["modificationTime"])
	}
	expect(t, "settimes", e.do(t, "PUT", "/vol3/fsb/f", "SETTIMES", url.Values{"modificationtime": {"1000000"}, "accesstime": {"2000000"}}, nil), 200, "")
	st = fileStatus(t, e.do(t, "GET", "/vol3/fsb/f", "GETFILESTATUS", nil, nil))
	if st["modificationTime"] != float64(1000000) || st["accessTime"] != float64(2000000) || st["owner"] != "bob" {
		t.Fatalf("after settimes: %v", st)
	}
	if r := e.do(t, "GET", "/vol3/fsb/f", "OPEN", nil, nil); string(r.body) != "attrs" {
		t.Fatalf("data after attribute changes: %q", r.body)
	}
	for _, c := range []struct {
		what, path, op string
		params         url.Values
		code           int
		exc            string
	}{
		{"chmod root", "/", "SETPERMISSION", url.Values{"permission": {"700"}}, 400, uoe},
		{"chown missing bucket", "/vol3/nob", "SETOWNER", url.Values{"owner": {"x"}}, 404, nfe},
		{"chown missing volume", "/novol", "SETOWNER", url.Values{"owner": {"x"}}, 404, nfe},
		{"settimes under a file", "/vol3/fsb/f/x", "SETTIMES", url.Values{"modificationtime": {"5"}}, 404, nfe},
		{"chmod missing", "/vol3/fsb/nope", "SETPERMISSION", url.Values{"permission": {"700"}}, 404, nfe},
		{"chmod bad", "/vol3/fsb/f", "SETPERMISSION", url.Values{"permission": {"999"}}, 400, iae},
		{"chown nothing", "/vol3/fsb/f", "SETOWNER", nil, 400, iae},
		{"setrep other", "/vol3/fsb/f", "SETREPLICATION", url.Values{"replication": {"1"}}, 400, uoe},
		{"setrep same", "/vol3/fsb/f", "SETREPLICATION", url.Values{"replication": {"3"}}, 200, ""},
		{"setrep dir", "/vol3/fsb/dir", "SETREPLICATION", url.Values{"replication": {"3"}}, 200, ""},
		{"append", "/vol3/fsb/f", "APPEND", nil, 400, uoe},
		{"concat", "/vol3/fsb/f", "CONCAT", url.Values{"sources": {"/vol3/fsb/g"}}, 400, uoe},
		{"truncate", "/vol3/fsb/f", "TRUNCATE", url.Values{"newlength": {"1"}}, 400, uoe},
		{"acl status", "/vol3/fsb/f", "GETACLSTATUS", nil, 400, uoe},
		{"bad op", "/vol3/fsb/f", "FROB", nil, 400, iae},
		{"checkaccess", "/vol3/fsb/f", "CHECKACCESS", url.Values{"fsaction": {"r-x"}}, 200, ""},
		{"checkaccess bad", "/vol3/fsb/f", "CHECKACCESS", url.Values{"fsaction": {"rwz"}}, 400, iae},
		{"checkaccess missing", "/vol3/fsb/nope", "CHECKACCESS", url.Values{"fsaction": {"r--"}}, 404, nfe},
	} {
		method := map[string]string{"APPEND": "POST", "CONCAT": "POST", "TRUNCATE": "POST", "GETACLSTATUS": "GET", "CHECKACCESS": "GET", "FROB": "GET"}[c.op]
		if method == "" {
			method = "PUT"
		}
		expect(t, c.what, e.do(t, method, c.path, c.op, c.params, nil), c.code, c.exc)
	}
}

func TestServerInfo(t *testing.T) {
	e := shared
	if p := e.do(t, "GET", "/", "GETHOMEDIRECTORY", nil, nil).json(t)["Path"]; p != "/user/alice" {
		t.Fatalf("home = %v", p)
	}
	if p := e.do(t, "GET", "/", "GETHOMEDIRECTORY", url.Values{"doas": {"bob"}}, nil).json(t)["Path"]; p != "/user/bob" {
		t.Fatalf("home with doas=bob = %v", p)
	}
	if p := e.do(t, "GET", "/vol1/fsb/a/b", "GETTRASHROOT", nil, nil).json(t)["Path"]; p != "/vol1/fsb/.Trash/alice" {
		t.Fatalf("trash root in a bucket = %v", p)
	}
	d := e.do(t, "GET", "/", "GETSERVERDEFAULTS", nil, nil).json(t)["FsServerDefaults"].(map[string]any)
	if d["trashInterval"] != float64(0) || d["bytesPerChecksum"] != float64(65536) {
		t.Fatalf("server defaults %v", d)
	}
	expect(t, "not webhdfs", resp(e.do(t, "GET", "/../x", "GETFILESTATUS", nil, nil)), 400, "org.apache.hadoop.fs.InvalidPathException")
}

// TestFileChecksum checks the MD5-of-MD5-of-CRC32C against one computed
// here from the data: equal files, equal checksums; different, different.
func TestFileChecksum(t *testing.T) {
	e := shared
	data := randBytes(4<<20+300000, 7) // two blocks
	expect(t, "create a", e.create(t, "/vol4/fsb/a", data, nil), 201, "")
	expect(t, "create b", e.create(t, "/vol4/fsb/b", data, nil), 201, "")
	expect(t, "create c", e.create(t, "/vol4/fsb/c", data[1:], nil), 201, "")
	sum := func(p string) map[string]any {
		r := e.do(t, "GET", p, "GETFILECHECKSUM", nil, nil)
		expect(t, "checksum "+p, r, 200, "")
		return r.json(t)["FileChecksum"].(map[string]any)
	}
	a, b, c := sum("/vol4/fsb/a"), sum("/vol4/fsb/b"), sum("/vol4/fsb/c")
	if a["bytes"] != b["bytes"] || a["bytes"] == c["bytes"] {
		t.Fatalf("checksums: a %v b %v c %v", a, b, c)
	}
	// Expected: per 4 MiB block, MD5 of the CRC32C of each 64 KiB window.
	tab := crc32.MakeTable(crc32.Castagnoli)
	file := md5.New()
	const bs, bpc = 4 << 20, 64 << 10
	for off := 0; off < len(data); off += bs {
		blk := data[off:min(off+bs, len(data))]
		var crcs []byte
		for w := 0; w < len(blk); w += bpc {
			crcs = binary.BigEndian.AppendUint32(crcs, crc32.Checksum(blk[w:min(w+bpc, len(blk))], tab))
		}
		s := md5.Sum(crcs)
		file.Write(s[:])
	}
	want := binary.BigEndian.AppendUint32(nil, bpc)
	want = binary.BigEndian.AppendUint64(want, bs/bpc)
	want = file.Sum(want)
	if a["bytes"] != hex.EncodeToString(want) || a["algorithm"] != "MD5-of-64MD5-of-65536CRC32C" || a["length"] != float64(28) {
		t.Fatalf("checksum %v, want bytes %x", a, want)
	}
	expect(t, "checksum of a dir", e.do(t, "GET", "/vol4/fsb", "GETFILECHECKSUM", nil, nil), 404, nfe)
	expect(t, "checksum missing", e.do(t, "GET", "/vol4/fsb/zz", "GETFILECHECKSUM", nil, nil), 404, nfe)
}

// TestTransferLimit: with every data slot taken, a CREATE data step waits
// TransferWait and answers RetriableException (503) without reading its
// body; metadata calls are not held up.
func TestTransferLimit(t *testing.T) {
	g, err := webhdfs.New(webhdfs.Config{Client: shared.cl, Listen: "127.0.0.1:0", MaxTransfers: 1, TransferWait: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	go g.Serve()
	defer g.Close()
	e := &env{url: "http://" + g.Addr() + webhdfs.Prefix, cl: shared.cl, hc: shared.hc}
	expect(t, "mkdirs", e.do(t, "PUT", "/vol5/fsb", "MKDIRS", nil, nil), 200, "")
	// A slow upload holds the only slot.
	pr, pw := io.Pipe()
	done := make(chan resp, 1)
	go func() {
		r := e.do(t, "PUT", "/vol5/fsb/slow", "CREATE", url.Values{"data": {"true"}}, pr)
		done <- r
	}()
	pw.Write([]byte("first bytes"))
	deadline := time.Now().Add(10 * time.Second)
	for {
		r := e.create(t, "/vol5/fsb/second", []byte("x"), nil)
		if r.code == http.StatusServiceUnavailable {
			expect(t, "second transfer", r, 503, "org.apache.hadoop.ipc.RetriableException")
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("second transfer: %d %s, want 503 while the first holds the slot", r.code, r.body)
		}
		// the first upload may not have taken the slot yet
		e.do(t, "DELETE", "/vol5/fsb/second", "DELETE", nil, nil)
	}
	expect(t, "metadata while the slot is taken", e.do(t, "GET", "/vol5/fsb", "LISTSTATUS", nil, nil), 200, "")
	pw.Close()
	if r := <-done; r.code != 201 {
		t.Fatalf("slow upload: %d %s", r.code, r.body)
	}
	if r := e.do(t, "GET", "/vol5/fsb/slow", "OPEN", nil, nil); string(r.body) != "first bytes" {
		t.Fatalf("slow upload's data: %q", r.body)
	}
}

// TestCreateAborted: a CREATE whose client goes away mid-body leaves
// nothing behind, and an overwrite that fails that way leaves the old file
// whole. The body ends early, so PutKey fails and nothing is committed
// whenever the aborted handler runs; the next CREATE through the only
// transfer slot checks the slot was given back.
func TestCreateAborted(t *testing.T) {
	g, err := webhdfs.New(webhdfs.Config{Client: shared.cl, Listen: "127.0.0.1:0", MaxTransfers: 1, TransferWait: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	go g.Serve()
	defer g.Close()
	e := &env{url: "http://" + g.Addr() + webhdfs.Prefix, cl: shared.cl, hc: shared.hc}
	expect(t, "old file", e.create(t, "/vol6/fsb/old", []byte("old contents"), nil), 201, "")
	for _, name := range []string{"new", "old"} {
		c, err := net.Dial("tcp", g.Addr())
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(c, "PUT %s/vol6/fsb/%s?op=CREATE&data=true&overwrite=true&user.name=alice HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n",
			webhdfs.Prefix, name, g.Addr(), 64<<20)
		c.Write(randBytes(6<<20, 3)) // past the V2 threshold: data reaches the datanodes
		c.Close()
		expect(t, "next create", e.create(t, "/vol6/fsb/next-"+name, []byte("x"), nil), 201, "")
	}
	expect(t, "aborted new file", e.do(t, "GET", "/vol6/fsb/new", "GETFILESTATUS", nil, nil), 404, nfe)
	if r := e.do(t, "GET", "/vol6/fsb/old", "OPEN", nil, nil); string(r.body) != "old contents" {
		t.Fatalf("old file after an aborted overwrite: %d %q", r.code, r.body)
	}
}

// TestCreateTruncatedUpload: a CREATE whose body ends (connection closed)
// before its Content-Length fails and creates no file, also when what
// arrived fits in the client's first read. net/http's body then returns
// io.ErrUnexpectedEOF, which PutKey used to take for the end of the data;
// the gateway was safe anyway, because net/http cancels the request's
// context on that read error (connReader.handleReadErrorLocked) before
// the body returns it, so the OpenKey or commit failed. This test passes
// on the old client too: it guards the gateway's behaviour, and
// client.TestPutKeyReaderUnexpectedEOF the client's. The next CREATE
// through the only transfer slot waits for the aborted handler.
func TestCreateTruncatedUpload(t *testing.T) {
	g, err := webhdfs.New(webhdfs.Config{Client: shared.cl, Listen: "127.0.0.1:0", MaxTransfers: 1, TransferWait: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	go g.Serve()
	defer g.Close()
	e := &env{url: "http://" + g.Addr() + webhdfs.Prefix, cl: shared.cl, hc: shared.hc}
	for _, tc := range []struct {
		name     string
		sent, cl int
	}{{"small", 1000, 2000}, {"large-hint", 1000, 64 << 20}, {"two-mib", 2 << 20, 3 << 20}} {
		c, err := net.Dial("tcp", g.Addr())
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(c, "PUT %s/vol6/fsb/trunc-%s?op=CREATE&data=true&overwrite=true&user.name=alice HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n",
			webhdfs.Prefix, tc.name, g.Addr(), tc.cl)
		c.Write(randBytes(tc.sent, 4))
		c.Close()
		expect(t, "next create", e.create(t, "/vol6/fsb/after-"+tc.name, []byte("x"), nil), 201, "")
		if r := e.do(t, "GET", "/vol6/fsb/trunc-"+tc.name, "GETFILESTATUS", nil, nil); r.code != 404 {
			t.Errorf("%s: %d of %d bytes sent, connection closed: file status %d %s, want 404", tc.name, tc.sent, tc.cl, r.code, r.body)
		}
	}
}

// Owners, groups, permissions and times on directories, buckets and
// volumes: MKDIRS and CREATE record the caller (user.name) and the
// permission given; SETOWNER, SETPERMISSION and SETTIMES change them;
// GETFILESTATUS and LISTSTATUS return them. (On the code before FileAttrs
// these answered UnsupportedOperationException and MKDIRS dropped its
// permission.)
func TestDirectoryAttributes(t *testing.T) {
	e := shared
	stat := func(p string) map[string]any {
		t.Helper()
		r := e.do(t, "GET", p, "GETFILESTATUS", nil, nil)
		expect(t, "stat "+p, r, 200, "")
		return fileStatus(t, r)
	}
	want := func(p string, st map[string]any, owner, group, perm string) {
		t.Helper()
		if st["owner"] != owner || st["group"] != group || st["permission"] != perm {
			t.Fatalf("%s: owner %v group %v permission %v, want %s %s %s", p, st["owner"], st["group"], st["permission"], owner, group, perm)
		}
	}
	// MKDIRS of a new volume, bucket and directories: the last gets the
	// permission, the parents made on the way owner write+search too.
	expect(t, "mkdirs", e.do(t, "PUT", "/vol8/fsb/a/b", "MKDIRS", url.Values{"permission": {"510"}}, nil), 200, "")
	want("/vol8/fsb/a/b", stat("/vol8/fsb/a/b"), "alice", "supergroup", "510")
	want("/vol8/fsb/a", stat("/vol8/fsb/a"), "alice", "supergroup", "710")
	want("/vol8/fsb", stat("/vol8/fsb"), "alice", "supergroup", "710")
	want("/vol8", stat("/vol8"), "alice", "supergroup", "710")
	expect(t, "mkdirs default", e.do(t, "PUT", "/vol8/fsb/c", "MKDIRS", nil, nil), 200, "")
	want("/vol8/fsb/c", stat("/vol8/fsb/c"), "alice", "supergroup", "755")
	expect(t, "create", e.create(t, "/vol8/fsb/a/f", []byte("x"), url.Values{"permission": {"600"}}), 201, "")
	want("/vol8/fsb/a/f", stat("/vol8/fsb/a/f"), "alice", "supergroup", "600")

	// Changes on a directory, a bucket and a volume.
	for _, p := range []string{"/vol8/fsb/a", "/vol8/fsb", "/vol8"} {
		expect(t, "chown "+p, e.do(t, "PUT", p, "SETOWNER", url.Values{"owner": {"bob"}, "group": {"staff"}}, nil), 200, "")
		expect(t, "chmod "+p, e.do(t, "PUT", p, "SETPERMISSION", url.Values{"permission": {"1777"}}, nil), 200, "")
		expect(t, "settimes "+p, e.do(t, "PUT", p, "SETTIMES", url.Values{"modificationtime": {"3000"}, "accesstime": {"-1"}}, nil), 200, "")
		st := stat(p)
		want(p, st, "bob", "staff", "1777")
		if st["modificationTime"] != float64(3000) {
			t.Fatalf("%s: modificationTime %v after SETTIMES", p, st["modificationTime"])
		}
	}
	// Listings show them: a bucket in its volume, a volume under /, a
	// directory in its bucket.
	find := func(dir, name string) map[string]any {
		t.Helper()
		for _, s := range e.do(t, "GET", dir, "LISTSTATUS", nil, nil).json(t)["FileStatuses"].(map[string]any)["FileStatus"].([]any) {
			if m := s.(map[string]any); m["pathSuffix"] == name {
				return m
			}
		}
		t.Fatalf("%s not listed in %s", name, dir)
		return nil
	}
	want("/vol8/fsb/a (listed)", find("/vol8/fsb", "a"), "bob", "staff", "1777")
	want("/vol8/fsb (listed)", find("/vol8", "fsb"), "bob", "staff", "1777")
	want("/vol8 (listed)", find("/", "vol8"), "bob", "staff", "1777")
	// A directory's attributes move with it.
	if r := e.do(t, "PUT", "/vol8/fsb/a", "RENAME", url.Values{"destination": {"/vol8/fsb/z"}}, nil); r.json(t)["boolean"] != true {
		t.Fatalf("rename: %s", r.body)
	}
	want("/vol8/fsb/z", stat("/vol8/fsb/z"), "bob", "staff", "1777")
	want("/vol8/fsb/z/b", stat("/vol8/fsb/z/b"), "alice", "supergroup", "510")
}

// RENAME with OVERWRITE replaces the destination in one metadata
// operation: a file by a file, an empty directory by a directory; a
// non-empty directory or a mismatch is an IOException and changes nothing.
func TestRenameOverwrite(t *testing.T) {
	e := shared
	rename2 := func(src, dst string) resp {
		return e.do(t, "PUT", src, "RENAME", url.Values{"destination": {dst}, "renameoptions": {"OVERWRITE"}}, nil)
	}
	expect(t, "create src", e.create(t, "/vol9/fsb/src", []byte("new"), nil), 201, "")
	expect(t, "create dst", e.create(t, "/vol9/fsb/dst", []byte("old data"), nil), 201, "")
	expect(t, "overwrite file", rename2("/vol9/fsb/src", "/vol9/fsb/dst"), 200, "")
	if r := e.do(t, "GET", "/vol9/fsb/dst", "OPEN", nil, nil); string(r.body) != "new" {
		t.Fatalf("destination after overwrite: %d %q", r.code, r.body)
	}
	expect(t, "source gone", e.do(t, "GET", "/vol9/fsb/src", "GETFILESTATUS", nil, nil), 404, nfe)
	expect(t, "same path", rename2("/vol9/fsb/dst", "/vol9/fsb/dst"), 403, fae)

	expect(t, "mkdirs d", e.do(t, "PUT", "/vol9/fsb/d/sub", "MKDIRS", nil, nil), 200, "")
	expect(t, "mkdirs empty", e.do(t, "PUT", "/vol9/fsb/empty", "MKDIRS", nil, nil), 200, "")
	expect(t, "mkdirs full", e.do(t, "PUT", "/vol9/fsb/full/x", "MKDIRS", nil, nil), 200, "")
	expect(t, "onto non-empty", rename2("/vol9/fsb/d", "/vol9/fsb/full"), 403, "java.io.IOException")
	expect(t, "dir onto file", rename2("/vol9/fsb/d", "/vol9/fsb/dst"), 403, "java.io.IOException")
	expect(t, "file onto dir", rename2("/vol9/fsb/dst", "/vol9/fsb/empty"), 403, "java.io.IOException")
	expect(t, "full untouched", e.do(t, "GET", "/vol9/fsb/full/x", "GETFILESTATUS", nil, nil), 200, "")
	expect(t, "onto empty", rename2("/vol9/fsb/d", "/vol9/fsb/empty"), 200, "")
	expect(t, "moved child", e.do(t, "GET", "/vol9/fsb/empty/sub", "GETFILESTATUS", nil, nil), 200, "")
	expect(t, "missing parent", rename2("/vol9/fsb/dst", "/vol9/fsb/no/f"), 404, nfe)
}

// TestRacingCreatesWithoutOverwrite (issue 14): CREATE without overwrite
// is create-if-absent inside the namespace's Raft apply. Writers racing
// for one path all pass the gateway's early existence check (their data
// moves first), yet exactly one commit wins; the others get
// FileAlreadyExistsException and the file holds the winner's bytes. Before
// the precondition, every racer "succeeded" and the last one overwrote
// the others.
func TestRacingCreatesWithoutOverwrite(t *testing.T) {
	e := shared
	expect(t, "mkdirs", e.do(t, "PUT", "/vol1/fsb/race", "MKDIRS", nil, nil), 200, "")
	const n = 6
	bodies := make([][]byte, n)
	codes := make([]resp, n)
	var wg sync.WaitGroup
	for i := range n {
		bodies[i] = randBytes(2<<20, int64(100+i))
		wg.Add(1)
		go func() {
			defer wg.Done()
			codes[i] = e.create(t, "/vol1/fsb/race/f", bodies[i], url.Values{"overwrite": {"false"}})
		}()
	}
	wg.Wait()
	won := -1
	for i, r := range codes {
		switch {
		case r.code == http.StatusCreated:
			if won >= 0 {
				t.Fatalf("racers %d and %d both created the file", won, i)
			}
			won = i
		case r.exception() == fae:
		default:
			t.Fatalf("racer %d: %d %s", i, r.code, r.body)
		}
	}
	if won < 0 {
		t.Fatal("no racer created the file")
	}
	got := e.do(t, "GET", "/vol1/fsb/race/f", "OPEN", nil, nil)
	if !bytes.Equal(got.body, bodies[won]) {
		t.Fatalf("the file does not hold the winner's bytes (%d bytes)", len(got.body))
	}
}

// TestUserPermissions: the gateway acts for user.name and the metadata
// service checks the POSIX modes: bob cannot create, list or delete in
// alice's 0700 directory, nor create a volume (admins only); her 0777
// directory takes his entries, owned by him. Without the checks every
// refused request here succeeded.
func TestUserPermissions(t *testing.T) {
	e := shared
	as := func(user string, kv ...string) url.Values {
		v := url.Values{"user.name": {user}}
		for i := 0; i+1 < len(kv); i += 2 {
			v.Set(kv[i], kv[i+1])
		}
		return v
	}
	refused := func(what string, r resp) {
		t.Helper()
		if r.code != http.StatusForbidden || !strings.HasSuffix(r.exception(), "AccessControlException") {
			t.Fatalf("%s: %d %s, want 403 AccessControlException", what, r.code, r.body)
		}
	}
	ok := func(what string, r resp) {
		t.Helper()
		if r.code != http.StatusOK && r.code != http.StatusCreated {
			t.Fatalf("%s: %d %s", what, r.code, r.body)
		}
	}
	ok("alice mkdir the bucket", e.do(t, "PUT", "/pvol/pfsb", "MKDIRS", as("alice", "permission", "755"), nil))
	ok("alice mkdir private", e.do(t, "PUT", "/pvol/pfsb/private", "MKDIRS", as("alice", "permission", "700"), nil))
	ok("alice mkdir shared", e.do(t, "PUT", "/pvol/pfsb/shared", "MKDIRS", as("alice", "permission", "777"), nil))
	ok("alice writes a file", e.create(t, "/pvol/pfsb/private/f", []byte("secret"), as("alice")))

	refused("bob mkdir in private", e.do(t, "PUT", "/pvol/pfsb/private/x", "MKDIRS", as("bob"), nil))
	refused("bob lists private", e.do(t, "GET", "/pvol/pfsb/private", "LISTSTATUS", as("bob"), nil))
	refused("bob reads in private", e.do(t, "GET", "/pvol/pfsb/private/f", "OPEN", as("bob"), nil))
	refused("bob deletes private", e.do(t, "DELETE", "/pvol/pfsb/private", "DELETE", as("bob", "recursive", "true"), nil))
	refused("bob creates a volume", e.do(t, "PUT", "/bobvol", "MKDIRS", as("bob"), nil))
	if r := e.create(t, "/pvol/pfsb/private/g", []byte("x"), as("bob")); r.code != http.StatusForbidden {
		t.Fatalf("bob creates a file in private: %d %s", r.code, r.body)
	}

	ok("bob mkdir in shared", e.do(t, "PUT", "/pvol/pfsb/shared/bobs", "MKDIRS", as("bob"), nil))
	st := e.do(t, "GET", "/pvol/pfsb/shared/bobs", "GETFILESTATUS", as("bob"), nil).json(t)
	if owner := st["FileStatus"].(map[string]any)["owner"]; owner != "bob" {
		t.Fatalf("bob's directory: owner %v", owner)
	}
	ok("alice still reads her file", e.do(t, "GET", "/pvol/pfsb/private/f", "OPEN", as("alice"), nil))
}
