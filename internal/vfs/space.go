package vfs

import (
	"errors"
	"fmt"
	iofs "io/fs"
	"path/filepath"
	"sync"
	"time"

	pvfs "github.com/cockroachdb/pebble/v2/vfs"
)

// ErrNoSpace is the class of errors Space.Admit returns: the file system
// is below its reserve, so new data is refused while the space left is
// kept for metadata (Pebble's WAL, flushes and compactions).
var ErrNoSpace = errors.New("disk below its reserve")

// SpaceOptions configure a Space.
type SpaceOptions struct {
	// Reserve is the free space kept for metadata: Admit refuses data that
	// would leave less than this. 0 or negative: no reserve.
	Reserve int64
	// Ballast is the size of the emergency ballast file; 0 or negative:
	// none. BallastPath is where it lives; default dir+".ballast", beside
	// the database's directory rather than inside it.
	Ballast     int64
	BallastPath string
	// RefreshInterval and RefreshBytes bound how stale the cached free
	// space may be: it is read again (one statfs) after this long or after
	// this many bytes were admitted (defaults 1s and Reserve/4, at least
	// 1 MiB). A refusal is always decided on a fresh figure.
	RefreshInterval time.Duration
	RefreshBytes    int64
	// Logf reports ballast removal and recreation; default discard.
	Logf func(format string, args ...any)
	// Now is the clock (default time.Now).
	Now func() time.Time
}

// Space keeps the disk under one directory from filling up under a
// database that cannot survive ENOSPC. Pebble treats a failed WAL write as
// fatal and, restarted on a full disk, waits forever for a flush it cannot
// write. So, as CockroachDB does:
//
//   - writers of bulk data (block chunks, Raft proposals) ask Admit first,
//     which refuses once free space would fall below Reserve, leaving that
//     much for the database's own writes; Admit is a cached figure, not a
//     statfs per call;
//   - an emergency ballast file of Ballast bytes is kept beside the
//     database. OpenSpace, called before the database is opened, removes
//     it when free space is below Reserve, so the open (WAL replay, flush)
//     has room and the node comes up with writes refused instead of
//     hanging; so does any refresh that finds less than a quarter of
//     Reserve free while running (something else filled the disk), so
//     the database's next WAL write has room; a later refresh recreates
//     it once there is room again.
//
// All methods are safe for concurrent use.
type Space struct {
	fs   pvfs.FS
	dir  string
	opts SpaceOptions

	mu      sync.Mutex
	avail   int64     // free bytes at the last statfs
	spent   int64     // bytes admitted since
	checked time.Time // time of the last statfs
	ballast bool      // the ballast file exists (as far as we know)
	// removed: the ballast was removed for want of space and is not back;
	// its room is the database's, so Admit keeps it free as well.
	removed bool
}

