package s3

import (
	"bufio"
	"bytes"
	"crypto/hmac"
	"crypto/md5"
	"crypto/sha1"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"hash"
	"hash/crc32"
	"hash/crc64"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/basalt-store/basalt/internal/crc32c"
)

// Request bodies stream from the socket to the datanodes: nothing here
// holds more than a bufio buffer. Every check that needs the whole body
// (payload SHA-256, Content-MD5, flexible checksums, chunk and trailer
// signatures, length) fails the read at the latest at EOF, before the key
// is committed, so a bad upload never becomes visible; a large body's
// digests written through putData fail its BeforeCommit instead (late,
// settle), still before the commit.

const (
	maxChunkHeader = 4096 // one aws-chunked size line or trailer line
	maxTrailers    = 16
)

// crc64NVME is the CRC-64/NVME table S3's CRC64NVME checksum uses.
var crc64NVME = crc64.MakeTable(0x9a6c9329ac4bc9b5)

// checksumAlgos are S3's flexible checksum algorithms by header suffix.
var checksumAlgos = map[string]func() hash.Hash{
	"crc32":     func() hash.Hash { return crc32.NewIEEE() },
	"crc32c":    func() hash.Hash { return crc32c.New() },
	"crc64nvme": func() hash.Hash { return crc64.New(crc64NVME) },
	"sha1":      sha1.New,
	"sha256":    sha256.New,
}

// checksumHeaders are the x-amz-checksum-* header names by algorithm, in
// canonical form (a lookup by another form allocates).
var checksumHeaders = func() map[string]string {
	m := map[string]string{}
	for alg := range checksumAlgos {
		m[alg] = http.CanonicalHeaderKey("x-amz-checksum-" + alg)
	}
	return m
}()

// chunkedReader decodes an aws-chunked body
// (https://docs.aws.amazon.com/AmazonS3/latest/API/sigv4-streaming.html):
// "hex-size[;chunk-signature=sig]\r\n<data>\r\n" ... a zero-size chunk,
// then trailer lines "name:value\r\n" and an empty line when trailers are
// declared. With signatures, each chunk's signature chains from the
// previous one (the seed is the request's); a chunk is passed on before its
// signature is checked, and a bad signature fails the read, so the upload
// is not committed.
type chunkedReader struct {
	br      *bufio.Reader
	a       *auth // nil: unsigned chunks
	trailer bool
	// prevSig and chunkSig are hex signatures (64 bytes); a chunk-signature
	// of another length never matches (chunkSigOK false).
	prevSig    [64]byte
	chunkSig   [64]byte
	chunkSigOK bool
	key        *derivedKey // a's signing key with its HMAC pads
	left       int64       // bytes of the current chunk not yet read
	h          hash.Hash
	started    bool
	done       bool
	err        error
	trailers   map[string]string
}

func newChunkedReader(r io.Reader, a *auth, signed, trailer bool) *chunkedReader {
	c := &chunkedReader{br: bufio.NewReaderSize(r, maxChunkHeader), trailer: trailer}
	if signed {
		c.a = a
		if c.key = a.key; c.key == nil {
			c.key = newDerivedKey(a.signingKey)
		}
		// The seed signature is the request's, verified: 64 hex digits.
		copy(c.prevSig[:], a.seedSig)
		c.h = sha256.New()
	}
	return c
}

var errBadChunk = errorf("IncompleteBody", 400, "The aws-chunked request body is malformed")

// lineBytes returns the next line without its CRLF, valid until the next
// read (no allocation per chunk).
func (c *chunkedReader) lineBytes() ([]byte, error) {
	l, err := c.br.ReadSlice('\n')
	if err != nil {
		if errors.Is(err, bufio.ErrBufferFull) {
			return nil, errBadChunk
		}
		if err == io.EOF {
			return nil, errorf("IncompleteBody", 400, "The request body ended before the last aws-chunked chunk")
		}
		return nil, err
	}
	return bytes.TrimRight(l, "\r\n"), nil
}

