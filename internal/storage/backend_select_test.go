package storage

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/basalt-store/basalt/internal/vfs"
)

// A suite backend is another backend TestMain reruns the whole suite on
// (registered from an external test file, zoned_suite_test.go, since the
// backends import this package). BASALT_STORAGE_BACKEND names the one in
// use, so re-executed test processes (TestCrashRecovery's children) use it
// too; "posix" runs only the posix suite.
type suiteBackend struct {
	name  string
	build func(fs vfs.FS, dir string) (BlockFiles, error)
	check func() error // after the run: e.g. no zonefs rule was violated
}

var suiteBackends []suiteBackend

const suiteEnv = "BASALT_STORAGE_BACKEND"

// RegisterSuiteBackend adds a backend the suite also runs on.
func RegisterSuiteBackend(name string, build func(fs vfs.FS, dir string) (BlockFiles, error), check func() error) {
	suiteBackends = append(suiteBackends, suiteBackend{name, build, check})
}

// useSuiteBackend selects the backend named by BASALT_STORAGE_BACKEND.
func useSuiteBackend() {
	name := os.Getenv(suiteEnv)
	testBackend = nil
	for _, sb := range suiteBackends {
		if sb.name == name {
			testBackend = sb.build
		}
	}
}

// onBackend reports the name of the backend the suite runs on.
func onBackend() string {
	if testBackend == nil {
		return "posix"
	}
	return os.Getenv(suiteEnv)
}

// posixOnly skips a test that looks at or edits posix block files.
func posixOnly(t testing.TB) {
	t.Helper()
	if testBackend != nil {
		t.Skipf("inspects posix block files; not applicable to the %s backend", onBackend())
	}
}

// runSuites runs the tests on posix, then on each registered backend.
func runSuites(m *testing.M) int {
	if env := os.Getenv(suiteEnv); env != "" && env != "posix" {
		useSuiteBackend()
		return m.Run()
	}
	code := m.Run()
	if code != 0 || os.Getenv(suiteEnv) == "posix" {
		return code
	}
	for _, sb := range suiteBackends {
		fmt.Printf("=== storage suite on the %s backend\n", sb.name)
		os.Setenv(suiteEnv, sb.name)
		testBackend = sb.build
		code = m.Run()
		if err := sb.check(); err != nil {
			fmt.Printf("FAIL: %s backend: %v\n", sb.name, err)
			code = 1
		}
		testBackend = nil
		os.Unsetenv(suiteEnv)
		if code != 0 {
			return code
		}
	}
	return code
}

// isBlockData reports whether path holds block data on the suite's
// backend: for posix a block file (by its suffix), for the zoned backend
// any zone file, so fault injection and skipped syncs hit the data either
// way.
func isBlockData(path, suffix string) bool {
	if testBackend != nil {
		return strings.Contains(path, "/zonefs/seq/")
	}
	return strings.HasSuffix(path, suffix)
}
