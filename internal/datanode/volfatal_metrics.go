package datanode

import "github.com/prometheus/client_golang/prometheus"

// volumeFatalCollectors export storage's fatal-error counts: volumes
// failed by a fatal error of their metadata store (or a panic on a storage
// goroutine), and writes that were inside such a volume's DB when it
// wedged (their callers got ErrVolumeFailed; the stuck ones are goroutines
// blocked in the dead DB until the process exits). Registered with the
// command metrics.
func (d *Datanode) volumeFatalCollectors() []prometheus.Collector {
	st := d.store
	return []prometheus.Collector{
		prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "basalt", Subsystem: "datanode", Name: "volume_fatal_errors_total",
			Help: "Volumes failed by a fatal error of their metadata store or a panic on a storage goroutine since start."},
			func() float64 { return float64(st.VolumeFatals()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "basalt", Subsystem: "datanode", Name: "volume_writes_abandoned_total",
			Help: "Writes that were inside a volume's metadata store when it wedged; their callers got an error."},
			func() float64 { a, _ := st.AbandonedWrites(); return float64(a) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: "basalt", Subsystem: "datanode", Name: "volume_writes_stuck",
			Help: "Abandoned writes still blocked inside a wedged volume's metadata store (until the datanode restarts)."},
			func() float64 { _, s := st.AbandonedWrites(); return float64(s) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "basalt", Subsystem: "datanode", Name: "volume_commits_total",
			Help: "Calls into the volumes' metadata store commit pipeline (Pebble commits, each handed to a committer goroutine) since start."},
			func() float64 { return float64(st.GuardedWrites()) }),
	}
}