func (c *chunkedReader) line() (string, error) {
	l, err := c.lineBytes()
	return string(l), err
}

// parseHexSize parses a chunk size: 1 to 15 hex digits.
func parseHexSize(b []byte) (int64, bool) {
	if len(b) == 0 || len(b) > 15 {
		return 0, false
	}
	var n int64
	for _, ch := range b {
		switch {
		case '0' <= ch && ch <= '9':
			ch -= '0'
		case 'a' <= ch && ch <= 'f':
			ch -= 'a' - 10
		case 'A' <= ch && ch <= 'F':
			ch -= 'A' - 10
		default:
			return 0, false
		}
		n = n<<4 | int64(ch)
	}
	return n, true
}

func (c *chunkedReader) verifyChunk() error {
	if c.a == nil {
		return nil
	}
	// No allocation per chunk: the string to sign is built on the stack
	// and HMACed with the key's precomputed pads.
	var sum [32]byte
	c.h.Sum(sum[:0])
	var want [64]byte
	var buf [512]byte
	c.key.chunkSignature(&want, buf[:0], c.a.amzDate, c.a.scope, &c.prevSig, &sum)
	if !c.chunkSigOK || !hmac.Equal(want[:], c.chunkSig[:]) {
		return errorf("SignatureDoesNotMatch", 403, "The chunk signature we calculated does not match the signature you provided.")
	}
	c.prevSig = c.chunkSig
	c.h.Reset()
	return nil
}

// next reads the next chunk header (after the previous chunk's CRLF).
func (c *chunkedReader) next() error {
	if c.started {
		if l, err := c.lineBytes(); err != nil {
			return err
		} else if len(l) != 0 {
			return errBadChunk
		}
		if err := c.verifyChunk(); err != nil {
			return err
		}
	}
	c.started = true
	l, err := c.lineBytes()
	if err != nil {
		return err
	}
	sizeHex, ext, _ := bytes.Cut(l, []byte(";"))
	size, ok := parseHexSize(bytes.TrimSpace(sizeHex))
	if !ok {
		return errBadChunk
	}
	if c.a != nil {
		sig, ok := bytes.CutPrefix(ext, []byte("chunk-signature="))
		if !ok {
			return errorf("SignatureDoesNotMatch", 403, "A chunk has no chunk-signature")
		}
		c.chunkSigOK = len(sig) == len(c.chunkSig)
		copy(c.chunkSig[:], sig)
	}
	c.left = size
	if size > 0 {
		return nil
	}
	// The final chunk: its signature covers no data.
	if err := c.verifyChunk(); err != nil {
		return err
	}
	if c.trailer {
		if err := c.readTrailers(); err != nil {
			return err
		}
	} else if l, err := c.line(); err != nil || l != "" {
		if err == nil {
			err = errBadChunk
		}
		return err
	}
	// Nothing may follow the final chunk: bytes there are no part of the
	// signed payload, and a body is one payload.
	if _, err := c.br.ReadByte(); err != io.EOF {
		if err == nil {
			err = errorf("IncompleteBody", 400, "The aws-chunked request body has data after its final chunk")
		}
		return err
	}
	c.done = true
	return io.EOF
}

func (c *chunkedReader) readTrailers() error {
	var signed bytes.Buffer
	trailerSig := ""
	for i := 0; ; i++ {
		l, err := c.line()
		if err != nil {
			return err
		}
		if l == "" {
			break
		}
		if i >= maxTrailers {
			return errBadChunk
		}
		k, v, ok := strings.Cut(l, ":")
		if !ok {
			return errBadChunk
		}
		k = strings.ToLower(strings.TrimSpace(k))
		v = strings.TrimSpace(v)
		if k == "x-amz-trailer-signature" {
			trailerSig = v
			continue
		}
		if c.trailers == nil {
			c.trailers = map[string]string{}
		}
		c.trailers[k] = v
		signed.WriteString(k + ":" + v + "\n")
	}
	if c.a != nil {
		sts := "AWS4-HMAC-SHA256-TRAILER\n" + c.a.amzDate + "\n" + c.a.scope + "\n" + string(c.prevSig[:]) + "\n" + sha256Hex(signed.Bytes())
		want := hex.EncodeToString(hmacSHA256(c.a.signingKey, sts))
		if !hmac.Equal([]byte(want), []byte(trailerSig)) {
			return errorf("SignatureDoesNotMatch", 403, "The trailer signature we calculated does not match the signature you provided.")
		}
	}
	return nil
}

