package zoned

import (
	"io"

	"github.com/cockroachdb/pebble/v2"

	"github.com/basalt-store/basalt/internal/storage"
)

// The backend's own Pebble DB (block records, zone marks) gets the same
// treatment as a volume's (storage/fatal.go): its Fatalf wedges the
// backend instead of taking the process down. A wedged backend never calls
// its DB again: every call returns the fatal error (which matches
// storage.ErrVolumeFailed, so storage fails the volume), Fatal reports it
// (storage's health check and volume reports fail the volume even with no
// traffic), and Close leaves the DB open.

// wedge is the logger's OnFatal.
func (b *Backend) wedge(err *storage.FatalError) {
	if b.fatal.CompareAndSwap(nil, err) {
		close(b.wedged)       // after fatal: CloseBatch keeps the batches
		b.log.AbandonWrites() // a write inside the DB returns with it
		b.cfg.Logf("zoned: %s: metadata store met a fatal error; the volume is failed: %v", b.cfg.Mount, err)
	}
}

// Fatal returns the fatal error that wedged the backend's metadata store
// (or a panic on its cleaner), or nil.
func (b *Backend) Fatal() error {
	if err := b.fatal.Load(); err != nil {
		return err
	}
	return nil
}

func (b *Backend) usable() error { return b.Fatal() }

// The calls into the DB (b.gdb: each refuses a wedged backend and catches a
// Fatalf raised inside it).
func (b *Backend) commit(batch *pebble.Batch, wo *pebble.WriteOptions) error {
	return b.gdb.Commit(batch, wo)
}
func (b *Backend) set(k, v []byte, wo *pebble.WriteOptions) error          { return b.gdb.Set(k, v, wo) }
func (b *Backend) del(k []byte, wo *pebble.WriteOptions) error             { return b.gdb.Delete(k, wo) }
func (b *Backend) logData(wo *pebble.WriteOptions) error                   { return b.gdb.LogData(wo) }
func (b *Backend) get(k []byte) ([]byte, io.Closer, error)                 { return b.gdb.Get(k) }
func (b *Backend) newIter(o *pebble.IterOptions) (*pebble.Iterator, error) { return b.gdb.NewIter(o) }
