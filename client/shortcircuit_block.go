package client

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Short-circuit reads of any committed block (HDFS-style local reads):
// when a replica's datanode advertises a Unix socket that exists on this
// host (the same test as for cached blocks, shortcircuit.go), the reader
// asks it for the block's file with the block's read token and receives
// the block's chunk checksums and a read-only descriptor. It then preads
// the file itself and verifies every checksum window it returns
// (verifyRange, as for gRPC reads with client_verifies): no TLS, no gRPC,
// no datanode thread. A window that fails its checksum is a corrupt
// replica (reported as for gRPC reads; the next replica is read); any
// other failure, and a datanode that cannot pass the file (not_available),
// falls back to gRPC on the same replica. Descriptors and mappings come
// from the client-wide cache (shortcircuit_cache.go); a reader holds a
// reference on each block's file it uses (at most maxSCBlockFiles) until
// Close or until the token it got the file with expires (scHeld).

const (
	maxSCBlockFiles = 64
	maxSCAnswer     = 16 << 20 // bounds a datanode's answer
)

// errNoLocal: the short-circuit read did not serve the range; read it over
// gRPC.
var errNoLocal = errors.New("no short-circuit read")

// scBlockFile is one block's file from one replica; f nil: not available
// from it (read over gRPC). m maps its committed bytes (nil: not mapped,
// read with pread; shortcircuit_map.go). refs counts the table's
// reference and the reads using it; the last release closes and unmaps.
type scBlockFile struct {
	f    *os.File
	m    []byte
	bd   *datanodepb.BlockData
	refs atomic.Int64
	// populated: a bit per popUnit of m whose page tables were filled
	// (shortcircuit_map.go, verify).
	populated []atomic.Uint64
	seekMu    sync.Mutex // f's offset (FileSender)
}

// scBlocks are a reader's block files.
type scBlocks struct {
	mu    sync.Mutex
	files map[scKey]scHeld
	// fresh: the files this reader fetched from the datanode itself (not
	// found in the client's cache).
	fresh  map[scKey]bool
	closed bool
}

// scHeld is a reader's block file and when the token it got the file with
// expires (Unix ms; 0: could not be decoded, so every access asks again).
// A file is used only before exp, by the client's coarse clock (scClock);
// after it the entry is dropped and the reader's current token goes
// through fetchShared again (the client's check, then the datanode's), as
// gRPC checks every ReadBlock. Not-available entries (bf.f nil) read over
// gRPC, which checks the token, and ignore exp.
type scHeld struct {
	bf  *scBlockFile
	exp int64
}

// scBlockCounters are the client's short-circuit block-file counters.
type scBlockCounters struct {
	reads, bytes, fallbacks, opened, mapped, sent, copied atomic.Uint64
}

// ShortCircuitStats count a client's short-circuit reads of block files.
type ShortCircuitStats struct {
	Reads     uint64 // ranges served from a local block file
	Bytes     uint64 // bytes served so
	Fallbacks uint64 // ranges a local file did not serve (not available, I/O error, checksum mismatch): read over gRPC
	Opened    uint64 // block file descriptors received
	// Of Bytes, those WriteRange passed on from a mapped block file
	// without copying them in user space (the writer got the mapping, or
	// a FileSender sent them), and of those the ones sent (sendfile).
	Mapped, Sent uint64
	// Of Bytes, those WriteRange copied out of a mapped block file into a
	// buffer before writing them (the writer is not a SyncWriter).
	Copied uint64
}

// ShortCircuitBlockStats returns the client's short-circuit block-file
// counters.
func (c *Client) ShortCircuitBlockStats() ShortCircuitStats {
	b := &c.sc.blk
	return ShortCircuitStats{Reads: b.reads.Load(), Bytes: b.bytes.Load(), Fallbacks: b.fallbacks.Load(), Opened: b.opened.Load(),
		Mapped: b.mapped.Load(), Sent: b.sent.Load(), Copied: b.copied.Load()}
}