func (c *chunkedReader) Read(p []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	for c.left == 0 {
		if err := c.next(); err != nil {
			c.err = err
			return 0, err
		}
	}
	if int64(len(p)) > c.left {
		p = p[:c.left]
	}
	n, err := c.br.Read(p)
	c.left -= int64(n)
	if c.h != nil {
		c.h.Write(p[:n])
	}
	if err == io.EOF {
		err = errorf("IncompleteBody", 400, "The request body ended inside an aws-chunked chunk")
	}
	if err != nil {
		c.err = err
	}
	return n, err
}

// body reads a request body for a write, verifying what the client
// declared, and computes the ETag (MD5).
type body struct {
	r       io.Reader
	chunked *chunkedReader
	md5     hash.Hash
	// laneMD5 is md5 for large bodies: hashed in the shared AVX-512
	// lanes or alone (md5lanes.go); done at EOF or failure, closed by close.
	laneMD5 *laneMD5
	// Verification, each optional.
	sha256     hash.Hash
	wantSHA256 string
	contentMD5 []byte
	ckAlg      string    // lower-case algorithm, e.g. "crc32"; "" none
	ck         hash.Hash // nil when the write path sums it (crcFromWrite)
	ckWant     string    // base64; "" until the trailer brings it
	// crcFromWrite: the checksum is CRC32C and the write path reports it
	// (client.PutOptions.DataCRC32C, combined from the chunk sums it
	// computes anyway), so the body does not sum the bytes a second time;
	// verifyWriteCRC checks it before the key is committed.
	crcFromWrite bool
	writeCRC     uint32
	writeCRCSet  bool
	want         int64 // declared length, -1 unknown
	max          int64

	n   int64
	err error // first failure: an *Error, or the client's read error
	eof bool
	// async, for large bodies, runs the digests above on another
	// goroutine; nil: they run inline in Read.
	async *hasher
	// Timeline (stage metrics data_body, data_hashwait, data_tail): time
	// blocked reading the request from its connection, time the reading
	// waited for the digests, and when the body ended.
	sock  timedReader
	eofAt time.Time
	// late: the digests of a large body are checked by settle, before the
	// commit, rather than at EOF (putData): the last buffers' hashing
	// overlaps the streams' close instead of holding up the body's end.
	// settled: settle ran.
	late, settled bool
}

// timedReader is the request's own body, timed: how long its reads block
// is how long the upload waited for the client (its sending, the network)
// rather than for the gateway or the datanodes.
type timedReader struct {
	r io.Reader
	d time.Duration
}

func (t *timedReader) Read(p []byte) (int, error) {
	s := time.Now()
	n, err := t.r.Read(p)
	t.d += time.Since(s)
	return n, err
}

// Large bodies are hashed off the request goroutine: MD5 (the ETag) runs
// at ~800 MB/s on one core here, slower than receiving and forwarding, so
// inline it would cap a single upload's throughput. A large upload holds
// up to hashBufs*hashBufSize more memory; MaxUploads bounds the total.
const (
	asyncHashMin = 1 << 20
	hashBufSize  = 256 << 10
)

// hashBufs is how many buffers a large body written through putData
// (holding an upload slot) may have its digests lag behind its reading (a
// variable for benchmarks): 16 (4 MiB a body, 128 MiB at MaxUploads 32).
// Other bodies (XML, policies: no upload slot) keep shallowHashBufs, and
// every hasher takes its buffers from the pool as bytes arrive, so a
// stalled body holds none it has not filled (review of session 13). With 4, twelve paced bodies' reading waited for their
// hashing (BenchmarkETagPaced bodies=12: 300-340 MB/s against 480-500
// with 16, at the same ~1.0 CPU-s/GiB), and warp's parts spent a third
// of their time there (stage data_hashwait; BENCHMARKS.md, session 13).
var hashBufs = 16

