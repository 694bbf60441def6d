package datanode

import (
	"runtime/metrics"
	"sync"
	"testing"
	"time"
)

func goroutinesCreated() uint64 {
	s := []metrics.Sample{{Name: "/sched/goroutines-created:goroutines"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

// TestCallPool: calls run one after another on the pool start no
// goroutine (the followers' ApplyStatus calls of every PutSmallFiles
// batch started one each, growing a fresh stack through gRPC's client),
// and a call finds a goroutine even when every pool goroutine is busy.
func TestCallPool(t *testing.T) {
	stop := make(chan struct{})
	defer close(stop)
	var p callPool
	done := make(chan struct{})
	p.run(stop, func() { done <- struct{}{} })
	<-done
	time.Sleep(50 * time.Millisecond) // every pool goroutine waiting
	g0 := goroutinesCreated()
	for range 100 {
		p.run(stop, func() { done <- struct{}{} })
		<-done
		time.Sleep(time.Millisecond) // the goroutine back to waiting
	}
	if n := goroutinesCreated() - g0; n > 5 {
		t.Errorf("%d goroutines started for 100 calls in a row, want (about) none", n)
	}
	// Every pool goroutine blocked: more calls still run.
	block := make(chan struct{})
	var wg sync.WaitGroup
	for range callPoolSize + 4 {
		wg.Add(1)
		p.run(stop, func() { defer wg.Done(); <-block })
	}
	ran := make(chan struct{})
	p.run(stop, func() { close(ran) })
	select {
	case <-ran:
	case <-time.After(10 * time.Second):
		t.Fatal("a call waited for busy pool goroutines")
	}
	close(block)
	wg.Wait()
}
