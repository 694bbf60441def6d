package policy

import (
	"errors"
	"strings"
	"testing"
	"time"
)

func mustParse(t *testing.T, doc string) *Policy {
	t.Helper()
	p, err := Parse([]byte(doc))
	if err != nil {
		t.Fatalf("Parse: %v\n%s", err, doc)
	}
	return p
}

const publicRead = `{"Version":"2012-10-17","Statement":[{"Sid":"pub","Effect":"Allow","Principal":"*","Action":["s3:GetObject"],"Resource":"arn:aws:s3:::b/*"}]}`

func req(user, action, res string, ctx map[string]string) *Request {
	return &Request{User: user, Anonymous: user == "", Action: action, Resource: res, Context: ctx}
}

func TestEvaluate(t *testing.T) {
	p := mustParse(t, `{"Version":"2012-10-17","Statement":[
	 {"Effect":"Allow","Principal":{"AWS":["arn:aws:iam::123456789012:user/bob","carol"]},"Action":"s3:Get*","Resource":["arn:aws:s3:::b/docs/*"]},
	 {"Effect":"Allow","Principal":{"Basalt":"group:etl"},"Action":"s3:ListBucket","Resource":"arn:aws:s3:::b","Condition":{"StringLike":{"s3:prefix":"logs/*"}}},
	 {"Effect":"Deny","Principal":"*","Action":"s3:*","Resource":"arn:aws:s3:::b/*","Condition":{"NotIpAddress":{"aws:SourceIp":["10.0.0.0/8","::1"]}}},
	 {"Effect":"Deny","Principal":"*","NotAction":["s3:GetObject","s3:ListBucket"],"Resource":"arn:aws:s3:::b/*","Condition":{"Bool":{"aws:SecureTransport":false}}}
	]}`)
	in := map[string]string{"aws:sourceip": "10.1.2.3", "aws:securetransport": "true"}
	out := map[string]string{"aws:sourceip": "192.168.1.1", "aws:securetransport": "true"}
	for _, c := range []struct {
		name string
		r    *Request
		want Decision
	}{
		{"bob by ARN reads docs", req("bob", "s3:GetObject", "arn:aws:s3:::b/docs/x", in), Allow},
		{"action case-insensitive", req("carol", "S3:GETOBJECT", "arn:aws:s3:::b/docs/x", in), Allow},
		{"bob reads outside docs", req("bob", "s3:GetObject", "arn:aws:s3:::b/other", in), NotApplicable},
		{"bob writes docs", req("bob", "s3:PutObject", "arn:aws:s3:::b/docs/x", in), NotApplicable},
		{"bob from outside 10/8 denied", req("bob", "s3:GetObject", "arn:aws:s3:::b/docs/x", out), Deny},
		{"no source IP: NotIpAddress holds, denied", req("bob", "s3:GetObject", "arn:aws:s3:::b/docs/x", map[string]string{}), Deny},
		{"IPv6 loopback allowed", req("bob", "s3:GetObject", "arn:aws:s3:::b/docs/x", map[string]string{"aws:sourceip": "::1"}), Allow},
		{"etl lists logs/", &Request{User: "dave", Groups: []string{"etl"}, Action: "s3:ListBucket", Resource: "arn:aws:s3:::b", Context: map[string]string{"s3:prefix": "logs/2024"}}, Allow},
		{"etl lists other prefix", &Request{User: "dave", Groups: []string{"etl"}, Action: "s3:ListBucket", Resource: "arn:aws:s3:::b", Context: map[string]string{"s3:prefix": "x/"}}, NotApplicable},
		{"insecure put denied", req("bob", "s3:PutObject", "arn:aws:s3:::b/k", map[string]string{"aws:sourceip": "10.0.0.1", "aws:securetransport": "false"}), Deny},
		{"insecure get not denied by NotAction", req("bob", "s3:GetObject", "arn:aws:s3:::b/docs/k", map[string]string{"aws:sourceip": "10.0.0.1", "aws:securetransport": "false"}), Allow},
		{"anonymous matches no named principal", req("", "s3:GetObject", "arn:aws:s3:::b/docs/x", in), NotApplicable},
	} {
		if got := p.Evaluate(c.r); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}

func TestConditionsOperators(t *testing.T) {
	p := mustParse(t, `{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:ListBucket","Resource":"arn:aws:s3:::b",
	 "Condition":{"NumericLessThanEquals":{"s3:max-keys":"100"},"DateLessThan":{"aws:CurrentTime":"2030-01-01T00:00:00Z"},"StringEqualsIfExists":{"s3:delimiter":"/"},"StringNotLike":{"aws:UserAgent":"*curl*"}}}]}`)
	ok := map[string]string{"s3:max-keys": "50", "aws:currenttime": "2026-11-26T00:00:00Z"}
	if got := p.Evaluate(req("x", "s3:ListBucket", "arn:aws:s3:::b", ok)); got != Allow {
		t.Fatalf("all hold: %v", got)
	}
	for k, v := range map[string]string{"s3:max-keys": "1000", "aws:currenttime": "2031-01-01T00:00:00Z", "s3:delimiter": "-", "aws:useragent": "curl/8"} {
		ctx := map[string]string{"s3:max-keys": "50", "aws:currenttime": "2026-11-26T00:00:00Z"}
		ctx[k] = v
		if got := p.Evaluate(req("x", "s3:ListBucket", "arn:aws:s3:::b", ctx)); got != NotApplicable {
			t.Errorf("%s=%s: %v, want NotApplicable", k, v, got)
		}
	}
	if got := p.Evaluate(req("x", "s3:ListBucket", "arn:aws:s3:::b", map[string]string{"aws:currenttime": "2026-11-26T00:00:00Z"})); got != NotApplicable {
		t.Errorf("missing s3:max-keys under a positive operator: %v", got)
	}
}

func TestParseRefuses(t *testing.T) {
	for _, c := range []struct{ doc, want string }{
		{``, "empty"},
		{`[]`, "not a JSON object"},
		{`{"Statement":[]}`, "Version"},
		{`{"Version":"2012-10-17"}`, "no Statement"},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Maybe","Principal":"*","Action":"s3:GetObject","Resource":"*"}]}`, "Effect"},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"s3:GetObject","Resource":"*"}]}`, "Principal"},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"bob","Action":"s3:GetObject","Resource":"*"}]}`, "string principal"},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:Fly","Resource":"*"}]}`, "matches no S3 action"},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"ec2:*","Resource":"*"}]}`, "only s3 actions"},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"bucket/*"}]}`, "arn:aws:s3:::"},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"*","Condition":{"IpAddress":{"aws:SourceIp":"300.1.1.1"}}}]}`, "not an IP"},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"*","Condition":{"StringEquals":{"aws:Unknown":"x"}}}]}`, "not supported"},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"*","Condition":{"Magic":{"aws:Referer":"x"}}}]}`, "unknown condition operator"},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"*","Extra":1}]}`, "unknown element"},
		{`{"Version":"2012-10-17","Statement":[{"Sid":"a","Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"*"},{"Sid":"a","Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"*"}]}`, "duplicate Sid"},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"*"}]} x`, "not a JSON object"},
		{`{"Version":"2012-10-17","Statement":{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"*","Condition":{"Bool":{"aws:SecureTransport":"maybe"}}}}`, "not true or false"},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"*","Condition":{"ForAnyValue:StringEquals":{"aws:Referer":"x"}}}]}`, "set operators"},
		{`{"Version":"2012-10-17","Id":"` + strings.Repeat("x", MaxBytes) + `"}`, "at most"},
	} {
		_, err := Parse([]byte(c.doc))
		var pe *Error
		if !errors.As(err, &pe) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Parse(%.80s): %v, want an error containing %q", c.doc, err, c.want)
		}
	}
}

// TestPatternCostBounded: a policy whose wildcards would cost
// milliseconds per request is refused; evaluating the largest accepted
// one stays bounded.
func TestPatternCostBounded(t *testing.T) {
	heavy := `"arn:aws:s3:::b/*` + strings.Repeat("a", 900) + `b"`
	var res []string
	for range 8 {
		res = append(res, heavy)
	}
	doc := `{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":[` + strings.Join(res, ",") + `]}]}`
	if _, err := Parse([]byte(doc)); err == nil || !strings.Contains(err.Error(), "too complex") {
		t.Fatalf("8 heavy patterns: %v", err)
	}
	doc = `{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":[` + strings.Join(res[:4], ",") + `]}]}`
	p := mustParse(t, doc)
	r := req("bob", "s3:GetObject", "arn:aws:s3:::b/"+strings.Repeat("a", 1000), nil)
	start := time.Now()
	for range 10 {
		p.Evaluate(r)
	}
	if d := time.Since(start) / 10; d > 50*time.Millisecond {
		t.Fatalf("an accepted policy costs %v per request", d)
	}
}

