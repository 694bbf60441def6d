package meta

import (
	"os"
	"path/filepath"
	"reflect"
	"testing"
)

func TestParseGroups(t *testing.T) {
	got, err := ParseGroups("alice=analysts,etl; bob=etl ;\n# a comment\ncarol=  ;alice=etl,ops")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string][]string{"alice": {"analysts", "etl", "ops"}, "bob": {"etl"}}
	if len(got["carol"]) != 0 || !reflect.DeepEqual(got["alice"], want["alice"]) || !reflect.DeepEqual(got["bob"], want["bob"]) {
		t.Fatalf("got %v", got)
	}
	for _, bad := range []string{"alice", "=etl", "alice=e tl", "al:ice=etl", "alice=a:b"} {
		if _, err := ParseGroups(bad); err == nil {
			t.Errorf("ParseGroups(%q) accepted", bad)
		}
	}
	f := filepath.Join(t.TempDir(), "groups")
	os.WriteFile(f, []byte("dave=etl # the ETL job\neve=analysts\n"), 0o644)
	got, err = LoadGroupsFile(f)
	if err != nil || !reflect.DeepEqual(got, map[string][]string{"dave": {"etl"}, "eve": {"analysts"}}) {
		t.Fatalf("file: %v %v", got, err)
	}
}
