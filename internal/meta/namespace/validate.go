package namespace

import (
	"net/netip"
	"strings"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Limits.
const (
	MaxKeyBytes      = 1024
	MaxPathDepth     = 256
	DefaultPageSize  = 1000
	MaxPageSize      = 10000
	MaxBlocksPerKey  = 4096
	MaxOpenBlocks    = 16 // blocks allocated by one OpenKey
	MaxOwnerBytes    = 256
	MaxDelimiterSize = 16
)

func invalid(format string, args ...any) error {
	return status.Errorf(codes.InvalidArgument, format, args...)
}

// ValidateBucketName applies the S3 bucket naming rules (also used for
// volumes): 3–63 characters of lowercase letters, digits, dots and hyphens,
// starting and ending with a letter or digit, no two adjacent dots, not an
// IPv4 address, none of S3's reserved prefixes and suffixes.
func ValidateBucketName(kind, name string) error {
	if len(name) < 3 || len(name) > 63 {
		return invalid("%s name %q is %d characters long; it must be 3 to 63", kind, name, len(name))
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '.' || c == '-') {
			return invalid("%s name %q has character %q at offset %d; only lowercase letters, digits, '.' and '-' are allowed", kind, name, c, i)
		}
	}
	isAlnum := func(c byte) bool { return c >= 'a' && c <= 'z' || c >= '0' && c <= '9' }
	if !isAlnum(name[0]) || !isAlnum(name[len(name)-1]) {
		return invalid("%s name %q must start and end with a letter or digit", kind, name)
	}
	for _, bad := range []string{"..", ".-", "-."} {
		if strings.Contains(name, bad) {
			return invalid("%s name %q must not contain %q", kind, name, bad)
		}
	}
	if a, err := netip.ParseAddr(name); err == nil && a.Is4() {
		return invalid("%s name %q must not be formatted as an IP address", kind, name)
	}
	for _, p := range []string{"xn--", "sthree-", "amzn-s3-demo-"} {
		if strings.HasPrefix(name, p) {
			return invalid("%s name %q must not start with the reserved prefix %q", kind, name, p)
		}
	}
	for _, s := range []string{"-s3alias", "--ol-s3", ".mrap", "--x-s3"} {
		if strings.HasSuffix(name, s) {
			return invalid("%s name %q must not end with the reserved suffix %q", kind, name, s)
		}
	}
	return nil
}

// ValidateKey checks an object key: 1..1024 bytes of valid UTF-8 without
// NUL.
func ValidateKey(key string) error {
	if key == "" {
		return invalid("key name is empty")
	}
	if len(key) > MaxKeyBytes {
		return invalid("key name %.64q... is %d bytes; at most %d allowed", key, len(key), MaxKeyBytes)
	}
	if !utf8.ValidString(key) {
		return invalid("key name %q is not valid UTF-8", key)
	}
	if i := strings.IndexByte(key, 0); i >= 0 {
		return invalid("key name %q has a NUL byte at offset %d", key, i)
	}
	return nil
}

// SplitPath checks a path of an fs bucket and returns its components. The
// root is "" (no components); otherwise components are separated by single
// slashes, with no leading or trailing slash, and none is "." or "..".
func SplitPath(path string, allowRoot bool) ([]string, error) {
	if path == "" {
		if allowRoot {
			return nil, nil
		}
		return nil, invalid("path is empty (the bucket root)")
	}
	if err := ValidateKey(path); err != nil {
		return nil, err
	}
	parts := strings.Split(path, "/")
	if len(parts) > MaxPathDepth {
		return nil, invalid("path %q has %d levels, at most %d", path, len(parts), MaxPathDepth)
	}
	for _, p := range parts {
		if p == "" || p == "." || p == ".." {
			return nil, invalid("path %q has an empty, \".\" or \"..\" component (no leading, trailing or double slashes)", path)
		}
	}
	return parts, nil
}

func pageSize(n uint32) int {
	if n == 0 {
		return DefaultPageSize
	}
	return min(int(n), MaxPageSize)
}
