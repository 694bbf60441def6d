package vfs

import "path/filepath"

// MkdirAllSync is MkdirAll whose new directories are durable when it
// returns: each directory it creates is fsynced into its parent, so a crash
// cannot leave a store whose directory (or the directory of its Pebble DB)
// vanished while data written under it was synced. The one durable
// `mkdir -p` of storage, the zoned backend and the meta store.
func MkdirAllSync(fs FS, dir string) error {
	dir = filepath.Clean(dir)
	var missing []string
	for d := dir; ; d = filepath.Dir(d) {
		ok, err := Exists(fs, d)
		if err != nil {
			return err
		}
		if ok {
			break
		}
		missing = append(missing, d)
		if filepath.Dir(d) == d {
			break
		}
	}
	for i := len(missing) - 1; i >= 0; i-- {
		d := missing[i]
		if err := fs.MkdirAll(d, 0o755); err != nil {
			return err
		}
		if err := SyncDir(fs, filepath.Dir(d)); err != nil {
			return err
		}
	}
	return nil
}