func TestCheckBucket(t *testing.T) {
	p := mustParse(t, publicRead)
	if err := p.CheckBucket("b"); err != nil {
		t.Fatal(err)
	}
	if err := p.CheckBucket("other"); err == nil || !strings.Contains(err.Error(), "not in bucket") {
		t.Fatalf("other bucket: %v", err)
	}
}

func TestIsPublic(t *testing.T) {
	for _, c := range []struct {
		doc  string
		want bool
	}{
		{publicRead, true},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":{"AWS":"*"},"Action":"s3:GetObject","Resource":"arn:aws:s3:::b/*"}]}`, true},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":{"AWS":"bob"},"Action":"s3:GetObject","Resource":"arn:aws:s3:::b/*"}]}`, false},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Deny","Principal":"*","Action":"s3:*","Resource":"arn:aws:s3:::b/*"}]}`, false},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::b/*","Condition":{"IpAddress":{"aws:SourceIp":"10.0.0.0/8"}}}]}`, false},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::b/*","Condition":{"IpAddress":{"aws:SourceIp":"0.0.0.0/0"}}}]}`, true},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::b/*","Condition":{"Bool":{"aws:SecureTransport":"true"}}}]}`, true},
		{`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","NotPrincipal":{"AWS":"bob"},"Action":"s3:GetObject","Resource":"arn:aws:s3:::b/*"}]}`, true},
	} {
		if got := mustParse(t, c.doc).IsPublic(); got != c.want {
			t.Errorf("IsPublic(%s) = %v, want %v", c.doc, got, c.want)
		}
	}
}

func TestMatch(t *testing.T) {
	for _, c := range []struct {
		p, s string
		want bool
	}{
		{"*", "", true}, {"a*", "abc", true}, {"a*c", "abbbc", true}, {"a?c", "abc", true}, {"a?c", "ac", false},
		{"*b*", "aaa", false}, {"arn:aws:s3:::b/*", "arn:aws:s3:::b", false}, {"**a", "ba", true}, {"", "", true}, {"", "x", false},
	} {
		if got := Match(c.p, c.s); got != c.want {
			t.Errorf("Match(%q, %q) = %v", c.p, c.s, got)
		}
	}
}

// FuzzParse: no document panics Parse, and a parsed one evaluates.
//
//	go test -run '^$' -fuzz FuzzParse -fuzztime 60s ./internal/policy/
func FuzzParse(f *testing.F) {
	f.Add([]byte(publicRead))
	f.Add([]byte(`{"Version":"2012-10-17","Statement":{"Effect":"Deny","NotPrincipal":{"Basalt":["group:x","y"]},"NotAction":"s3:Put*","NotResource":["arn:aws:s3:::b/a?c*"],"Condition":{"DateGreaterThan":{"aws:CurrentTime":"2020-01-01"},"NumericLessThan":{"s3:max-keys":[1,2]},"Null":{"s3:prefix":true},"NotIpAddressIfExists":{"aws:SourceIp":"fe80::/10"}}}}`))
	f.Add([]byte(`{"Version":"2008-10-17","Id":"x","Statement":[]}`))
	f.Add([]byte(`{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":"*","Action":"*","Resource":"*","Condition":{"StringLike":{"aws:Referer":["http://*.example.com/*"]}}}]}`))
	f.Fuzz(func(t *testing.T, doc []byte) {
		p, err := Parse(doc)
		if err != nil {
			var pe *Error
			if !errors.As(err, &pe) {
				t.Fatalf("error not *Error: %v", err)
			}
			return
		}
		_ = p.IsPublic()
		_ = p.CheckBucket("b")
		ctx := map[string]string{"aws:sourceip": "10.0.0.1", "aws:currenttime": "2026-01-01T00:00:00Z", "s3:max-keys": "5", "s3:prefix": "a", "aws:securetransport": "true"}
		for _, r := range []*Request{req("bob", "s3:GetObject", "arn:aws:s3:::b/k", ctx), req("", "s3:ListBucket", "arn:aws:s3:::b", nil)} {
			_ = p.Evaluate(r)
		}
	})
}
