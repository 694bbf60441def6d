package s3

import (
	"crypto/sha256"
	"encoding/hex"
	"math/rand/v2"
	"net/http"
	"strings"
	"testing"
)

// The allocation-free signature path against the plain definitions:
// HMAC-SHA256 over the string to sign, and the header value folding.
func TestSignatureOfMatchesHMAC(t *testing.T) {
	for _, day := range []string{"20261127", "20130524"} {
		key := signingKey("wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", day, "us-east-1", "s3")
		d := newDerivedKey(key)
		for _, canon := range []string{"", "HEAD\n/b/k\n\nhost:h\n\nhost\nUNSIGNED-PAYLOAD", strings.Repeat("x", 5000)} {
			h := sha256.Sum256([]byte(canon))
			scope := day + "/us-east-1/s3/aws4_request"
			sts := algorithm + "\n" + day + "T000000Z\n" + scope + "\n" + hex.EncodeToString(h[:])
			want := hex.EncodeToString(hmacSHA256(key, sts))
			var got [64]byte
			d.signatureOf(&got, nil, day+"T000000Z", scope, &h)
			if string(got[:]) != want {
				t.Fatalf("signatureOf = %s, HMAC = %s", got, want)
			}
		}
	}
}

func TestAppendHeaderValueMatchesFolding(t *testing.T) {
	r := &http.Request{Header: http.Header{}, Host: "example.com", ContentLength: -1}
	alphabet := []string{"a", "b", " ", "  ", "\t", "\n", "é", "\u00a0", "\u2003", ",", "x"}
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 20000 {
		var v strings.Builder
		for range rng.IntN(8) {
			v.WriteString(alphabet[rng.IntN(len(alphabet))])
		}
		r.Header.Del("X-Amz-Meta-T")
		r.Header["X-Amz-Meta-T"] = []string{v.String()}
		if i%7 == 0 {
			r.Header["X-Amz-Meta-T"] = append(r.Header["X-Amz-Meta-T"], " two  values ")
		}
		for _, name := range []string{"x-amz-meta-t", "host", "content-length", "x-amz-absent"} {
			want := headerValue(r, name)
			if got := string(appendHeaderValue(nil, r, name)); got != want {
				t.Fatalf("%s %q: appendHeaderValue %q, headerValue %q", name, r.Header["X-Amz-Meta-T"], got, want)
			}
		}
	}
}
