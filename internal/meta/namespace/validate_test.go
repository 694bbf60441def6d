package namespace

import (
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestValidateBucketName(t *testing.T) {
	good := []string{"abc", "my-bucket", "my.bucket.1", "0abc", strings.Repeat("a", 63)}
	for _, n := range good {
		if err := ValidateBucketName("bucket", n); err != nil {
			t.Errorf("%q rejected: %v", n, err)
		}
	}
	bad := map[string]string{
		"ab":                    "3 to 63",
		strings.Repeat("a", 64): "3 to 63",
		"My-bucket":             "character 'M'",
		"-abc":                  "start and end",
		"abc-":                  "start and end",
		"a..b":                  `".."`,
		"a.-b":                  `".-"`,
		"192.168.1.1":           "IP address",
		"xn--abc":               "reserved prefix",
		"abc-s3alias":           "reserved suffix",
		"a_b":                   "character '_'",
	}
	for n, want := range bad {
		err := ValidateBucketName("bucket", n)
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), n[:min(len(n), 10)]) {
			t.Errorf("%q: %v (want InvalidArgument mentioning %q and the name)", n, err, want)
		}
	}
}

func TestValidateKey(t *testing.T) {
	for _, k := range []string{"a", "a/b/c", "日本語", strings.Repeat("x", 1024)} {
		if err := ValidateKey(k); err != nil {
			t.Errorf("%q rejected: %v", k, err)
		}
	}
	for _, k := range []string{"", strings.Repeat("x", 1025), "a\xffb", "a\x00b"} {
		if err := ValidateKey(k); status.Code(err) != codes.InvalidArgument {
			t.Errorf("%q accepted: %v", k, err)
		}
	}
	for _, p := range []string{"/a", "a/", "a//b", "a/./b", "a/../b"} {
		if _, err := SplitPath(p, false); err == nil {
			t.Errorf("path %q accepted", p)
		}
	}
	if parts, err := SplitPath("a/b/c", false); err != nil || len(parts) != 3 {
		t.Errorf("a/b/c: %v %v", parts, err)
	}
}