// shallowHashBufs is the lag of bodies not written through putData.
const shallowHashBufs = 4

// hashBufsHeld counts the hash buffers taken from the pool and not yet
// returned, by every hasher (tests).
var hashBufsHeld atomic.Int64

var hashBufPool = sync.Pool{New: func() any { b := make([]byte, 0, hashBufSize); return &b }}

// hasher feeds copies of a body, in order, to digests on their own
// goroutines. write blocks when hashBufs buffers are waiting (backpressure
// instead of unbounded memory); wait returns once every byte is hashed.
type hasher struct {
	n    int             // most buffers it may hold (deepen raises it to hashBufs)
	made int             // buffers taken from the pool so far (at most n)
	free chan *hashBuf   // capacity hashBufs
	work []chan *hashBuf // one per digest
	done sync.WaitGroup
	cur  *hashBuf
	shut bool
	// full counts the times write found no free buffer (the body's
	// reading waited for its hashing).
	full atomic.Int64
	// waited is how long write waited for a free buffer in all.
	waited time.Duration
}

// hashBuf is a copy of body bytes that every digest goroutine reads; the
// last one done returns it.
type hashBuf struct {
	b    *[]byte
	left atomic.Int32
}

// newHasher starts one goroutine per digest, so MD5 (the slowest) and a
// flexible checksum or payload SHA-256 run side by side.
// Its buffers are taken as bytes arrive, up to n (at most hashBufs).
func newHasher(hs []hash.Hash, n int) *hasher {
	n = min(n, hashBufs)
	h := &hasher{n: n, free: make(chan *hashBuf, hashBufs)}
	for _, d := range hs {
		ch := make(chan *hashBuf, hashBufs)
		h.work = append(h.work, ch)
		h.done.Add(1)
		go func() {
			defer h.done.Done()
			for b := range ch {
				d.Write(*b.b)
				if b.left.Add(-1) == 0 {
					*b.b = (*b.b)[:0]
					h.free <- b
				}
			}
		}()
	}
	return h
}

// deepen lets the digests lag by hashBufs buffers (a body written through
// putData, which holds an upload slot). Call it before the first write.
func (h *hasher) deepen() { h.n = hashBufs }

func (h *hasher) send(b *hashBuf) {
	b.left.Store(int32(len(h.work)))
	for _, ch := range h.work {
		ch <- b
	}
}

func (h *hasher) write(p []byte) {
	for len(p) > 0 {
		if h.cur == nil {
			select {
			case h.cur = <-h.free:
			default:
				if h.made < h.n { // a buffer more, as bytes arrive
					h.made++
					hashBufsHeld.Add(1)
					h.cur = &hashBuf{b: hashBufPool.Get().(*[]byte)}
					break
				}
				// Every buffer is waiting for a digest: the read waits.
				h.full.Add(1)
				t := time.Now()
				h.cur = <-h.free
				h.waited += time.Since(t)
			}
		}
		b := *h.cur.b
		n := copy(b[len(b):cap(b)], p)
		*h.cur.b = b[:len(b)+n]
		p = p[n:]
		if len(*h.cur.b) == cap(*h.cur.b) {
			h.send(h.cur)
			h.cur = nil
		}
	}
}

// flush hands the partly filled buffer to the digests (the body ended).
// It never blocks: a buffer in hand was taken from free, so the digests'
// channels have room for it.
func (h *hasher) flush() {
	if h.cur != nil && len(*h.cur.b) > 0 && !h.shut {
		h.send(h.cur)
		h.cur = nil
	}
}

