package topology

import "testing"

func TestDistance(t *testing.T) {
	cases := []struct {
		a, b string
		same bool
		want int
	}{
		{"/dc1/r1", "/dc1/r1", true, 0},
		{"/dc1/r1", "/dc1/r1", false, 2},
		{"/dc1/r1", "/dc1/r2", false, 4},
		{"/dc1/r1", "/dc2/r1", false, 6},
		{"/r1", "/r2", false, 4},
		{"", "", false, 2},
		{"", "/default-rack", false, 2},
	}
	for _, c := range cases {
		if got := Distance(c.a, c.b, c.same); got != c.want {
			t.Errorf("Distance(%q,%q,%v)=%d want %d", c.a, c.b, c.same, got, c.want)
		}
	}
}

func TestNormalize(t *testing.T) {
	for in, want := range map[string]string{"": DefaultLocation, "/a/b/": "/a/b", "/a": "/a"} {
		got, err := Normalize(in)
		if err != nil || got != want {
			t.Errorf("Normalize(%q)=%q,%v want %q", in, got, err, want)
		}
	}
	for _, bad := range []string{"a/b", "/", "/a//b", "/a/../b", "/1/2/3/4/5/6/7/8/9"} {
		if _, err := Normalize(bad); err == nil {
			t.Errorf("Normalize(%q) accepted", bad)
		}
	}
}

func TestSortByDistance(t *testing.T) {
	type n struct {
		id  uint64
		loc string
	}
	nodes := []n{{1, "/dc2/r1"}, {2, "/dc1/r2"}, {3, "/dc1/r1"}, {4, "/dc1/r1"}}
	SortByDistance(nodes, 4, "/dc1/r1", func(x n) uint64 { return x.id }, func(x n) string { return x.loc })
	want := []uint64{4, 3, 2, 1}
	for i, w := range want {
		if nodes[i].id != w {
			t.Fatalf("order %v, want ids %v", nodes, want)
		}
	}
}
