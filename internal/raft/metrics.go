package raft

import (
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are per host (constant label raft_host) and, where cheap, per
// group (label group) or per peer (label peer).
type metrics struct {
	reg        prometheus.Registerer
	collectors []prometheus.Collector

	groups              prometheus.Gauge
	proposals           *prometheus.CounterVec
	applied             *prometheus.CounterVec
	commitLatency       prometheus.Histogram
	batchGroups         prometheus.Histogram
	batchEntries        prometheus.Histogram
	batches             prometheus.Counter
	syncedBatches       prometheus.Counter
	entries             prometheus.Counter
	syncSeconds         prometheus.Histogram
	loopSeconds         prometheus.Histogram
	loopQueueSeconds    prometheus.Histogram
	dataWriteSeconds    prometheus.Histogram
	applySeconds        prometheus.Histogram
	peerBytesSent       *prometheus.CounterVec
	peerMsgsSent        *prometheus.CounterVec
	peerBytesRecv       *prometheus.CounterVec
	peerMsgsRecv        *prometheus.CounterVec
	peerDropped         *prometheus.CounterVec
	heartbeatsCoalesced prometheus.Counter
	snapshotsSent       prometheus.Counter
	snapshotsReceived   prometheus.Counter
	dataReads           prometheus.Counter
	droppedUnknownGroup prometheus.Counter
	droppedInbox        prometheus.Counter
	droppedSends        prometheus.Counter
	groupFailures       prometheus.Counter
	logDirFailures      prometheus.Counter
	applyHeldBack       prometheus.Counter
	badFrames           prometheus.Counter
	readerPanics        prometheus.Counter
	stepPanics          prometheus.Counter
	rawPanics           prometheus.Counter
	connsRefused        *prometheus.CounterVec
	forgedMessages      prometheus.Counter

	mu sync.Mutex
}

func newMetrics(host uint64, reg prometheus.Registerer) *metrics {
	cl := prometheus.Labels{"raft_host": fmt.Sprint(host)}
	m := &metrics{reg: reg}
	counter := func(name, help string) prometheus.Counter {
		c := prometheus.NewCounter(prometheus.CounterOpts{Namespace: "basalt", Subsystem: "raft", Name: name, Help: help, ConstLabels: cl})
		m.collectors = append(m.collectors, c)
		return c
	}
	counterVec := func(name, help, label string) *prometheus.CounterVec {
		c := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: "basalt", Subsystem: "raft", Name: name, Help: help, ConstLabels: cl}, []string{label})
		m.collectors = append(m.collectors, c)
		return c
	}
	hist := func(name, help string, buckets []float64) prometheus.Histogram {
		h := prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: "basalt", Subsystem: "raft", Name: name, Help: help, ConstLabels: cl, Buckets: buckets})
		m.collectors = append(m.collectors, h)
		return h
	}
	m.groups = prometheus.NewGauge(prometheus.GaugeOpts{Namespace: "basalt", Subsystem: "raft", Name: "groups", Help: "Groups hosted.", ConstLabels: cl})
	m.collectors = append(m.collectors, m.groups)
	m.proposals = counterVec("proposals_total", "Proposals accepted by the leader, per group.", "group")
	m.applied = counterVec("applied_entries_total", "Entries applied to the state machine, per group.", "group")
	m.commitLatency = hist("commit_latency_seconds", "Time from Propose to applied on the proposing host.", prometheus.ExponentialBuckets(0.0001, 2, 18))
	m.batchGroups = hist("batch_groups", "Groups whose Ready went into one log-store batch.", prometheus.ExponentialBuckets(1, 2, 11))
	m.batchEntries = hist("batch_entries", "Entries written in one log-store batch (one fsync when synced).", prometheus.ExponentialBuckets(1, 2, 14))
	m.batches = counter("batches_total", "Log-store batches committed.")
	m.syncedBatches = counter("fsyncs_total", "Log-store batches committed with fsync.")
	m.entries = counter("entries_written_total", "Entries written to log stores.")
	m.syncSeconds = hist("batch_commit_seconds", "Time to commit (and fsync) one log-store batch.", prometheus.ExponentialBuckets(0.00005, 2, 18))
	m.loopSeconds = hist("loop_iteration_seconds", "Time of one store-loop iteration (WriteData, persist, send).", prometheus.ExponentialBuckets(0.00005, 2, 18))
	m.loopQueueSeconds = hist("loop_queue_seconds", "Time from a store loop being woken (its first pending group) to the iteration that takes the work.", prometheus.ExponentialBuckets(0.00001, 2, 20))
	m.dataWriteSeconds = hist("data_write_seconds", "Time of one group's WriteData calls and SyncData for one Ready (before the log batch).", prometheus.ExponentialBuckets(0.00001, 2, 20))
	m.applySeconds = hist("apply_seconds", "Time of one StateMachine.Apply call (a run of committed entries).", prometheus.ExponentialBuckets(0.00001, 2, 20))
	m.peerBytesSent = counterVec("peer_sent_bytes_total", "Bytes sent to a peer host.", "peer")
	m.peerMsgsSent = counterVec("peer_sent_messages_total", "Messages sent to a peer host.", "peer")
	m.peerBytesRecv = counterVec("peer_received_bytes_total", "Bytes received from a peer host.", "peer")
	m.peerMsgsRecv = counterVec("peer_received_messages_total", "Messages received from a peer host.", "peer")
	m.peerDropped = counterVec("peer_dropped_messages_total", "Messages dropped because the queue to a peer was full or it was unreachable.", "peer")
	m.heartbeatsCoalesced = counter("heartbeats_coalesced_total", "Heartbeats sent in compact, coalesced form.")
	m.snapshotsSent = counter("snapshots_sent_total", "Snapshots streamed to followers.")
	m.snapshotsReceived = counter("snapshots_received_total", "Snapshots restored from the leader.")
	m.dataReads = counter("data_reads_total", "ReadData calls to resend an entry's data (cache misses).")
	m.droppedUnknownGroup = counter("dropped_unknown_group_total", "Messages for groups not hosted here.")
	m.droppedInbox = counter("dropped_inbox_total", "Inbound messages dropped because a group's inbox was full.")
	m.droppedSends = counter("dropped_hydrate_queue_total", "Outbound MsgApps dropped because a group's hydration queue was full.")
	m.groupFailures = counter("group_failures_total", "Groups stopped after a fatal error or a violated invariant.")
	m.logDirFailures = counter("log_dir_failures_total", "Log directories failed by a fatal I/O error (WAL, MANIFEST, directory sync, read); their groups are stopped until the host restarts.")
	m.applyHeldBack = counter("apply_held_back_total", "Times committed entries were left in the log because the apply backlog was full.")
	m.badFrames = counter("bad_frames_total", "Inbound frames rejected (checksum, size or decoding); the connection is closed.")
	m.stepPanics = counter("step_panics_total", "Panics of etcd raft stepping an inbound message (its log cannot take it); the group is stopped.")
	m.rawPanics = counter("raw_node_panics_total", "Panics of etcd raft outside stepping an inbound message (taking a Ready, a tick, a proposal, ...: its Storage failed a read, as after a failed log directory); the group is stopped.")
	m.readerPanics = counter("reader_panics_total", "Panics recovered in a transport reader goroutine; the connection is closed.")
	m.connsRefused = counterVec("connections_refused_total", "Inbound or outbound transport connections refused, by reason: tls (handshake or certificate), identity (the certificate is not the node the connection claims), busy (too many unauthenticated or per-peer connections), hello.", "reason")
	m.forgedMessages = counter("forged_messages_total", "Inbound messages dropped because their From is not the node the connection authenticated (or their To is not this host).")
	if reg != nil {
		for _, c := range m.collectors {
			if err := reg.Register(c); err != nil {
				// Another host with the same ID on this registry (tests):
				// keep counting, just do not export twice.
				continue
			}
		}
	}
	return m
}

func (m *metrics) unregister() {
	if m.reg == nil {
		return
	}
	for _, c := range m.collectors {
		m.reg.Unregister(c)
	}
}

func (m *metrics) forgetGroup(id uint64) {
	l := fmt.Sprint(id)
	m.proposals.DeleteLabelValues(l)
	m.applied.DeleteLabelValues(l)
}

func (m *metrics) observeBatch(groups, entries int, synced bool, d time.Duration) {
	m.batches.Inc()
	m.batchGroups.Observe(float64(groups))
	m.batchEntries.Observe(float64(entries))
	m.entries.Add(float64(entries))
	if synced {
		m.syncedBatches.Inc()
	}
	m.syncSeconds.Observe(d.Seconds())
}
