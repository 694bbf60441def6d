package slowdisk

import (
	"fmt"
	"testing"
	"time"
)

var t0 = time.Date(2026, 11, 27, 3, 0, 0, 0, time.UTC)

func disks(n int) []string {
	var out []string
	for i := range n {
		out = append(out, fmt.Sprintf("d%02d", i))
	}
	return out
}

// feed gives every disk 10 samples at now: lat(disk index).
func feed(d *Detector, names []string, now time.Time, lat func(i int) time.Duration) {
	for i, n := range names {
		for range 10 {
			d.Observe(n, lat(i), now)
		}
	}
}

func TestOutlierMarkedAfterHysteresis(t *testing.T) {
	names := disks(12)
	d := New(Config{}, names)
	lat := func(i int) time.Duration {
		if i == 7 {
			return 60 * time.Millisecond
		}
		return time.Duration(4+i%4) * time.Millisecond
	}
	now := t0
	feed(d, names, now, lat)
	if ch := d.Evaluate(now); len(ch) != 0 || d.Slow("d07") {
		t.Fatalf("marked after one evaluation (MarkAfter 2): %v", ch)
	}
	now = now.Add(time.Second)
	feed(d, names, now, lat)
	ch := d.Evaluate(now)
	if len(ch) != 1 || ch[0].Disk != "d07" || !ch[0].Slow {
		t.Fatalf("changes %v, want d07 marked slow", ch)
	}
	for _, n := range names {
		if n != "d07" && d.Slow(n) {
			t.Fatalf("%s marked slow", n)
		}
	}
	st := d.Statuses()[7]
	if st.Median != 60*time.Millisecond || st.Peers < 4*time.Millisecond || st.Peers > 7*time.Millisecond || st.Limit != 20*time.Millisecond {
		t.Fatalf("status %+v", st)
	}
}

func TestSeedMarksAtOnce(t *testing.T) {
	names := disks(4)
	d := New(Config{}, names)
	feed(d, names, t0, func(i int) time.Duration {
		if i == 2 {
			return 400 * time.Millisecond
		}
		return 5 * time.Millisecond
	})
	if ch := d.Seed(t0); len(ch) != 1 || !d.Slow("d02") {
		t.Fatalf("seed: %v", ch)
	}
}

func TestHysteresisHoldsInBandAndClears(t *testing.T) {
	names := disks(6)
	d := New(Config{Window: 2 * time.Second}, names)
	slowLat := 100 * time.Millisecond
	lat := func(i int) time.Duration {
		if i == 0 {
			return slowLat
		}
		return 5 * time.Millisecond
	}
	now := t0
	step := func() []Status {
		now = now.Add(3 * time.Second) // past the window: only this round's samples count
		feed(d, names, now, lat)
		return d.Evaluate(now)
	}
	step()
	step()
	if !d.Slow("d00") {
		t.Fatal("not marked")
	}
	// 15 ms: below the limit (20 ms) but above ClearFactor·limit (10 ms):
	// the mark holds however long.
	slowLat = 15 * time.Millisecond
	for range 10 {
		if ch := step(); len(ch) != 0 || !d.Slow("d00") {
			t.Fatalf("cleared inside the hysteresis band: %v", ch)
		}
	}
	// Below 10 ms: cleared after ClearAfter (3) evaluations, not before.
	slowLat = 6 * time.Millisecond
	step()
	step()
	if !d.Slow("d00") {
		t.Fatal("cleared before ClearAfter evaluations")
	}
	if ch := step(); len(ch) != 1 || ch[0].Slow || d.Slow("d00") {
		t.Fatalf("not cleared: %v", ch)
	}
	// One evaluation above the limit, then one below: not marked again.
	slowLat = 100 * time.Millisecond
	step()
	slowLat = 5 * time.Millisecond
	step()
	slowLat = 100 * time.Millisecond
	step()
	if d.Slow("d00") {
		t.Fatal("marked without MarkAfter evaluations in a row")
	}
}

func TestNothingSlowWithoutEnoughEvidence(t *testing.T) {
	// Fast disks a few times apart stay below LowThreshold.
	names := disks(5)
	d := New(Config{}, names)
	for r := range 3 {
		now := t0.Add(time.Duration(r) * time.Second)
		feed(d, names, now, func(i int) time.Duration {
			if i == 0 {
				return 15 * time.Millisecond
			}
			return time.Millisecond
		})
		d.Evaluate(now)
	}
	if d.Slow("d00") {
		t.Fatal("a 15 ms disk marked slow (LowThreshold 20 ms)")
	}
	// Two disks cannot be compared (MinDisks 3).
	two := New(Config{}, disks(2))
	for r := range 3 {
		now := t0.Add(time.Duration(r) * time.Second)
		feed(two, disks(2), now, func(i int) time.Duration { return time.Duration(1+i*500) * time.Millisecond })
		two.Evaluate(now)
	}
	if two.Slow("d01") {
		t.Fatal("judged with two disks")
	}
	// Too few samples on the slow disk: not judged; an idle slow disk
	// keeps its mark after its samples age out.
	d2 := New(Config{Window: time.Second}, names)
	for r := range 3 {
		now := t0.Add(time.Duration(r) * 2 * time.Second)
		for i, n := range names {
			k := 10
			if i == 0 {
				k = 4
			}
			for range k {
				d2.Observe(n, time.Duration(1+99*boolInt(i == 0))*time.Millisecond, now)
			}
		}
		d2.Evaluate(now)
	}
	if d2.Slow("d00") {
		t.Fatal("judged with 4 samples (MinSamples 5)")
	}
	for r := range 2 {
		now := t0.Add(time.Duration(10+r) * 2 * time.Second)
		feed(d2, names, now, func(i int) time.Duration { return time.Duration(1+99*boolInt(i == 0)) * time.Millisecond })
		d2.Evaluate(now)
	}
	if !d2.Slow("d00") {
		t.Fatal("not marked")
	}
	now := t0.Add(time.Minute)
	feed(d2, names[1:], now, func(int) time.Duration { return time.Millisecond })
	d2.Evaluate(now)
	d2.Evaluate(now)
	d2.Evaluate(now)
	if !d2.Slow("d00") {
		t.Fatal("an idle slow disk was cleared without evidence")
	}
}

// The median, not the mean, of a disk's samples counts: a few long
// flushes on a healthy disk do not mark it.
func TestRareSpikesDoNotMark(t *testing.T) {
	names := disks(8)
	d := New(Config{}, names)
	for r := range 5 {
		now := t0.Add(time.Duration(r) * time.Second)
		for i, n := range names {
			for j := range 10 {
				lat := 5 * time.Millisecond
				if i == 3 && j < 3 {
					lat = 2 * time.Second
				}
				d.Observe(n, lat, now)
			}
		}
		d.Evaluate(now)
	}
	if d.Slow("d03") {
		t.Fatal("marked by 30% spikes")
	}
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}