// OpenSpace starts watching the file system of dir, which must exist. Call
// it before opening the database in dir: it removes the ballast if free
// space is below the reserve (so the database can open), or creates it if
// it is missing and there is room for it beyond the reserve.
func OpenSpace(fs pvfs.FS, dir string, opts SpaceOptions) (*Space, error) {
	if opts.RefreshInterval <= 0 {
		opts.RefreshInterval = time.Second
	}
	if opts.RefreshBytes <= 0 {
		opts.RefreshBytes = max(opts.Reserve/4, 1<<20)
	}
	if opts.Logf == nil {
		opts.Logf = func(string, ...any) {}
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Ballast > 0 && opts.BallastPath == "" {
		opts.BallastPath = filepath.Clean(dir) + ".ballast"
	}
	s := &Space{fs: fs, dir: dir, opts: opts}
	if opts.Ballast > 0 {
		if _, err := fs.Stat(opts.BallastPath); err == nil {
			s.ballast = true
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.refreshLocked(); err != nil {
		return nil, err
	}
	if s.ballast && s.avail < opts.Reserve {
		if err := s.removeBallastLocked(); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// Reserve is the reserve in bytes.
func (s *Space) Reserve() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.opts.Reserve
}

// SetReserve changes the reserve.
func (s *Space) SetReserve(n int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.opts.Reserve = n
}

// Admit reports whether n more bytes of data may be written: nil, or an
// error wrapping ErrNoSpace naming the directory and the figures. Admitted
// bytes count against the cached free space until the next refresh.
func (s *Space) Admit(n int64) error { return s.admit(n, true) }

// Check is Admit without counting n as spent: for a caller that asks
// before a write whose own Admit comes later.
func (s *Space) Check(n int64) error { return s.admit(n, false) }

func (s *Space) admit(n int64, spend bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.opts.Now()
	if s.spent >= s.opts.RefreshBytes || now.Sub(s.checked) >= s.opts.RefreshInterval {
		if err := s.refreshLocked(); err != nil {
			return err
		}
	}
	if s.avail-s.spent-n < s.reserveLocked() && s.spent > 0 {
		// Decide a refusal on a fresh figure: deletes and compactions
		// may have freed space since.
		if err := s.refreshLocked(); err != nil {
			return err
		}
	}
	if left, reserve := s.avail-s.spent-n, s.reserveLocked(); left < reserve {
		return fmt.Errorf("%s: %w: %d bytes free, %d to write, %d reserved for metadata", s.dir, ErrNoSpace, s.avail-s.spent, n, reserve)
	}
	if spend {
		s.spent += n
	}
	return nil
}

// reserveLocked is the room data must leave: the reserve, and the
// ballast's room while the ballast is out for want of space.
func (s *Space) reserveLocked() int64 {
	if s.removed && s.opts.Ballast > 0 {
		return s.opts.Reserve + s.opts.Ballast
	}
	return s.opts.Reserve
}

// Low reports (as Check(0)) whether the file system is below its reserve.
func (s *Space) Low() error { return s.Check(0) }

// Refresh reads the free space again and recreates the ballast if it is
// missing and there is room for it and the reserve.
func (s *Space) Refresh() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.refreshLocked()
}

// Avail is the free space at the last refresh, less what was admitted since.
func (s *Space) Avail() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.avail - s.spent
}

// HasBallast reports whether the ballast file is in place.
func (s *Space) HasBallast() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ballast
}

func (s *Space) refreshLocked() error {
	s.spent = 0
	s.checked = s.opts.Now()
	du, err := s.fs.GetDiskUsage(s.dir)
	if err != nil {
		// A file system that cannot tell (Pebble's MemFS) is never
		// refused; real trouble shows up on the next write.
		s.avail = 1 << 62
		return nil
	}
	s.avail = int64(min(du.AvailBytes, 1<<62))
	if s.ballast && s.avail < s.opts.Reserve/4 {
		// Our own data stops at the reserve (Admit), so something else
		// filled the disk (another process, a runaway log) past three
		// quarters of the reserve. The database may now hit ENOSPC on its
		// next WAL write, which Pebble treats as fatal (a datanode marking
		// a container UNHEALTHY after a refused chunk crashed so): give it
		// the ballast's room now, not only at the next open. Data stays
		// refused (Admit keeps the ballast's room free too); the ballast
		// comes back once there is room for it. The price: if the other
		// writer eats that room as well, a restart finds no ballast to
		// remove. Above a quarter of the reserve the ballast is kept for
		// the open.
		if err := s.removeBallastLocked(); err != nil {
			s.opts.Logf("vfs: %s: DISK FULL: %d bytes free, below the reserve of %d; removing the emergency ballast failed: %v", s.dir, s.avail, s.opts.Reserve, err)
		}
		return nil
	}
	// Twice the reserve beyond the ballast: a ballast recreated at the
	// edge would be removed again by the next restart.
	if s.opts.Ballast > 0 && !s.ballast && s.avail >= s.opts.Ballast+2*s.opts.Reserve {
		if err := s.createBallastLocked(); err != nil {
			s.opts.Logf("vfs: %s: emergency ballast not created: %v", s.dir, err)
		} else {
			s.opts.Logf("vfs: %s: emergency ballast %s (%d bytes) in place", s.dir, s.opts.BallastPath, s.opts.Ballast)
		}
	}
	return nil
}

func (s *Space) removeBallastLocked() error {
	if err := s.fs.Remove(s.opts.BallastPath); err != nil && !errors.Is(err, iofs.ErrNotExist) {
		return fmt.Errorf("%s: remove emergency ballast: %w", s.dir, err)
	}
	if err := syncDirOf(s.fs, s.opts.BallastPath); err != nil {
		return fmt.Errorf("%s: remove emergency ballast: %w", s.dir, err)
	}
	s.ballast = false
	s.removed = true
	s.opts.Logf("vfs: %s: DISK FULL: %d bytes free, below the reserve of %d; removed the emergency ballast %s (%d bytes) to keep the database writable; data writes are refused until space is freed",
		s.dir, s.avail, s.opts.Reserve, s.opts.BallastPath, s.opts.Ballast)
	if err := s.refreshLocked(); err != nil {
		return err
	}
	return nil
}

// createBallastLocked writes the ballast in full (zeros written, not a
// sparse file, so the blocks are really allocated), synced, under a
// temporary name renamed into place: a ballast that exists is whole.
func (s *Space) createBallastLocked() error {
	tmp := s.opts.BallastPath + ".tmp"
	f, err := s.fs.Create(tmp, WriteCategory)
	if err != nil {
		return err
	}
	buf := make([]byte, min(s.opts.Ballast, 1<<20))
	for left := s.opts.Ballast; left > 0 && err == nil; {
		n := min(left, int64(len(buf)))
		_, err = f.Write(buf[:n])
		left -= n
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = s.fs.Rename(tmp, s.opts.BallastPath)
	}
	if err == nil {
		err = syncDirOf(s.fs, s.opts.BallastPath)
	}
	if err != nil {
		_ = s.fs.Remove(tmp)
		return err
	}
	s.ballast = true
	s.removed = false
	du, err := s.fs.GetDiskUsage(s.dir)
	if err == nil {
		s.avail = int64(min(du.AvailBytes, 1<<62))
	}
	return nil
}

func syncDirOf(fs pvfs.FS, path string) error {
	d, err := fs.OpenDir(filepath.Dir(path))
	if err != nil {
		return err
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	return err
}
