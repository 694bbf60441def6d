package storage

import (
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestNoBatchCloseOutsideFatal keeps the batch memory rule of GuardedDB
// (fatal.go): a batch given to a commit is released only through
// CloseBatch, which keeps a wedged store's batches (a committer abandoned
// in the DB may still read them) from Pebble's pool, shared by every DB of
// the process. It type-checks storage and zoned (their non-test files) and
// fails on any use of (*pebble.Batch).Close or Reset outside fatal.go.
func TestNoBatchCloseOutsideFatal(t *testing.T) {
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command:", err)
	}
	out, err := exec.Command(gobin, "list", "-export", "-deps", "-f", "{{.ImportPath}}={{.Export}}", ".", "./zoned").Output()
	if err != nil {
		t.Fatalf("go list -export: %v", err)
	}
	exports := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if p, e, ok := strings.Cut(l, "="); ok && e != "" {
			exports[p] = e
		}
	}
	fset := token.NewFileSet()
	imp := importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		return os.Open(exports[path])
	})
	checked := 0
	for _, dir := range []string{".", "zoned"} {
		names, err := filepath.Glob(filepath.Join(dir, "*.go"))
		if err != nil {
			t.Fatal(err)
		}
		var files []*ast.File
		for _, n := range names {
			if strings.HasSuffix(n, "_test.go") {
				continue
			}
			f, err := parser.ParseFile(fset, n, nil, parser.SkipObjectResolution)
			if err != nil {
				t.Fatal(err)
			}
			files = append(files, f)
		}
		info := &types.Info{Selections: map[*ast.SelectorExpr]*types.Selection{}}
		conf := types.Config{Importer: imp}
		if _, err := conf.Check(dir, fset, files, info); err != nil {
			t.Fatalf("type-check %s: %v", dir, err)
		}
		for sel, s := range info.Selections {
			name := sel.Sel.Name
			if s.Kind() == types.FieldVal || (name != "Close" && name != "Reset") {
				continue
			}
			recv := s.Recv()
			if p, ok := recv.(*types.Pointer); ok {
				recv = p.Elem()
			}
			nt, ok := recv.(*types.Named)
			if !ok || nt.Obj().Pkg() == nil || nt.Obj().Pkg().Path() != "github.com/cockroachdb/pebble/v2" || nt.Obj().Name() != "Batch" {
				continue
			}
			checked++
			pos := fset.Position(sel.Pos())
			if filepath.Base(pos.Filename) == "fatal.go" && filepath.Dir(pos.Filename) == "." {
				continue // CloseBatch itself
			}
			t.Errorf("%s: (*pebble.Batch).%s outside fatal.go: release a committed batch with CloseBatch (closeBatch)", pos, name)
		}
	}
	if checked == 0 {
		t.Fatal("no use of (*pebble.Batch).Close found at all: the check cannot see them")
	}
}
