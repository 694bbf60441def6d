package datanode

import (
	"bytes"
	"context"
	"errors"
	"io"
	"testing"
	"time"
)

// TestPacedReaderCapsTheRate: 2 MiB through a 8 MiB/s cap take at least
// 0.25 s (less a burst of one read), none at all without a cap, and a
// canceled copy stops waiting.
func TestPacedReaderCapsTheRate(t *testing.T) {
	data := make([]byte, 2<<20)
	start := time.Now()
	n, err := io.Copy(io.Discard, paced(context.Background(), bytes.NewReader(data), 8<<20))
	took := time.Since(start)
	if err != nil || n != int64(len(data)) {
		t.Fatal(n, err)
	}
	if took < 200*time.Millisecond {
		t.Fatalf("2 MiB at 8 MiB/s took %v", took)
	}
	if r := paced(context.Background(), bytes.NewReader(data), 0); r == nil {
		t.Fatal("nil reader")
	} else if _, ok := r.(*pacedReader); ok {
		t.Fatal("a zero rate should not pace")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := io.Copy(io.Discard, paced(ctx, bytes.NewReader(data), 1)); !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled copy: %v", err)
	}
}
