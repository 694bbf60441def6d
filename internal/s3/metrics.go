package s3

import (
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// stageTimer splits a request's latency (seed 003's latency breakdown):
// auth (signature check, secret lookup), meta (namespace calls) and data
// (streaming bodies to and from datanodes, including the key's own open
// and commit). What is left is HTTP and XML work.
type stageTimer struct {
	start            time.Time
	auth, meta, data time.Duration
}

type metrics struct {
	requests *prometheus.CounterVec
	duration *prometheus.HistogramVec
	stages   *prometheus.HistogramVec
	// Upload slots (Config.MaxUploads): held, and requests waiting.
	uploadsInFlight prometheus.Gauge
	uploadsWaiting  prometheus.Gauge
	// copied counts the bytes of CopyObject and UploadPartCopy by how they
	// were copied: "shared" (the copy holds the source's blocks, nothing
	// moved) or "streamed" (read and written through the gateway).
	copied *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "basalt_s3_requests_total", Help: "S3 requests by operation and result (OK or the S3 error code).",
		}, []string{"op", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "basalt_s3_request_duration_seconds", Help: "S3 request latency by operation.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 18),
		}, []string{"op"}),
		stages: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "basalt_s3_stage_duration_seconds", Help: "Time spent per stage (auth, meta, data) of S3 requests, by operation.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 20),
		}, []string{"op", "stage"}),
		uploadsInFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "basalt_s3_uploads_in_flight", Help: "Data-moving PUTs (objects, parts, copies) holding an upload slot; at most MaxUploads.",
		}),
		uploadsWaiting: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "basalt_s3_uploads_waiting", Help: "Data-moving PUTs waiting for an upload slot (SlowDown after UploadWait).",
		}),
		copied: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "basalt_s3_copy_bytes_total", Help: "Bytes copied by CopyObject and UploadPartCopy, by how: shared (blocks shared, no data moved) or streamed (through the gateway).",
		}, []string{"how"}),
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.duration, m.stages, m.uploadsInFlight, m.uploadsWaiting, m.copied)
		// The ETag MD5 lanes (md5lanes.go): process-wide.
		for how, c := range map[string]*atomic.Int64{"lanes": &laneChoice.lanes, "few": &laneChoice.few, "fast": &laneChoice.fast, "off": &laneChoice.off, "ended": &laneChoice.ended} {
			reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "basalt_s3_md5_bodies_total", Help: "Large bodies' ETag MD5 by where it ran: lanes (shared AVX-512), few (crypto/md5: no other large body being read), fast (crypto/md5: the body arrived faster than a lane hashes), off (crypto/md5: lanes switched off), ended (crypto/md5 or none: the body ended or failed before its rate was known).",
				ConstLabels: prometheus.Labels{"how": how},
			}, func() float64 { return float64(c.Load()) }))
		}
		for how, c := range map[string]*atomic.Int64{"behind": &laneBuffers.behind, "alone": &laneBuffers.alone, "together": &laneBuffers.together, "timeout": &laneBuffers.timeout} {
			reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "basalt_s3_md5_lane_buffers_total", Help: "Buffers handed to the MD5 lanes: behind (its body's hashing is behind its reads: no wait), alone (nobody else due), together (released with the others due), timeout (released by the 2 ms bound, whichever buffer's timer fired).",
				ConstLabels: prometheus.Labels{"how": how},
			}, func() float64 { return float64(c.Load()) }))
		}
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "basalt_s3_md5_lane_servers", Help: "md5-simd servers not yet closed (each takes at most 64 bodies, then retires).",
		}, func() float64 { return float64(lanePool.servers.Load()) }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "basalt_s3_md5_lane_hashers", Help: "Open lane hashers (bodies hashing in the lanes).",
			}, func() float64 { return float64(lanePool.hashers.Load()) }))
	}
	return m
}

func (m *metrics) observe(op, code string, s *stageTimer) {
	if op == "" {
		op = "Unknown"
	}
	m.requests.WithLabelValues(op, code).Inc()
	m.duration.WithLabelValues(op).Observe(time.Since(s.start).Seconds())
	m.stages.WithLabelValues(op, "auth").Observe(s.auth.Seconds())
	if s.meta > 0 {
		m.stages.WithLabelValues(op, "meta").Observe(s.meta.Seconds())
	}
	if s.data > 0 {
		m.stages.WithLabelValues(op, "data").Observe(s.data.Seconds())
	}
}
