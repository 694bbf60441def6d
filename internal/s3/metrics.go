package s3

import (
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/basalt-store/basalt/internal/md5x"
	"github.com/prometheus/client_golang/prometheus"
)

// stageTimer splits a request's latency (seed 003's latency breakdown):
// auth (signature check, secret lookup), meta (namespace calls) and data
// (streaming bodies to and from datanodes, including the key's own open
// and commit). What is left is HTTP and XML work.
type stageTimer struct {
	start            time.Time
	auth, meta, data time.Duration
	// Parts of data for request bodies (body.timeline): blocked reading
	// the body from the client, reading waiting for the digests (ETag
	// MD5, checksums), and from the body's end to the commit (the
	// streams' close with every replica synced, PutBlock).
	body, hashWait, tail time.Duration
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

	// The series of each operation, resolved on first use and kept:
	// WithLabelValues hashes the labels and looks them up under a lock on
	// every call, four to seven times per request (issue 15).
	opsMu sync.RWMutex
	ops   map[string]*opSeries
}

// opSeries are one operation's series, each resolved on its first use
// (so that /metrics shows only series that were observed, as with
// WithLabelValues per request). Racing resolutions get the same child.
type opSeries struct {
	ok                               atomic.Pointer[prometheus.Counter]
	duration, auth, meta, data       atomic.Pointer[prometheus.Observer]
	dataBody, dataHashWait, dataTail atomic.Pointer[prometheus.Observer]
}

// lazyObserver is *p, resolved from vec for op (and stage, unless "")
// on first use.
func lazyObserver(p *atomic.Pointer[prometheus.Observer], vec *prometheus.HistogramVec, op, stage string) prometheus.Observer {
	if o := p.Load(); o != nil {
		return *o
	}
	var o prometheus.Observer
	if stage == "" {
		o = vec.WithLabelValues(op)
	} else {
		o = vec.WithLabelValues(op, stage)
	}
	p.Store(&o)
	return o
}

// series returns op's series (ops are the gateway's own operation names:
// a bounded set).
func (m *metrics) series(op string) *opSeries {
	m.opsMu.RLock()
	s := m.ops[op]
	m.opsMu.RUnlock()
	if s != nil {
		return s
	}
	m.opsMu.Lock()
	defer m.opsMu.Unlock()
	if s = m.ops[op]; s == nil {
		if m.ops == nil {
			m.ops = map[string]*opSeries{}
		}
		s = &opSeries{}
		m.ops[op] = s
	}
	return s
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
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "basalt_s3_md5_bodies_total", Help: "Large bodies whose ETag MD5 was hashed on their hashing goroutine (every large body: through the lanes scheduler, or on the scalar path when the lanes are off or the CPU has no AVX-512).",
		}, func() float64 { return float64(laneStats.bodies.Load()) }))
		for n := 1; n <= md5x.MaxLanes; n++ {
			c := &laneStats.bytes[n]
			reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "basalt_s3_md5_bytes_total", Help: "Large bodies' bytes hashed for the ETag, by occupied lanes of the pass that hashed them (1: alone, on the scalar path).",
				ConstLabels: prometheus.Labels{"lanes": strconv.Itoa(n)},
			}, func() float64 { return float64(c.Load()) }))
		}
		for end, c := range map[string]*atomic.Int64{"company": &laneStats.lingerCompany, "timeout": &laneStats.lingerTimeout} {
			reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "basalt_s3_md5_lingers_total", Help: "Waits of a new MD5 batch for other bodies' buffers, by how they ended: company (a buffer arrived or a body stopped reading) or timeout (the linger bound).",
				ConstLabels: prometheus.Labels{"end": end},
			}, func() float64 { return float64(c.Load()) }))
		}
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "basalt_s3_md5_extra_leads_total", Help: "Buffers of bodies whose reading waited for their hashing that led their own MD5 passes beside another leader (a spare core, a thin pass).",
		}, func() float64 { return float64(laneStats.extraLeads.Load()) }))
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "basalt_s3_md5_reading_bodies", Help: "Large bodies being read (their MD5 may share the lanes).",
		}, func() float64 { return float64(readingBodies.Load()) }))
	}
	return m
}

func (m *metrics) observe(op, code string, s *stageTimer) {
	if op == "" {
		op = "Unknown"
	}
	ser := m.series(op)
	if code == "OK" {
		c := ser.ok.Load()
		if c == nil {
			cc := m.requests.WithLabelValues(op, code)
			ser.ok.Store(&cc)
			c = &cc
		}
		(*c).Inc()
	} else {
		m.requests.WithLabelValues(op, code).Inc()
	}
	lazyObserver(&ser.duration, m.duration, op, "").Observe(time.Since(s.start).Seconds())
	lazyObserver(&ser.auth, m.stages, op, "auth").Observe(s.auth.Seconds())
	if s.meta > 0 {
		lazyObserver(&ser.meta, m.stages, op, "meta").Observe(s.meta.Seconds())
	}
	if s.data > 0 {
		lazyObserver(&ser.data, m.stages, op, "data").Observe(s.data.Seconds())
	}
	// The body's sub-stages of successful requests only: a failed one
	// (BadDigest at settle, a refused commit, a disconnect) has no tail,
	// and these histograms carry no code label.
	if s.body > 0 && code == "OK" {
		lazyObserver(&ser.dataBody, m.stages, op, "data_body").Observe(s.body.Seconds())
		lazyObserver(&ser.dataHashWait, m.stages, op, "data_hashwait").Observe(s.hashWait.Seconds())
		lazyObserver(&ser.dataTail, m.stages, op, "data_tail").Observe(s.tail.Seconds())
	}
}
