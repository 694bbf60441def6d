package webhdfs

import (
	"crypto/md5"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

func int64Param(q *request, name string, def int64) (int64, error) {
	v := q.param(name)
	if v == "" {
		return def, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return 0, badParam("Invalid value for webhdfs parameter %q: %q", name, v)
	}
	return n, nil
}

// open streams [offset, offset+length) of a file. It answers 200 itself
// instead of redirecting to a datanode (the client accepts that, as from
// HttpFS), with Content-Length so the client bounds its reads.
func (g *Gateway) open(q *request) error {
	off, err := int64Param(q, "offset", 0)
	if err != nil {
		return err
	}
	length, err := int64Param(q, "length", -1)
	if q.param("length") == "" {
		length = -1
	} else if err != nil {
		return err
	}
	p := q.path
	if p.depth() < 3 {
		if _, _, err := g.stat(q.ctx, p); err != nil {
			return err
		}
		return remote(classFileNotFound, "Path is not a file: %s", p)
	}
	release, err := g.transfer(q.ctx)
	if err != nil {
		return err
	}
	defer release()
	rd, err := g.cl.GetKey(q.ctx, p.volume, p.bucket, p.key)
	if err != nil {
		if errors.Is(err, client.ErrPrecondition) {
			// a directory, or a file on the way
			if e, lerr := g.lookup(q.ctx, p); lerr == nil && e.IsDir {
				return remote(classFileNotFound, "Path is not a file: %s", p)
			}
			return notFound(p)
		}
		if errors.Is(err, client.ErrNotFound) {
			return notFound(p)
		}
		return toRemote(p, err)
	}
	defer rd.Close()
	size := rd.Size()
	// Past the end: an empty body, so the client's read returns -1 and a
	// later seek back still works (an error here leaves Hadoop's
	// WebHdfsInputStream unable to read again).
	off = min(off, size)
	n := size - off
	if length >= 0 && length < n {
		n = length
	}
	if _, err := rd.Seek(off, io.SeekStart); err != nil {
		return toRemote(p, err)
	}
	w := q.w
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
	w.WriteHeader(http.StatusOK)
	var copied int64
	if off+n == size {
		var body io.Writer = w
		if q.r.ProtoMajor == 1 {
			body = http1Body{w} // mapped local blocks written without a copy
		}
		copied, err = rd.WriteTo(body) // parallel chunk reads to the end
	} else {
		buf := make([]byte, 4<<20)
		copied, err = io.CopyBuffer(w, io.LimitReader(onlyReader{rd}, n), buf)
	}
	if err != nil || copied != n {
		// Headers are out: the client sees a short body and fails, which
		// is all that can be said now.
		g.cfg.Logger.Warn("webhdfs: OPEN failed mid-stream", "path", p.String(), "offset", off, "sent", copied, "want", n, "err", err)
		panic(http.ErrAbortHandler)
	}
	return nil
}

// http1Body is net/http's HTTP/1.x response writer, whose Write copies p
// into its buffers or write(2)s it in the calling goroutine: a
// client.SyncWriter, given mapped block files themselves (HTTP/2's is
// not: it hands p to the connection's goroutines).
type http1Body struct{ w io.Writer }

func (b http1Body) Write(p []byte) (int, error)  { return b.w.Write(p) }
func (http1Body) WritesInCallingGoroutine() bool { return true }

// onlyReader hides KeyReader's WriteTo from io.Copy (which would copy to
// the end, past the requested length).
type onlyReader struct{ r io.Reader }

func (o onlyReader) Read(p []byte) (int, error) { return o.r.Read(p) }

// createChecks validates a CREATE before any data moves (and again at the
// data step): the target is a file path in an FS bucket that is not a
// directory, exists only with overwrite, and has no file on the way.
func (g *Gateway) createChecks(q *request, overwrite bool) error {
	p := q.path
	if p.depth() < 3 {
		if _, _, err := g.stat(q.ctx, p); err == nil {
			return remote(classAlreadyExists, "%s already exists as a directory (a volume or bucket)", p)
		}
		return remote(classIO, "cannot create file %s: files live inside a bucket (/volume/bucket/path)", p)
	}
	// Like HDFS's create, which makes missing parents, a missing volume
	// or bucket is created (as MKDIRS does).
	dirPerm := uint32(0o755)
	if err := g.ensureBucket(q.ctx, p, &metapb.FileAttrs{Owner: q.user, Permission: &dirPerm}); err != nil {
		return err
	}
	e, err := g.cl.GetFileStatus(q.ctx, p.volume, p.bucket, p.key)
	switch {
	case err == nil && e.IsDir:
		return remote(classAlreadyExists, "%s already exists as a directory", p)
	case err == nil && !overwrite:
		return remote(classAlreadyExists, "%s already exists", p)
	case err == nil, errors.Is(err, client.ErrNotFound):
		return nil
	case errors.Is(err, client.ErrPrecondition) && isNotDirectory(err):
		return remote(classParentNotDir, "cannot create %s: %v", p, err)
	}
	return toRemote(p, err)
}

func replicationParam(q *request) (client.Replication, error) {
	v := q.param("replication")
	if v == "" {
		return client.ReplicationDefault, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > 512 {
		return 0, badParam("Invalid value for webhdfs parameter \"replication\": %q", v)
	}
	// Basalt has ONE and THREE: one copy, or three.
	if n == 1 {
		return client.ReplicationOne, nil
	}
	return client.ReplicationThree, nil
}

// create is the two-step CREATE: without data=true it checks everything
// and redirects to this gateway with data=true (307, or 200 with the
// Location in JSON when the client asks noredirect=true); with it, it
// streams the body into the key and commits it with its HDFS attributes.
// The file appears whole at the end, never partly written.
func (g *Gateway) create(q *request) error {
	overwrite, err := boolParam(q, "overwrite", false)
	if err != nil {
		return err
	}
	// createNonRecursive sends createflag (CREATE, OVERWRITE, APPEND, ...)
	// and createparent=false instead.
	for _, f := range strings.Split(q.param("createflag"), ",") {
		switch strings.ToUpper(strings.TrimSpace(f)) {
		case "", "CREATE", "SYNC_BLOCK", "LAZY_PERSIST", "NEW_BLOCK", "NO_LOCAL_WRITE", "SHOULD_REPLICATE", "IGNORE_CLIENT_LOCALITY":
		case "OVERWRITE":
			overwrite = true
		case "APPEND":
			return unsupported("CREATE of %s with flag APPEND: Basalt files are immutable once written (no append yet)", q.path)
		default:
			return badParam("Invalid value for webhdfs parameter \"createflag\": %q", q.param("createflag"))
		}
	}
	createParent, err := boolParam(q, "createparent", true)
	if err != nil {
		return err
	}
	if !createParent && q.path.depth() == 3 {
		if i := strings.LastIndexByte(q.path.key, '/'); i >= 0 {
			parent := fsPath{volume: q.path.volume, bucket: q.path.bucket, key: q.path.key[:i]}
			e, err := g.lookup(q.ctx, parent)
			if err != nil {
				return err
			}
			if !e.IsDir {
				return remote(classParentNotDir, "Parent path is not a directory: %s", parent)
			}
		} else if _, _, err := g.stat(q.ctx, fsPath{volume: q.path.volume, bucket: q.path.bucket}); err != nil {
			return err
		}
	}
	repl, err := replicationParam(q)
	if err != nil {
		return err
	}
	perm, err := permParam(q, "permission")
	if err != nil {
		return err
	}
	if perm == "" {
		perm = defaultFilePerm
	}
	if _, err := int64Param(q, "blocksize", 0); err != nil {
		return err
	}
	if err := g.createChecks(q, overwrite); err != nil {
		return err
	}
	data, err := boolParam(q, "data", false)
	if err != nil {
		return err
	}
	if !data {
		u := url.URL{Scheme: "http", Host: q.r.Host, Path: q.r.URL.Path}
		v := q.r.URL.Query()
		v.Del("noredirect")
		v.Set("data", "true")
		u.RawQuery = v.Encode()
		if nr, _ := boolParam(q, "noredirect", false); nr {
			writeJSON(q.w, http.StatusOK, map[string]string{"Location": u.String()})
			return nil
		}
		q.w.Header().Set("Location", u.String())
		q.w.Header().Set("Content-Length", "0")
		q.w.WriteHeader(http.StatusTemporaryRedirect)
		return nil
	}
	release, err := g.transfer(q.ctx)
	if err != nil {
		return err
	}
	defer release()
	p := q.path
	var sizeHint int64
	if cl := q.r.ContentLength; cl > 0 {
		sizeHint = cl
	}
	attrs := &metapb.ObjectMeta{User: map[string]string{attrOwner: q.user, attrGroup: defaultGroup, attrPerm: perm}}
	_, err = g.cl.PutKey(q.ctx, p.volume, p.bucket, p.key, q.r.Body, client.PutOptions{SizeHint: sizeHint, Replication: repl,
		BeforeCommit: func(req *metapb.CommitKeyRequest) error {
			req.Meta = attrs
			// Without overwrite the namespace refuses the commit inside
			// its Raft apply when a file exists at the path, so of racing
			// CREATEs exactly one wins; createChecks gives the early,
			// clearer message for the common case.
			if !overwrite {
				req.Precondition = &metapb.KeyPrecondition{ExpectAbsent: true}
			}
			return g.createChecks(q, overwrite)
		}})
	if err != nil {
		var re *remoteError
		if errors.As(err, &re) {
			return re
		}
		return toRemote(p, err)
	}
	q.w.Header().Set("Location", "webhdfs://"+q.r.Host+p.String())
	q.w.Header().Set("Content-Length", "0")
	q.w.WriteHeader(http.StatusCreated)
	return nil
}

// appendOp: Basalt keys are immutable once committed; appending safely
// needs a namespace operation that commits new blocks after a key's
// existing ones, which does not exist yet.
func (g *Gateway) appendOp(q *request) error {
	if _, _, err := g.stat(q.ctx, q.path); err != nil {
		return err
	}
	return unsupported("APPEND to %s: Basalt files are immutable once written (no append yet)", q.path)
}

func (g *Gateway) concat(q *request) error {
	return unsupported("CONCAT into %s is not supported by Basalt", q.path)
}

func (g *Gateway) truncate(q *request) error {
	return unsupported("TRUNCATE of %s is not supported by Basalt", q.path)
}

// fileChecksum is HDFS's MD5-of-MD5-of-CRC32C over the CRC32Cs the
// datanodes store (one per 64 KiB window): per block the MD5 of its CRCs,
// then the MD5 of those. WebHDFS in Hadoop 3.4 carries only this form (not
// COMPOSITE-CRC). Two Basalt files with the same bytes, block size and
// checksum window have the same checksum, which is what distcp -update
// compares; against HDFS (512-byte windows) they differ, as between any
// two HDFS clusters with different settings.
func (g *Gateway) fileChecksum(q *request) error {
	p := q.path
	if p.depth() < 3 {
		if _, _, err := g.stat(q.ctx, p); err != nil {
			return err
		}
		return remote(classFileNotFound, "Path is not a file: %s", p)
	}
	e, err := g.lookup(q.ctx, p)
	if err != nil {
		return err
	}
	if e.IsDir {
		return remote(classFileNotFound, "Path is not a file: %s", p)
	}
	_, blocks, err := g.cl.KeyChecksums(q.ctx, p.volume, p.bucket, p.key)
	if err != nil {
		return toRemote(p, err)
	}
	bpc := uint32(client.DefaultBytesPerChecksum)
	if len(blocks) > 0 {
		bpc = blocks[0].BytesPerChecksum
	}
	var crcPerBlock int64
	if len(blocks) > 1 {
		crcPerBlock = int64(len(blocks[0].Sums) / 4)
	}
	file := md5.New()
	for _, b := range blocks {
		if b.BytesPerChecksum != bpc {
			return remote(classIO, "checksum of %s: blocks have different checksum windows (%d, %d)", p, bpc, b.BytesPerChecksum)
		}
		sum := md5.Sum(b.Sums)
		file.Write(sum[:])
	}
	// MD5MD5CRC32FileChecksum.write: bytesPerCRC (int), crcPerBlock (long),
	// the MD5.
	out := make([]byte, 0, 28)
	out = binary.BigEndian.AppendUint32(out, bpc)
	out = binary.BigEndian.AppendUint64(out, uint64(crcPerBlock))
	out = file.Sum(out)
	writeJSON(q.w, http.StatusOK, map[string]any{"FileChecksum": map[string]any{
		"algorithm": fmt.Sprintf("MD5-of-%dMD5-of-%dCRC32C", crcPerBlock, bpc),
		"bytes":     hex.EncodeToString(out),
		"length":    len(out),
	}})
	return nil
}

// blockLocations is GETFILEBLOCKLOCATIONS: the blocks overlapping
// [offset, offset+length) with their replicas, nearest to the gateway
// first (what listLocatedStatus and schedulers use for locality).
func (g *Gateway) blockLocations(q *request) error {
	off, err := int64Param(q, "offset", 0)
	if err != nil {
		return err
	}
	length, err := int64Param(q, "length", 1<<62)
	if err != nil {
		return err
	}
	p := q.path
	if p.depth() < 3 {
		if _, _, err := g.stat(q.ctx, p); err != nil {
			return err
		}
		return remote(classFileNotFound, "Path is not a file: %s", p)
	}
	e, err := g.lookup(q.ctx, p)
	if err != nil {
		return err
	}
	if e.IsDir {
		return remote(classFileNotFound, "Path is not a file: %s", p)
	}
	k, err := g.cl.StatKey(q.ctx, p.volume, p.bucket, p.key)
	if err != nil {
		return toRemote(p, err)
	}
	type location struct {
		CachedHosts   []string `json:"cachedHosts"`
		Corrupt       bool     `json:"corrupt"`
		Hosts         []string `json:"hosts"`
		Length        uint64   `json:"length"`
		Names         []string `json:"names"`
		Offset        uint64   `json:"offset"`
		StorageIDs    []string `json:"storageIds"`
		StorageTypes  []string `json:"storageTypes"`
		TopologyPaths []string `json:"topologyPaths"`
	}
	end := uint64(off) + uint64(length)
	if end < uint64(off) {
		end = ^uint64(0)
	}
	locs := []location{}
	for _, b := range k.Blocks {
		if b.Offset+b.Length <= uint64(off) || b.Offset >= end {
			continue
		}
		l := location{CachedHosts: []string{}, Offset: b.Offset, Length: b.Length}
		for _, r := range b.Replicas {
			host := r.Hostname
			if h, _, err := net.SplitHostPort(r.Addr); err == nil && host == "" {
				host = h
			}
			l.Hosts = append(l.Hosts, host)
			l.Names = append(l.Names, r.Addr)
			l.StorageIDs = append(l.StorageIDs, r.UUID)
			l.StorageTypes = append(l.StorageTypes, "DISK")
			l.TopologyPaths = append(l.TopologyPaths, strings.TrimSuffix(r.Location, "/")+"/"+r.Addr)
		}
		locs = append(locs, l)
	}
	writeJSON(q.w, http.StatusOK, map[string]any{"BlockLocations": map[string]any{"BlockLocation": locs}})
	return nil
}