// wait hashes what is left, stops the goroutines and returns the buffers.
// It is idempotent, so an abandoned body can be closed after a failure.
func (h *hasher) wait() {
	if h.shut {
		return
	}
	h.shut = true
	if h.cur != nil && len(*h.cur.b) > 0 {
		h.send(h.cur)
		h.cur = nil
	}
	for _, ch := range h.work {
		close(ch)
	}
	h.done.Wait()
	if h.cur != nil { // taken and left empty: not in free
		hashBufPool.Put(h.cur.b)
		h.cur = nil
		h.made--
		hashBufsHeld.Add(-1)
	}
	for range h.made {
		hashBufPool.Put((<-h.free).b)
		hashBufsHeld.Add(-1)
	}
	h.made = 0
}

// deepen lets a body written through putData (holding an upload slot)
// lag its digests by hashBufs buffers; its MD5 counts as behind for twice
// as many after a wait (laneBehindKeep). Call it before the first Read.
func (b *body) deepen() {
	if b.async != nil {
		b.async.deepen()
	}
	if b.laneMD5 != nil {
		b.laneMD5.behindKeep = 2 * hashBufs
	}
}

// timeline adds the body's share of the data stage to s: blocked on the
// client's sending, waiting for the digests, and from the body's end to
// the commit (closing the streams: every replica synced, and the block
// committed) when committing is set.
func (b *body) timeline(s *stageTimer, committing time.Time) {
	s.body += b.sock.d
	if b.async != nil {
		s.hashWait += b.async.waited
	}
	if !b.eofAt.IsZero() && committing.After(b.eofAt) {
		s.tail += committing.Sub(b.eofAt)
	}
}

// close releases what the body holds; safe after any outcome.
func (b *body) close() {
	if b.laneMD5 != nil {
		// No longer read (e.g. the commit failed with the body unread to
		// its end): not counted as large nor waited for at the gate, so
		// its own last buffers go at once.
		b.laneMD5.done()
	}
	if b.async != nil {
		b.async.wait()
	}
	if b.laneMD5 != nil {
		b.laneMD5.Close()
	}
}

// crc32cSummed counts body bytes the gateway itself summed with CRC32C
// for a flexible checksum (tests: a PUT written through the client sums
// none, its write path does).
var crc32cSummed atomic.Int64

// CRC32CSummedBytes is the number of request-body bytes the gateway has
// summed with CRC32C itself, for flexible checksums, since it started.
func CRC32CSummedBytes() int64 { return crc32cSummed.Load() }

type countedCRC32C struct{ hash.Hash }

func (c countedCRC32C) Write(p []byte) (int, error) {
	crc32cSummed.Add(int64(len(p)))
	return c.Hash.Write(p)
}

