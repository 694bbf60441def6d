package faulttest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"regexp"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/client"
)

// KeyKind is what a writer writes.
type KeyKind string

const (
	LargeV1 KeyKind = "large-v1"
	LargeV2 KeyKind = "large-v2"
	Small   KeyKind = "small"
	// Impatient writes large V1 keys with a deadline of 0.1–1.6 s, so
	// requests are cancelled while their proposals are in flight (issue
	// 11's scenario 4), while the impatient-client fault is on
	// (SetImpatient). The few it gets acknowledged count like any.
	Impatient KeyKind = "impatient"
)

// Acked is one acknowledged key: PutKey returned nil for it.
type Acked struct {
	Name       string
	Kind       KeyKind
	Size       int64
	DataSeed   uint64 // the content is keyData(DataSeed, Size)
	SHA        [32]byte
	Pipeline   string        // the write path PutKey reports it used
	Start, End time.Duration // since the workload began
}

// Workload writes keys from concurrent writers and records every
// acknowledged one. Writers keep going until Stop; a key in flight then
// finishes or hits its own timeout.
type Workload struct {
	Client *client.Client
	Volume string
	Bucket string
	Seed   uint64
	// Writers per kind.
	Writers map[KeyKind]int
	// LargeMin/LargeMax and SmallMin/SmallMax bound key sizes.
	LargeMin, LargeMax int64
	SmallMin, SmallMax int64
	// LargeBudget: large writers stop starting keys once this many bytes
	// of large keys are acknowledged; SmallBudget likewise counts small
	// keys. They bound the verification that follows.
	LargeBudget int64
	SmallBudget int64
	// LargeRate paces the large writers together (bytes per second of
	// keys started; 0 = unpaced), so large writes span the whole run and
	// meet every fault instead of using the budget up front.
	LargeRate int64
	// KeyTimeout bounds one PutKey.
	KeyTimeout time.Duration

	start     time.Time
	stop      atomic.Bool
	largeAck  atomic.Int64
	largeGo   atomic.Int64 // bytes of large keys started
	impatient atomic.Bool  // Impatient writers write only while set
	smallAck  atomic.Int64
	mu        sync.Mutex
	acked     []Acked
	failures  map[string]*failureClass
	attempted map[KeyKind]int
	failedN   map[KeyKind]int
	failedKey []string // names of keys whose PutKey failed with a definite error
}

type failureClass struct {
	Count   int
	Example string
}

// Begin marks the start of the workload (Since counts from it).
func (w *Workload) Begin() { w.start = time.Now() }

// Run starts the writers and returns once all have stopped. Begin must
// have been called.
func (w *Workload) Run(ctx context.Context) {
	w.failures = map[string]*failureClass{}
	w.attempted = map[KeyKind]int{}
	w.failedN = map[KeyKind]int{}
	var wg sync.WaitGroup
	n := 0
	for _, kind := range []KeyKind{LargeV1, LargeV2, Small, Impatient} {
		for range w.Writers[kind] {
			n++
			wg.Add(1)
			go func(id int) {
				defer wg.Done()
				w.writer(ctx, kind, id)
			}(n)
		}
	}
	wg.Wait()
}

// SetImpatient turns the Impatient writers on or off.
func (w *Workload) SetImpatient(on bool) { w.impatient.Store(on) }

// Stop makes the writers start no new key.
func (w *Workload) Stop() { w.stop.Store(true) }

// Since returns the time since the workload began.
func (w *Workload) Since() time.Duration { return time.Since(w.start) }

func (w *Workload) writer(ctx context.Context, kind KeyKind, id int) {
	rng := rand.New(rand.NewPCG(w.Seed, uint64(id)))
	var buf []byte
	for seq := 0; !w.stop.Load() && ctx.Err() == nil; seq++ {
		var size int64
		opts := client.PutOptions{}
		switch kind {
		case LargeV1, LargeV2:
			if w.largeAck.Load() >= w.LargeBudget {
				return
			}
			size = w.LargeMin + rng.Int64N(w.LargeMax-w.LargeMin+1)
			if !w.pace(ctx, size) {
				return
			}
			opts.Pipeline = client.PipelineV1
			if kind == LargeV2 {
				opts.Pipeline = client.PipelineV2
			}
		case Small:
			if w.smallAck.Load() >= w.SmallBudget {
				return
			}
			size = w.SmallMin + rng.Int64N(w.SmallMax-w.SmallMin+1)
		case Impatient:
			if !w.impatient.Load() {
				select {
				case <-ctx.Done():
				case <-time.After(100 * time.Millisecond):
				}
				seq--
				continue
			}
			size = w.LargeMin + rng.Int64N(w.LargeMax-w.LargeMin+1)
			opts.Pipeline = client.PipelineV1
		}
		timeout := w.KeyTimeout
		if kind == Impatient {
			timeout = time.Duration(100+rng.IntN(1500)) * time.Millisecond
		}
		dataSeed := rng.Uint64()
		buf = keyData(dataSeed, size, buf)
		name := fmt.Sprintf("%s/w%02d/%06d", kind, id, seq)
		opts.SizeHint = size
		kctx, cancel := context.WithTimeout(ctx, timeout)
		t0 := w.Since()
		info, err := w.Client.PutKey(kctx, w.Volume, w.Bucket, name, bytes.NewReader(buf), opts)
		cancel()
		t1 := w.Since()
		w.mu.Lock()
		w.attempted[kind]++
		if err != nil {
			w.failedN[kind]++
			if !ambiguous(err) {
				w.failedKey = append(w.failedKey, name)
			}
			cls := failureKey(err)
			if kind == Impatient {
				cls = "[impatient, expected] " + cls
			}
			fc := w.failures[cls]
			if fc == nil {
				fc = &failureClass{Example: fmt.Sprintf("%s at %.1fs: %v", name, t1.Seconds(), err)}
				w.failures[cls] = fc
			}
			fc.Count++
			w.mu.Unlock()
			// Back off a little so a dead pipeline is not hammered.
			select {
			case <-ctx.Done():
			case <-time.After(200 * time.Millisecond):
			}
			continue
		}
		w.acked = append(w.acked, Acked{Name: name, Kind: kind, Size: size, DataSeed: dataSeed, SHA: sha256.Sum256(buf),
			Pipeline: info.Pipeline, Start: t0, End: t1})
		w.mu.Unlock()
		switch kind {
		case Small:
			w.smallAck.Add(1)
		case LargeV1, LargeV2:
			w.largeAck.Add(size)
		case Impatient:
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
		}
	}
}

