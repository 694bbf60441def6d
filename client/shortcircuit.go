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
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Short-circuit reads (docs/CACHE.md): when a replica holding the block in
// its cache tier advertises a Unix socket that exists on this host, the
// client asks it for the cache file (presenting the block's read token),
// receives an open descriptor, maps the file and copies from the mapping:
// no TLS, no gRPC, no datanode thread. The datanode verified every
// checksum when it cached the block (as HDFS skips checksums for cached
// blocks). Mappings are kept (at most maxSCMaps) and unmapped on Close;
// a later reader uses one only if its token passes the client's check (as
// for the block-file cache, shortcircuit_cache.go "Tokens:"), else asks
// the datanode again. Any failure falls back to the ordinary read.

const maxSCMaps = 256

type scMap struct {
	mu   sync.RWMutex
	data []byte // nil once unmapped
}

type scKey struct {
	dn, c, l uint64
}

type shortCircuits struct {
	mu    sync.Mutex
	maps  map[scKey]*scMap
	reads atomic.Uint64
	blk   scBlockCounters // block files (shortcircuit_block.go)
	cache scCache         // the client's block files (shortcircuit_cache.go)
	clk   scClock         // coarse clock for readers' held files (shortcircuit_block.go)
}

// ShortCircuitReads counts reads this client served by mapping a cached
// block file of a datanode on its host.
func (c *Client) ShortCircuitReads() uint64 { return c.sc.reads.Load() }

// shortCircuit reads dst at off of block l from d's cache file, if d
// caches it and runs on this host. It reports whether it did.
func (c *Client) shortCircuit(l *metapb.BlockLocation, d *metapb.DatanodeDetails, tok []byte, off int64, dst []byte) bool {
	if c.cfg.NoShortCircuit || d.ShortCircuitSocket == "" {
		return false
	}
	cached := false
	for _, id := range l.CachedDatanodes {
		cached = cached || id == d.Id
	}
	if !cached {
		return false
	}
	k := scKey{d.Id, l.Id.GetContainerId(), l.Id.GetLocalId()}
	m, err := c.scMapping(k, d.ShortCircuitSocket, l.Id, tok)
	if err != nil {
		c.log.Debug("short-circuit read not possible; reading over gRPC", "datanode", d.Id, "err", err)
		return false
	}
	m.mu.RLock()
	defer m.mu.RUnlock()
	if m.data == nil || off < 0 || off+int64(len(dst)) > int64(len(m.data)) {
		return false
	}
	if err := copyMapped(dst, m.data, off); err != nil {
		// The cache file shrank or failed to page in (SIGBUS, turned
		// into an error: shortcircuit_map.go): read over gRPC.
		c.log.Debug("short-circuit read of a cache file failed; reading over gRPC", "datanode", d.Id, "err", err)
		return false
	}
	c.sc.reads.Add(1)
	return true
}

func (c *Client) scMapping(k scKey, sock string, id *metapb.BlockID, tok []byte) (*scMap, error) {
	// A mapping another reader got serves this one only if its token
	// passes the client's check (tokenAllows, shortcircuit_cache.go);
	// otherwise the datanode checks it, as for the first reader. Checked
	// before the client-wide lock (it runs on every read call).
	allowed := tokenAllows(tok, k, time.Now())
	c.sc.mu.Lock()
	if c.sc.maps == nil {
		c.sc.maps = map[scKey]*scMap{}
	}
	if m := c.sc.maps[k]; m != nil && allowed {
		c.sc.mu.Unlock()
		return m, nil
	}
	c.sc.mu.Unlock()
	if _, err := os.Stat(sock); err != nil {
		return nil, err // not this host
	}
	data, err := fetchCacheFile(sock, id, tok)
	if err != nil {
		return nil, err
	}
	m := &scMap{data: data}
	c.sc.mu.Lock()
	defer c.sc.mu.Unlock()
	if old := c.sc.maps[k]; old != nil {
		unix.Munmap(data)
		return old, nil
	}
	if len(c.sc.maps) >= maxSCMaps {
		for ok, om := range c.sc.maps {
			delete(c.sc.maps, ok)
			go om.unmap() // waits for its readers
			break
		}
	}
	c.sc.maps[k] = m
	return m, nil
}

func (m *scMap) unmap() {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.data != nil {
		unix.Munmap(m.data)
		m.data = nil
	}
}

func (s *shortCircuits) close() {
	s.cache.close()
	s.mu.Lock()
	maps := s.maps
	s.maps = nil
	s.mu.Unlock()
	for _, m := range maps {
		m.unmap()
	}
}

// fetchCacheFile asks the datanode's socket for a block's cache file and
// maps the descriptor it passes.
func fetchCacheFile(sock string, id *metapb.BlockID, tok []byte) ([]byte, error) {
	conn, err := net.DialTimeout("unix", sock, 2*time.Second)
	if err != nil {
		return nil, err
	}
	uc := conn.(*net.UnixConn)
	defer uc.Close()
	uc.SetDeadline(time.Now().Add(5 * time.Second))
	b, _ := proto.Marshal(&datanodepb.ShortCircuitRequest{Block: &datanodepb.BlockID{ContainerId: id.GetContainerId(), LocalId: id.GetLocalId()}, Token: tok})
	msg := binary.BigEndian.AppendUint32(nil, uint32(len(b)))
	if _, err := uc.Write(append(msg, b...)); err != nil {
		return nil, err
	}
	buf := make([]byte, 64<<10)
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := uc.ReadMsgUnix(buf, oob)
	if err != nil {
		return nil, err
	}
	fd := -1
	if oobn > 0 {
		cms, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err == nil && len(cms) > 0 {
			if fds, err := unix.ParseUnixRights(&cms[0]); err == nil && len(fds) > 0 {
				fd = fds[0]
				for _, extra := range fds[1:] {
					unix.Close(extra)
				}
			}
		}
	}
	if fd >= 0 {
		defer unix.Close(fd)
	}
	if n < 4 {
		return nil, io.ErrUnexpectedEOF
	}
	ln := int(binary.BigEndian.Uint32(buf[:4]))
	if ln > n-4 {
		return nil, fmt.Errorf("short-circuit answer of %d bytes, got %d", ln, n-4)
	}
	resp := &datanodepb.ShortCircuitResponse{}
	if err := proto.Unmarshal(buf[4:4+ln], resp); err != nil {
		return nil, err
	}
	if resp.Error != "" {
		return nil, errors.New(resp.Error)
	}
	if fd < 0 {
		return nil, errors.New("no descriptor passed")
	}
	length := int64(resp.GetBlock().GetLength())
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, err
	}
	if st.Size != length || length == 0 {
		return nil, fmt.Errorf("cache file is %d bytes, the block %d", st.Size, length)
	}
	return unix.Mmap(fd, 0, int(length), unix.PROT_READ, unix.MAP_SHARED)
}

// FetchCacheFileForTest asks a datanode's short-circuit socket for a
// block's cache file with token tok, maps and unmaps it (tests).
func FetchCacheFileForTest(sock string, container, local uint64, tok []byte) error {
	data, err := fetchCacheFile(sock, &metapb.BlockID{ContainerId: container, LocalId: local}, tok)
	if err != nil {
		return err
	}
	return unix.Munmap(data)
}
