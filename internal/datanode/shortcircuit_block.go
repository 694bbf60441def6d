package datanode

import (
	"errors"
	"os"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/storage"
)

// Short-circuit reads of any committed block (HDFS-style local reads): a
// client on this host asks the short-circuit socket (cache_shortcircuit.go;
// started whenever a volume uses the posix backend) for a block's file with
// block_file set and the block's read token. The token is checked as for
// ReadBlock; then the answer carries the block's committed BlockData (its
// chunk checksums, as ReadBlock's first message does) and a read-only
// descriptor of the block file (SCM_RIGHTS). The datanode reads nothing:
// the client preads the file and verifies every checksum window itself
// (client_verifies), and the scrubber verifies the data at rest. Blocks
// whose data is not a file of its own (zoned backend), blocks with
// uncommitted writes and UNHEALTHY containers get not_available, and the
// client reads them over gRPC.

// scBlockStats counts block-file requests on the socket.
type scBlockStats struct {
	served   atomic.Uint64 // descriptors passed
	denied   atomic.Uint64 // tokens refused
	notAvail atomic.Uint64 // answered not_available (or failed to open)
}

// shortCircuitAnswer answers one request on the socket: the block file
// when asked for it, else the cache file (shortCircuitOpen).
func (d *Datanode) shortCircuitAnswer(req *datanodepb.ShortCircuitRequest) (*datanodepb.ShortCircuitResponse, *os.File) {
	var resp *datanodepb.ShortCircuitResponse
	var f *os.File
	switch {
	case req.GetBlockFile():
		resp, f = d.shortCircuitBlock(req)
	case d.cache == nil || d.cache.dram:
		resp = &datanodepb.ShortCircuitResponse{Error: "no cache directory here", NotAvailable: true}
	default:
		resp, f = d.shortCircuitOpen(req)
	}
	resp.DatanodeId = d.ident.ID
	return resp, f
}

func (d *Datanode) shortCircuitBlock(req *datanodepb.ShortCircuitRequest) (*datanodepb.ShortCircuitResponse, *os.File) {
	st := &d.sc.blk
	cid, lid := req.GetBlock().GetContainerId(), req.GetBlock().GetLocalId()
	if err := d.verifyToken(req.Token, cid, lid, blocktoken.Read); err != nil {
		st.denied.Add(1)
		kind := datanodepb.Error_TOKEN_INVALID
		if errors.Is(err, blocktoken.ErrExpired) {
			kind = datanodepb.Error_TOKEN_EXPIRED
		}
		return &datanodepb.ShortCircuitResponse{Error: err.Error(), TokenRefused: kind}, nil
	}
	f, bd, err := d.store.OpenBlockFile(storage.ContainerID(cid), storage.LocalID(lid))
	if err != nil {
		st.notAvail.Add(1)
		if !errors.Is(err, storage.ErrNoBlockFile) {
			d.log.Debug("short-circuit: block file not passed", "container", cid, "block", lid, "err", err)
		}
		return &datanodepb.ShortCircuitResponse{Error: err.Error(), NotAvailable: true}, nil
	}
	st.served.Add(1)
	return &datanodepb.ShortCircuitResponse{Block: fromBlockData(storage.ContainerID(cid), bd)}, f
}

// ShortCircuitBlockStats returns the block-file counters of the
// short-circuit socket: descriptors passed, tokens refused, answered
// not available (all 0 without a socket).
func (d *Datanode) ShortCircuitBlockStats() (served, denied, notAvailable uint64) {
	if d.sc == nil {
		return 0, 0, 0
	}
	return d.sc.blk.served.Load(), d.sc.blk.denied.Load(), d.sc.blk.notAvail.Load()
}

// shortCircuitCollectors are the socket's metrics.
func (d *Datanode) shortCircuitCollectors() []prometheus.Collector {
	counter := func(name, help string, f func() uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "basalt", Subsystem: "datanode_short_circuit", Name: name, Help: help},
			func() float64 { return float64(f()) })
	}
	st := &d.sc.blk
	return []prometheus.Collector{
		counter("block_files_served_total", "Block file descriptors passed to local readers.", st.served.Load),
		counter("block_files_denied_total", "Block file requests whose read token was refused.", st.denied.Load),
		counter("block_files_not_available_total", "Block file requests answered not available (read over gRPC).", st.notAvail.Load),
		counter("cache_files_served_total", "Cache file descriptors passed to local readers.", d.sc.served.Load),
	}
}

func (d *Datanode) registerShortCircuitMetrics() {
	if d.cfg.Registerer == nil {
		return
	}
	d.sc.collectors = d.shortCircuitCollectors()
	for _, c := range d.sc.collectors {
		d.cfg.Registerer.Register(c)
	}
}

func (d *Datanode) unregisterShortCircuitMetrics() {
	if d.cfg.Registerer == nil {
		return
	}
	for _, c := range d.sc.collectors {
		d.cfg.Registerer.Unregister(c)
	}
}
