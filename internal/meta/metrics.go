package meta

import (
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"

	"github.com/basalt-store/basalt/internal/meta/namespace"
	"github.com/basalt-store/basalt/internal/meta/store"
)

type metrics struct {
	rpc     *prometheus.HistogramVec
	corrupt prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		rpc: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "basalt", Subsystem: "meta", Name: "rpc_duration_seconds",
			Help:    "Metadata service gRPC calls by method and status code, server side.",
			Buckets: prometheus.ExponentialBuckets(50e-6, 2, 18), // 50µs .. 6.5s
		}, []string{"method", "code"}),
	}
	m.corrupt = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "basalt", Subsystem: "scm", Name: "corrupt_replica_reports_total",
		Help: "Replicas reported by clients as failing their checksums.",
	})
	reg.MustRegister(m.rpc, m.corrupt)
	return m
}

func (m *metrics) observe(method string, c codes.Code, d time.Duration) {
	m.rpc.WithLabelValues(method, c.String()).Observe(d.Seconds())
}

// lookupCache exports the namespace's lookup cache counters,
// read when scraped.
func (m *metrics) lookupCache(reg prometheus.Registerer, stats func() namespace.LookupCacheStats) {
	counter := func(name, help string, f func(namespace.LookupCacheStats) uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "basalt", Subsystem: "meta", Name: name, Help: help},
			func() float64 { return float64(f(stats())) })
	}
	gauge := func(name, help string, f func(namespace.LookupCacheStats) float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: "basalt", Subsystem: "meta", Name: name, Help: help},
			func() float64 { return f(stats()) })
	}
	reg.MustRegister(
		counter("lookup_cache_hits_total", "Key lookups answered from the lookup cache.", func(s namespace.LookupCacheStats) uint64 { return s.Hits }),
		counter("lookup_cache_misses_total", "Key lookups that read Pebble (then cached the record).", func(s namespace.LookupCacheStats) uint64 { return s.Misses }),
		counter("lookup_cache_evictions_total", "Records evicted from the lookup cache to stay in its bound.", func(s namespace.LookupCacheStats) uint64 { return s.Evictions }),
		gauge("lookup_cache_bytes", "Memory held by the lookup cache (its arena plus an estimate of its index).", func(s namespace.LookupCacheStats) float64 { return float64(s.Bytes) }),
		gauge("lookup_cache_entries", "Records in the lookup cache.", func(s namespace.LookupCacheStats) float64 { return float64(s.Entries) }),
		gauge("lookup_cache_max_bytes", "Bound of the lookup cache (0: off).", func(s namespace.LookupCacheStats) float64 { return float64(s.MaxBytes) }),
	)
}

// storeStats exports a state store's Pebble write volume (the WAL, the
// memtable flushes, the compactions), read when scraped, so that a
// benchmark can divide it by the objects written.
func (m *metrics) storeStats(reg prometheus.Registerer, name string, st *store.Store) {
	counter := func(metric, help string, f func(*pebble.Metrics) uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "basalt", Subsystem: "meta", Name: metric, Help: help,
			ConstLabels: prometheus.Labels{"store": name}},
			func() float64 {
				if pm := st.Metrics(); pm != nil {
					return float64(f(pm))
				}
				return 0
			})
	}
	reg.MustRegister(
		counter("store_wal_bytes_total", "Bytes written to the state store's Pebble WAL.", func(pm *pebble.Metrics) uint64 { return pm.WAL.BytesWritten }),
		// (summed over the levels: Metrics.Total adds the WAL's bytes to
		// the flushed ones)
		counter("store_flushed_bytes_total", "Bytes of tables the state store's Pebble wrote flushing memtables.", func(pm *pebble.Metrics) (n uint64) {
			for i := range pm.Levels {
				n += pm.Levels[i].TableBytesFlushed
			}
			return n
		}),
		counter("store_compacted_bytes_total", "Bytes of tables the state store's Pebble wrote compacting.", func(pm *pebble.Metrics) (n uint64) {
			for i := range pm.Levels {
				n += pm.Levels[i].TableBytesCompacted
			}
			return n
		}),
	)
}