// newBody prepares the body of a write request authenticated by a.
// writeCRC says the caller writes the body with client.PutKey and hands
// its DataCRC32C to setWriteCRC: a CRC32C checksum is then not summed here.
func newBody(r *http.Request, a *auth, maxSize int64, writeCRC bool) (*body, *Error) {
	b := &body{md5: md5.New(), want: r.ContentLength, max: maxSize}
	b.sock.r = r.Body
	b.r = &b.sock
	switch a.payload {
	case streamingSigned, streamingSignedTrailer, streamingUnsignedTrailr:
		b.chunked = newChunkedReader(&b.sock, a, a.payload != streamingUnsignedTrailr, a.payload != streamingSigned)
		b.r = b.chunked
		b.want = -1
		if d := r.Header.Get("X-Amz-Decoded-Content-Length"); d != "" {
			n, err := strconv.ParseInt(d, 10, 64)
			if err != nil || n < 0 {
				return nil, errInvalidArgument("x-amz-decoded-content-length %q is not a length", d)
			}
			b.want = n
		} else if a.payload == streamingSigned {
			return nil, errorf("MissingContentLength", 411, "You must provide the Content-Length HTTP header (x-amz-decoded-content-length for aws-chunked).")
		}
	case unsignedPayload:
	default:
		b.sha256 = sha256.New()
		b.wantSHA256 = a.payload
	}
	if b.want > maxSize {
		return nil, errorf("EntityTooLarge", 400, "Your proposed upload of %d bytes exceeds the maximum allowed object size of %d", b.want, maxSize)
	}
	if v := r.Header.Get("Content-Md5"); v != "" {
		d, err := base64.StdEncoding.DecodeString(v)
		if err != nil || len(d) != md5.Size {
			return nil, errorf("InvalidDigest", 400, "The Content-MD5 you specified is not valid.")
		}
		b.contentMD5 = d
	}
	// A flexible checksum: in a header, or announced in x-amz-trailer.
	for alg, name := range checksumHeaders {
		if v := r.Header.Get(name); v != "" {
			b.ckAlg, b.ckWant = alg, v
			break
		}
	}
	if t := strings.ToLower(r.Header.Get("X-Amz-Trailer")); b.ckAlg == "" && strings.HasPrefix(t, "x-amz-checksum-") {
		alg := strings.TrimPrefix(t, "x-amz-checksum-")
		if _, ok := checksumAlgos[alg]; !ok || b.chunked == nil || !b.chunked.trailer {
			return nil, errInvalidRequest("The value specified in the x-amz-trailer header is not supported: %s", t)
		}
		b.ckAlg = alg
	}
	switch {
	case b.ckAlg == "":
	case b.ckAlg == "crc32c" && writeCRC:
		b.crcFromWrite = true
	case b.ckAlg == "crc32c":
		b.ck = countedCRC32C{checksumAlgos[b.ckAlg]()}
	default:
		b.ck = checksumAlgos[b.ckAlg]()
	}
	if b.want >= asyncHashMin {
		b.laneMD5 = newLaneMD5()
		b.md5 = b.laneMD5
		hs := []hash.Hash{b.md5}
		for _, h := range []hash.Hash{b.sha256, b.ck} {
			if h != nil {
				hs = append(hs, h)
			}
		}
		b.async = newHasher(hs, shallowHashBufs) // putData deepens it
		b.laneMD5.readWaits = &b.async.full
	}
	return b, nil
}

func (b *body) fail(e error) error {
	if b.laneMD5 != nil {
		b.laneMD5.done() // no longer read: not waited for at the lanes' gate
	}
	if b.err == nil {
		b.err = e
	}
	return b.err
}

func (b *body) Read(p []byte) (int, error) {
	if b.err != nil {
		return 0, b.err
	}
	if b.eof {
		return 0, io.EOF
	}
	n, err := b.r.Read(p)
	if b.async != nil {
		b.async.write(p[:n])
	} else {
		b.md5.Write(p[:n])
		if b.sha256 != nil {
			b.sha256.Write(p[:n])
		}
		if b.ck != nil {
			b.ck.Write(p[:n])
		}
	}
	b.n += int64(n)
	if b.n > b.max {
		return n, b.fail(errorf("EntityTooLarge", 400, "Your proposed upload exceeds the maximum allowed object size of %d", b.max))
	}
	if b.want >= 0 && b.n > b.want {
		return n, b.fail(errorf("IncompleteBody", 400, "The body is longer than the declared length %d", b.want))
	}
	if err == io.EOF && b.late && b.async != nil {
		// The digests finish beside the write path's close; settle checks
		// them before the commit. The length is known now.
		if b.want >= 0 && b.n != b.want {
			return n, b.fail(errShort(b.n, b.want))
		}
		b.laneMD5.done() // its last buffers go at once
		b.async.flush()
		b.eof = true
		b.eofAt = time.Now()
		return n, io.EOF
	}
	if err == io.EOF {
		if e := b.finish(); e != nil {
			return n, b.fail(e)
		}
		b.eof = true
		b.eofAt = time.Now()
		return n, io.EOF
	}
	if err != nil {
		var se *Error
		if !errors.As(err, &se) {
			// The client went away or stalled: the upload is abandoned.
			err = errorf("IncompleteBody", 400, "Reading the request body failed after %d bytes: %v", b.n, err)
		}
		return n, b.fail(err)
	}
	return n, nil
}

