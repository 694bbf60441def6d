package meta

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
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