// readLocal fills dst from block bi at off by reading d's block file, if d
// runs on this host and passes it. errNoLocal: read over gRPC; a
// *corruptError: d's copy fails its checksums.
func (r *KeyReader) readLocal(bi int, l *metapb.BlockLocation, d *metapb.DatanodeDetails, tok []byte, off int64, dst []byte) error {
	c := r.c
	if c.cfg.NoShortCircuit || d.ShortCircuitSocket == "" || len(dst) == 0 {
		return errNoLocal
	}
	k := scKey{d.Id, l.Id.GetContainerId(), l.Id.GetLocalId()}
	bf, err := r.scb.file(k, d, l, tok, &c.sc)
	if err != nil {
		// The token refused: as gRPC would refuse it (an expired one is
		// refreshed by the caller and the replica asked again).
		return err
	}
	if bf == nil || bf.f == nil || !bf.acquire() {
		return errNoLocal
	}
	defer bf.release()
	r.mu.Lock()
	if r.layout[bi] == nil {
		r.layout[bi] = bf.bd
	}
	r.mu.Unlock()
	end := off + int64(len(dst))
	rs, re := alignRange(bf.bd, int64(r.raw.BytesPerChecksum), int64(l.Length), off, end)
	mapped := bf.m != nil && re <= int64(len(bf.m))
	data := dst
	if !mapped && (rs != off || re != end) {
		data = make([]byte, re-rs)
	}
	if mapped {
		// Checked on the mapping, then one copy of just the range wanted
		// (as pread's copy; no buffer for the whole windows).
		if err = bf.verify(rs, re, off, end); err == nil {
			err = copyMapped(dst, bf.m, off)
		}
	} else {
		var n int
		if n, err = bf.f.ReadAt(data, rs); err == io.EOF && n == len(data) {
			err = nil
		} else if err != nil {
			err = fmt.Errorf("short-circuit read of %s at %d: %d of %d bytes: %w", bf.f.Name(), rs, n, len(data), err)
		}
		if err == nil {
			err = verifyRange(bf.bd, rs, data, off, end)
		}
	}
	if err != nil {
		c.sc.blk.fallbacks.Add(1)
		fresh := r.scb.drop(k, bf)
		c.sc.cache.invalidate(k, bf)
		var ce *corruptError
		if errors.As(err, &ce) && fresh {
			ce.msg += " (short-circuit read of the local block file)"
			return err
		}
		c.log.Debug("short-circuit read failed; reading over gRPC", "datanode", d.Id, "err", err)
		return errNoLocal
	}
	if !mapped && &data[0] != &dst[0] {
		copy(dst, data[off-rs:])
	}
	c.sc.blk.reads.Add(1)
	c.sc.blk.bytes.Add(uint64(len(dst)))
	return nil
}

