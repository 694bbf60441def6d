package meta

import (
	"context"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/scm"
)

// TestStoreMetrics: the state stores' Pebble write volume is exported,
// and the namespace store's WAL bytes grow with a namespace write.
func TestStoreMetrics(t *testing.T) {
	c := newClusterWith(t, 1, scm.Config{}, nil)
	waitFor(t, 10*time.Second, "leader", func() bool { return c.nsLeader() != 0 })
	wal := func() float64 {
		t.Helper()
		rec := httptest.NewRecorder()
		c.servers[1].Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
		body := rec.Body.String()
		for _, want := range []string{`basalt_meta_store_flushed_bytes_total{store="namespace"}`, `basalt_meta_store_compacted_bytes_total{store="scm"}`} {
			if !regexp.MustCompile(regexp.QuoteMeta(want) + ` \d`).MatchString(body) {
				t.Fatalf("metrics lack %s:\n%s", want, body)
			}
		}
		m := regexp.MustCompile(`basalt_meta_store_wal_bytes_total\{store="namespace"\} (\S+)`).FindStringSubmatch(body)
		if m == nil {
			t.Fatalf("metrics lack the namespace store's WAL bytes:\n%s", body)
		}
		v, err := strconv.ParseFloat(m[1], 64)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	before := wal()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := c.client().Namespace.CreateVolume(ctx, &metapb.CreateVolumeRequest{Name: "vol-metrics"}); err != nil {
		t.Fatal(err)
	}
	if after := wal(); after <= before {
		t.Fatalf("namespace store WAL bytes %v after a write, %v before", after, before)
	}
	// Nothing was flushed yet (a 32 MiB memtable): the flushed bytes are
	// tables' bytes, not the WAL's.
	rec := httptest.NewRecorder()
	c.servers[1].Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	if want := `basalt_meta_store_flushed_bytes_total{store="namespace"} 0`; !strings.Contains(rec.Body.String(), want) {
		t.Fatalf("metrics lack %s:\n%s", want, rec.Body.String())
	}
}
