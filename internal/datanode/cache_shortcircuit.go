package datanode

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/storage"
)

// Short-circuit reads of cached blocks (docs/CACHE.md): a client on this
// host connects to the datanode's Unix socket (mode 0660, under its data
// directory), names a block and presents its read token; if the token is
// valid and the block is cached in a cache directory, the datanode
// answers with the block's chunk checksums and passes an open read-only
// descriptor of the cache file (SCM_RIGHTS). The client maps the file
// itself: no TLS, no gRPC, no copy through the datanode. A DRAM cache has
// no file to pass; its blocks are read over gRPC.

const maxShortCircuitMsg = 64 << 10

type shortCircuit struct {
	lis    *net.UnixListener
	served atomic.Uint64
	denied atomic.Uint64
	// blk: requests for block files (shortcircuit_block.go).
	blk        scBlockStats
	collectors []prometheus.Collector
}

func (d *Datanode) startShortCircuit() error {
	// The socket serves cache files and, on the posix backend, block
	// files (shortcircuit_block.go); the default path is set in New.
	path := d.cfg.ShortCircuitSocket
	if path == "" || path == "-" {
		return nil
	}
	os.Remove(path) // a socket left by a previous run
	lis, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return fmt.Errorf("datanode: short-circuit socket %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o660); err != nil {
		lis.Close()
		return err
	}
	d.sc = &shortCircuit{lis: lis}
	d.registerShortCircuitMetrics()
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		for {
			c, err := lis.AcceptUnix()
			if err != nil {
				return
			}
			go d.serveShortCircuit(c)
		}
	}()
	return nil
}

func (d *Datanode) stopShortCircuit() {
	if d.sc != nil {
		d.sc.lis.Close()
		os.Remove(d.cfg.ShortCircuitSocket)
		d.unregisterShortCircuitMetrics()
	}
}

// ShortCircuitServed counts descriptors handed to local readers.
func (d *Datanode) ShortCircuitServed() uint64 {
	if d.sc == nil {
		return 0
	}
	return d.sc.served.Load()
}

func readFrame(r io.Reader, m proto.Message) error {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > maxShortCircuitMsg {
		return fmt.Errorf("message of %d bytes, at most %d", n, maxShortCircuitMsg)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return err
	}
	return proto.Unmarshal(b, m)
}

func frame(m proto.Message) []byte {
	b, _ := proto.Marshal(m)
	out := make([]byte, 4, 4+len(b))
	binary.BigEndian.PutUint32(out, uint32(len(b)))
	return append(out, b...)
}

// serveShortCircuit answers requests on one connection until it closes
// (a client may ask for several blocks on one connection).
func (d *Datanode) serveShortCircuit(c *net.UnixConn) {
	defer c.Close()
	defer func() {
		if p := recover(); p != nil {
			d.log.Error("short-circuit request panicked; connection closed", "panic", p)
		}
	}()
	for {
		c.SetDeadline(time.Now().Add(time.Minute))
		req := &datanodepb.ShortCircuitRequest{}
		if err := readFrame(c, req); err != nil {
			return
		}
		resp, f := d.shortCircuitAnswer(req)
		var oob []byte
		if f != nil {
			oob = unix.UnixRights(int(f.Fd()))
		}
		msg := frame(resp)
		n, _, err := c.WriteMsgUnix(msg, oob, nil)
		if err == nil && n < len(msg) {
			_, err = c.Write(msg[n:]) // a large answer (many chunk checksums)
		}
		if f != nil {
			f.Close()
		}
		if err != nil {
			return
		}
	}
}

func (d *Datanode) shortCircuitOpen(req *datanodepb.ShortCircuitRequest) (*datanodepb.ShortCircuitResponse, *os.File) {
	cid, lid := req.GetBlock().GetContainerId(), req.GetBlock().GetLocalId()
	if err := d.verifyToken(req.Token, cid, lid, blocktoken.Read); err != nil {
		d.sc.denied.Add(1)
		return &datanodepb.ShortCircuitResponse{Error: err.Error()}, nil
	}
	e := d.cache.get(cid, lid)
	if e == nil {
		return &datanodepb.ShortCircuitResponse{Error: errNotCached.Error()}, nil
	}
	defer e.mu.RUnlock()
	if !e.verified.Load() || e.dir < 0 || e.bd.Length == 0 {
		return &datanodepb.ShortCircuitResponse{Error: "block not verified yet, in DRAM, or empty: read it over gRPC"}, nil
	}
	f, err := os.Open(d.cache.blockPath(e.dir, e.key) + ".blk")
	if err != nil {
		return &datanodepb.ShortCircuitResponse{Error: err.Error()}, nil
	}
	d.sc.served.Add(1)
	d.cache.hits.Add(1)
	d.cache.hitBytes.Add(uint64(e.bd.Length))
	return &datanodepb.ShortCircuitResponse{Block: fromBlockData(storage.ContainerID(cid), e.bd)}, f
}

var errNotCached = errors.New("block not cached here")