// file returns block k's file from datanode d, asking d's socket the first
// time. nil: not now (socket failed, reader closed); a file with f nil:
// never from d for this reader; an error: the token was refused (a gRPC
// status, as ReadBlock's).
func (s *scBlocks) file(k scKey, d *metapb.DatanodeDetails, l *metapb.BlockLocation, tok []byte, sc *shortCircuits) (*scBlockFile, error) {
	now := sc.nowMs()
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, nil
	}
	if h := s.files[k]; h.bf != nil {
		if h.bf.f == nil || now < h.exp {
			s.mu.Unlock()
			return h.bf, nil
		}
		// The token this reader got the file with has expired: check
		// its current one again (refused: TOKEN_EXPIRED, and the caller
		// refreshes; the refresh's lookup checks the user's access).
		s.removeLocked(k, h.bf)
	}
	s.mu.Unlock()
	bf, fresh, exp := &scBlockFile{}, false, int64(0)
	if _, err := os.Stat(d.ShortCircuitSocket); err == nil { // else: not this host
		got, fr, notAvail, err := sc.fetchShared(k, d, l, tok)
		var te *scTokenError
		switch {
		case err == nil:
			bf, fresh = got, fr
			// The client's check or the datanode's passed tok.
			if c, derr := blocktoken.Decode(tok); derr == nil {
				exp = c.ExpiryUnixMs
			}
		case errors.As(err, &te):
			st, serr := status.New(codes.PermissionDenied, te.msg).WithDetails(&datanodepb.Error{Kind: te.kind})
			if serr != nil {
				return nil, status.Error(codes.PermissionDenied, te.msg)
			}
			return nil, st.Err()
		case !notAvail:
			sc.blk.fallbacks.Add(1)
			return nil, nil
		default:
			sc.blk.fallbacks.Add(1)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if old := s.files[k].bf; old != nil || s.closed {
		if bf.f != nil {
			bf.release()
		}
		return old, nil
	}
	if s.files == nil {
		s.files, s.fresh = map[scKey]scHeld{}, map[scKey]bool{}
	}
	if len(s.files) >= maxSCBlockFiles {
		for ok, o := range s.files {
			s.removeLocked(ok, o.bf)
			break
		}
	}
	s.files[k] = scHeld{bf, exp}
	if fresh {
		s.fresh[k] = true
	}
	return bf, nil
}

// removeLocked forgets k's entry bf and drops the table's reference on it
// (closed when reads in flight are done); s.mu held.
func (s *scBlocks) removeLocked(k scKey, bf *scBlockFile) {
	delete(s.files, k)
	delete(s.fresh, k)
	if bf.f != nil {
		bf.release()
	}
}

// scClock is a coarse clock for the expiry of a reader's held block files
// (scHeld.exp): a read of a held file loads an atomic instead of calling
// time.Now (about 85 ns on the test VM) per read. A timer stores the time
// every scClockTick while reads use the clock and stops after a tick
// without one (ms 0: stopped; the next read restarts it with time.Now).
// It lags the real clock by at most a tick plus the timer's delay: a held
// file serves at most that long past its token's expiry.
type scClock struct {
	ms   atomic.Int64
	used atomic.Bool
	mu   sync.Mutex
	t    *time.Timer
}

const scClockTick = 50 * time.Millisecond

func (c *scClock) nowMs() int64 {
	if !c.used.Load() {
		c.used.Store(true)
	}
	if ms := c.ms.Load(); ms != 0 {
		return ms
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	ms := time.Now().UnixMilli()
	c.ms.Store(ms)
	if c.t == nil {
		c.t = time.AfterFunc(scClockTick, c.tick)
	}
	return ms
}

func (c *scClock) tick() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.used.Swap(false) {
		c.ms.Store(0)
		c.t = nil
		return
	}
	c.ms.Store(time.Now().UnixMilli())
	c.t.Reset(scClockTick)
}

// nowMs is the time for the held files' expiry: the coarse clock, or the
// cache's test clock when a test set one (before any reads).
func (sc *shortCircuits) nowMs() int64 {
	if sc.cache.now != nil {
		return sc.cache.now().UnixMilli()
	}
	return sc.clk.nowMs()
}

// scTokenError: the datanode refused the block token on its socket.
type scTokenError struct {
	msg  string
	kind datanodepb.Error_Kind
}

func (e *scTokenError) Error() string { return e.msg }

// drop forgets bf (it failed a read): the block is read over gRPC from
// then on (a not-available entry stays in its place). fresh: this reader
// fetched bf from the datanode itself.
func (s *scBlocks) drop(k scKey, bf *scBlockFile) (fresh bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	fresh = s.fresh[k]
	delete(s.fresh, k)
	if s.files[k].bf == bf {
		s.files[k] = scHeld{bf: &scBlockFile{}}
		if bf.f != nil {
			bf.release() // the table's reference
		}
	}
	return fresh
}

func (s *scBlocks) close() {
	s.mu.Lock()
	files := s.files
	s.files, s.closed = nil, true
	s.mu.Unlock()
	for _, h := range files {
		if h.bf.f != nil {
			h.bf.release()
		}
	}
}

// fetchBlockFile asks datanode dn's socket for a block's file. notAvail:
// the datanode cannot pass it (or is another datanode than dn); read it
// over gRPC.
func fetchBlockFile(sock string, dn uint64, id *metapb.BlockID, tok []byte) (f *os.File, bd *datanodepb.BlockData, notAvail bool, err error) {
	conn, err := net.DialTimeout("unix", sock, 2*time.Second)
	if err != nil {
		return nil, nil, true, err
	}
	uc := conn.(*net.UnixConn)
	defer uc.Close()
	uc.SetDeadline(time.Now().Add(5 * time.Second))
	b, _ := proto.Marshal(&datanodepb.ShortCircuitRequest{Block: &datanodepb.BlockID{ContainerId: id.GetContainerId(), LocalId: id.GetLocalId()}, Token: tok, BlockFile: true})
	if _, err := uc.Write(append(binary.BigEndian.AppendUint32(nil, uint32(len(b))), b...)); err != nil {
		return nil, nil, false, err
	}
	buf := make([]byte, 64<<10)
	oob := make([]byte, unix.CmsgSpace(4*4))
	n, oobn, _, _, err := uc.ReadMsgUnix(buf, oob)
	fd := -1
	if oobn > 0 {
		if cms, perr := unix.ParseSocketControlMessage(oob[:oobn]); perr == nil {
			for i := range cms {
				fds, perr := unix.ParseUnixRights(&cms[i])
				if perr != nil {
					continue
				}
				for _, x := range fds {
					if fd < 0 {
						fd = x
					} else {
						unix.Close(x)
					}
				}
			}
		}
	}
	if fd >= 0 {
		f = os.NewFile(uintptr(fd), fmt.Sprintf("block %d/%d of datanode %d", id.GetContainerId(), id.GetLocalId(), dn))
		defer func() {
			if err != nil {
				f.Close()
				f = nil
			}
		}()
	}
	if err != nil {
		return nil, nil, false, err
	}
	if n < 4 {
		return nil, nil, false, io.ErrUnexpectedEOF
	}
	ln := int(binary.BigEndian.Uint32(buf[:4]))
	if ln > maxSCAnswer {
		return nil, nil, false, fmt.Errorf("short-circuit answer of %d bytes, at most %d", ln, maxSCAnswer)
	}
	msg := buf[4:n]
	if ln > len(msg) {
		msg = append(make([]byte, 0, ln), msg...)
		if _, err := io.ReadFull(uc, msg[len(msg):ln]); err != nil {
			return nil, nil, false, err
		}
		msg = msg[:ln]
	} else if ln < len(msg) {
		return nil, nil, false, fmt.Errorf("short-circuit answer of %d bytes followed by %d more", ln, len(msg)-ln)
	}
	resp := &datanodepb.ShortCircuitResponse{}
	if err := proto.Unmarshal(msg, resp); err != nil {
		return nil, nil, false, err
	}
	if resp.DatanodeId != dn {
		return nil, nil, true, fmt.Errorf("socket %s is datanode %d's, not %d's", sock, resp.DatanodeId, dn)
	}
	if resp.TokenRefused != datanodepb.Error_UNKNOWN {
		return nil, nil, false, &scTokenError{msg: resp.Error, kind: resp.TokenRefused}
	}
	if resp.Error != "" {
		return nil, nil, resp.NotAvailable, errors.New(resp.Error)
	}
	if f == nil {
		return nil, nil, false, errors.New("no descriptor passed")
	}
	bd = resp.GetBlock()
	if bd == nil || bd.GetId().GetContainerId() != id.GetContainerId() || bd.GetId().GetLocalId() != id.GetLocalId() {
		return nil, nil, false, fmt.Errorf("answer describes block %d/%d", bd.GetId().GetContainerId(), bd.GetId().GetLocalId())
	}
	st, err := f.Stat()
	if err != nil {
		return nil, nil, false, err
	}
	if st.Size() < int64(bd.Length) {
		return nil, nil, false, fmt.Errorf("block file is %d bytes, the block %d", st.Size(), bd.Length)
	}
	return f, bd, false, nil
}

// FetchBlockFileForTest asks datanode dn's short-circuit socket for a
// block's file with token tok and closes the descriptor it gets (tests).
func FetchBlockFileForTest(sock string, dn, container, local uint64, tok []byte) error {
	f, _, _, err := fetchBlockFile(sock, dn, &metapb.BlockID{ContainerId: container, LocalId: local}, tok)
	if err != nil {
		return err
	}
	return f.Close()
}