// finish runs the whole-body checks at EOF.
func (b *body) finish() *Error {
	if b.laneMD5 != nil {
		b.laneMD5.done() // its last buffers go at once
	}
	if b.async != nil {
		b.async.wait()
	}
	if b.laneMD5 != nil {
		b.laneMD5.Sum(nil) // the sum is kept; the lane is freed before the commit
	}
	if b.want >= 0 && b.n != b.want {
		return errShort(b.n, b.want)
	}
	if b.sha256 != nil && hex.EncodeToString(b.sha256.Sum(nil)) != strings.ToLower(b.wantSHA256) {
		return errorf("XAmzContentSHA256Mismatch", 400, "The provided 'x-amz-content-sha256' header does not match what was computed.")
	}
	if b.contentMD5 != nil && !bytes.Equal(b.contentMD5, b.md5.Sum(nil)) {
		return errorf("BadDigest", 400, "The Content-MD5 you specified did not match what we received.")
	}
	if b.ckAlg != "" {
		want := b.ckWant
		if want == "" && b.chunked != nil {
			want = b.chunked.trailers["x-amz-checksum-"+b.ckAlg]
		}
		if want == "" {
			return errInvalidRequest("The x-amz-checksum-%s trailer was declared but not sent", b.ckAlg)
		}
		b.ckWant = want
		if b.crcFromWrite {
			return nil // verifyWriteCRC, once the write path has it
		}
		if base64.StdEncoding.EncodeToString(b.ck.Sum(nil)) != want {
			return b.badChecksum()
		}
	}
	return nil
}

func errShort(n, want int64) *Error {
	return errorf("IncompleteBody", 400, "You did not provide the number of bytes specified by the Content-Length HTTP header (%d of %d)", n, want)
}

// settle runs the whole-body checks of a late body (see late) once its
// hashing is done; putData calls it before the commit, so a bad digest
// leaves the key uncommitted. A body that is not late was checked at EOF.
func (b *body) settle() error {
	if !b.late || b.async == nil || b.settled {
		return b.err
	}
	if b.err != nil {
		return b.err
	}
	if !b.eof {
		return b.fail(errorf("InternalError", 500, "The body was committed before its end."))
	}
	b.settled = true
	if e := b.finish(); e != nil {
		return b.fail(e)
	}
	return nil
}

func (b *body) badChecksum() *Error {
	return errorf("BadDigest", 400, "The %s you specified did not match the calculated checksum.", strings.ToUpper(b.ckAlg))
}

// setWriteCRC takes the body's CRC32C from the write path
// (client.PutOptions.DataCRC32C).
func (b *body) setWriteCRC(crc uint32) { b.writeCRC, b.writeCRCSet = crc, true }

// verifyWriteCRC checks a CRC32C checksum the write path reported against
// the one the client declared; called after EOF, before the commit. A
// mismatch fails the body (so bodyOr reports BadDigest) and the upload.
func (b *body) verifyWriteCRC() error {
	if !b.crcFromWrite {
		return nil
	}
	if !b.eof || !b.writeCRCSet {
		return b.fail(errorf("InternalError", 500, "The CRC32C of the body is not known before the commit."))
	}
	if b.crc32cValue() != b.ckWant {
		return b.fail(b.badChecksum())
	}
	return nil
}

func (b *body) crc32cValue() string {
	return base64.StdEncoding.EncodeToString(binary.BigEndian.AppendUint32(nil, b.writeCRC))
}

// etag is the hex MD5 of what was read.
func (b *body) etag() string { return hex.EncodeToString(b.md5.Sum(nil)) }

// checksum returns the verified flexible checksum (algorithm in upper
// case as S3 names it, base64 value), or "", "".
func (b *body) checksum() (string, string) {
	switch {
	case b.ckAlg == "":
		return "", ""
	case b.crcFromWrite:
		return strings.ToUpper(b.ckAlg), b.crc32cValue()
	}
	return strings.ToUpper(b.ckAlg), base64.StdEncoding.EncodeToString(b.ck.Sum(nil))
}