// pace waits until starting a large key of size bytes keeps the large
// writers within LargeRate; false if the workload stopped meanwhile.
func (w *Workload) pace(ctx context.Context, size int64) bool {
	started := w.largeGo.Add(size)
	if w.LargeRate <= 0 {
		return true
	}
	for !w.stop.Load() && ctx.Err() == nil {
		allowed := int64(w.Since().Seconds() * float64(w.LargeRate))
		if started-size <= allowed {
			return true
		}
		wait := time.Duration(float64(started-size-allowed) / float64(w.LargeRate) * float64(time.Second))
		select {
		case <-ctx.Done():
		case <-time.After(min(wait, 500*time.Millisecond)):
		}
	}
	return false
}

// Acked returns the acknowledged keys.
func (w *Workload) Acked() []Acked {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]Acked(nil), w.acked...)
}

// FailedKeys returns the names of keys whose PutKey failed.
func (w *Workload) FailedKeys() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.failedKey...)
}

// Summary describes what was attempted, acknowledged and failed, with the
// failure classes.
func (w *Workload) Summary() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var b bytes.Buffer
	ack := map[KeyKind]int{}
	ackBytes := map[KeyKind]int64{}
	for _, a := range w.acked {
		ack[a.Kind]++
		ackBytes[a.Kind] += a.Size
	}
	for _, k := range []KeyKind{LargeV1, LargeV2, Small, Impatient} {
		if w.attempted[k] == 0 {
			continue
		}
		fmt.Fprintf(&b, "  %-9s attempted %5d  acknowledged %5d (%7.1f MiB)  failed %4d\n", k, w.attempted[k], ack[k],
			float64(ackBytes[k])/(1<<20), w.failedN[k])
	}
	type fc struct {
		k string
		*failureClass
	}
	var fcs []fc
	for k, v := range w.failures {
		fcs = append(fcs, fc{k, v})
	}
	sort.Slice(fcs, func(i, j int) bool { return fcs[i].Count > fcs[j].Count })
	if len(fcs) > 0 {
		fmt.Fprintf(&b, "  write failures by class (allowed during faults; digits folded):\n")
	}
	for i, f := range fcs {
		if i == 12 {
			fmt.Fprintf(&b, "    ... %d more classes\n", len(fcs)-i)
			break
		}
		fmt.Fprintf(&b, "    %4d  %s\n          e.g. %s\n", f.Count, truncate(f.k, 200), truncate(f.Example, 600))
	}
	return b.String()
}

// ambiguous says whether a failed PutKey may still have committed the key:
// the caller's deadline or cancellation, or an error the client reports
// as of unknown outcome (codes.Unknown / DeadlineExceeded from a service,
// "outcome unknown"). A key that failed otherwise must not be committed.
func ambiguous(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		return true
	}
	var ce *client.Error
	if errors.As(err, &ce) && (ce.Code == codes.Unknown || ce.Code == codes.DeadlineExceeded || ce.Code == codes.Canceled) {
		return true
	}
	if st, ok := status.FromError(err); ok && (st.Code() == codes.DeadlineExceeded || st.Code() == codes.Canceled) {
		return true
	}
	return strings.Contains(strings.ToLower(err.Error()), "outcome unknown")
}

var digits = regexp.MustCompile(`[0-9]+`)

// failureKey folds an error message into a class: numbers (IDs, ports,
// offsets) replaced, length bounded.
func failureKey(err error) string {
	return truncate(digits.ReplaceAllString(err.Error(), "#"), 160)
}

// keyData returns size bytes of the content of a key with this seed,
// reusing buf. ChaCha8 keeps it fast and the content incompressible and
// unique per key, so a replica holding another key's block is caught.
func keyData(seed uint64, size int64, buf []byte) []byte {
	if int64(cap(buf)) < size {
		buf = make([]byte, size)
	}
	buf = buf[:size]
	var s [32]byte
	binary.LittleEndian.PutUint64(s[:], seed)
	binary.LittleEndian.PutUint64(s[8:], uint64(size))
	r := rand.NewChaCha8(s)
	r.Read(buf)
	return buf
}
