package s3

import (
	"encoding/xml"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// The translation between S3 grants and Basalt ACL entries, without a
// cluster.

func TestCannedACLs(t *testing.T) {
	for _, c := range []struct {
		name   string
		bucket bool
		want   string // type:name:rights, ...
		code   string
	}{
		{"private", true, "", ""},
		{"public-read", false, "ACL_ANONYMOUS::1,ACL_WORLD::1", ""},
		{"public-read", true, "ACL_ANONYMOUS::9,ACL_WORLD::9", ""},
		{"public-read-write", true, "ACL_ANONYMOUS::31,ACL_WORLD::31", ""},
		{"authenticated-read", false, "ACL_WORLD::1", ""},
		{"bucket-owner-read", false, "ACL_USER:bo:1", ""},
		{"bucket-owner-full-control", false, "ACL_USER:bo:127", ""},
		{"bucket-owner-full-control", true, "", ""},
		{"aws-exec-read", false, "", "NotImplemented"},
		{"log-delivery-write", true, "", "NotImplemented"},
		{"public", false, "", "InvalidArgument"},
	} {
		acls, e := cannedACL(c.name, c.bucket, "me", "bo")
		if c.code != "" {
			if e == nil || e.Code != c.code {
				t.Fatalf("%s: %v, want %s", c.name, e, c.code)
			}
			continue
		}
		if e != nil {
			t.Fatalf("%s: %v", c.name, e)
		}
		if got := aclString(acls); got != c.want {
			t.Fatalf("%s (bucket %v): %s, want %s", c.name, c.bucket, got, c.want)
		}
	}
}

func aclString(acls []*metapb.Acl) string {
	var parts []string
	for _, a := range acls {
		parts = append(parts, a.Type.String()+":"+a.Name+":"+strconv.FormatUint(uint64(a.Rights), 10))
	}
	return strings.Join(parts, ",")
}

func TestGrantHeaders(t *testing.T) {
	h := http.Header{}
	h.Set("X-Amz-Grant-Read", `id="bob", uri="http://acs.amazonaws.com/groups/global/AllUsers"`)
	h.Set("X-Amz-Grant-Write-Acp", `id="bob"`)
	acls, given, e := aclFromHeaders(h, true, "me", "")
	if e != nil || !given {
		t.Fatal(e, given)
	}
	// bob's two grants merge into one entry (READ|LIST|WRITE_ACL).
	if got := aclString(acls); got != "ACL_USER:bob:73,ACL_ANONYMOUS::9,ACL_WORLD::9" {
		t.Fatalf("grants: %s", got)
	}
	for _, bad := range []struct{ v, code string }{
		{`id=`, "InvalidArgument"}, {`nobody`, "InvalidArgument"}, {`foo="x"`, "InvalidArgument"},
		{`emailAddress="a@b.c"`, "UnresolvableGrantByEmailAddress"}, {`uri="http://acs.amazonaws.com/groups/global/Nobody"`, "InvalidArgument"},
		{`uri="http://acs.amazonaws.com/groups/s3/LogDelivery"`, "NotImplemented"},
	} {
		h := http.Header{}
		h.Set("X-Amz-Grant-Read", bad.v)
		if _, _, e := aclFromHeaders(h, false, "me", ""); e == nil || e.Code != bad.code {
			t.Fatalf("%s: %v, want %s", bad.v, e, bad.code)
		}
	}
	h = http.Header{}
	h.Set("X-Amz-Acl", "private")
	h.Set("X-Amz-Grant-Read", `id="bob"`)
	if _, _, e := aclFromHeaders(h, false, "me", ""); e == nil || e.Code != "InvalidRequest" {
		t.Fatalf("canned and grants: %v", e)
	}
	if _, given, _ := aclFromHeaders(http.Header{}, false, "me", ""); given {
		t.Fatal("no headers, yet an ACL")
	}
}

// TestACLDocument: a document the gateway writes reads back to the same
// entries, and S3's grantee forms decode.
func TestACLDocument(t *testing.T) {
	in := &metapb.AclList{Owner: "alice", Acls: []*metapb.Acl{
		{Type: metapb.AclType_ACL_USER, Name: "bob", Rights: 9},
		{Type: metapb.AclType_ACL_USER, Name: "carol", Rights: 127},
		{Type: metapb.AclType_ACL_GROUP, Name: "staff", Rights: 32},
		{Type: metapb.AclType_ACL_ANONYMOUS, Rights: 9},
		{Type: metapb.AclType_ACL_WORLD, Rights: 9 | 64},
	}}
	out, err := xml.Marshal(aclToPolicy(in, true))
	if err != nil {
		t.Fatal(err)
	}
	s := string(out)
	for _, want := range []string{`xsi:type="CanonicalUser"`, `<ID>alice</ID>`, `http://acs.amazonaws.com/groups/global/AllUsers`,
		`http://acs.amazonaws.com/groups/global/AuthenticatedUsers`, `urn:basalt:group:staff`, `<Permission>FULL_CONTROL</Permission>`} {
		if !strings.Contains(s, want) {
			t.Fatalf("document lacks %s: %s", want, s)
		}
	}
	var doc accessControlPolicyIn
	if err := xml.Unmarshal(out, &doc); err != nil {
		t.Fatal(err)
	}
	acls, e := policyToACL(&doc, true)
	if e != nil {
		t.Fatal(e)
	}
	got := aclString(acls)
	for _, want := range []string{"ACL_USER:alice:127", "ACL_USER:bob:9", "ACL_USER:carol:127", "ACL_GROUP:staff:32", "ACL_ANONYMOUS::9", "ACL_WORLD::73"} {
		if !strings.Contains(got, want) {
			t.Fatalf("round trip %s lacks %s", got, want)
		}
	}
}

func TestClientIP(t *testing.T) {
	g := &Gateway{}
	r, _ := http.NewRequest("GET", "http://x/", nil)
	r.RemoteAddr = "10.0.0.5:4444"
	r.Header.Set("X-Forwarded-For", "1.2.3.4")
	if got := g.clientIP(r); got != "10.0.0.5" {
		t.Fatalf("untrusted peer's X-Forwarded-For believed: %s", got)
	}
	var err error
	if g.proxies, err = parseProxies([]string{"10.0.0.0/8", "192.168.1.1"}); err != nil {
		t.Fatal(err)
	}
	r.Header.Set("X-Forwarded-For", "6.6.6.6, 1.2.3.4, 192.168.1.1")
	if got := g.clientIP(r); got != "1.2.3.4" {
		t.Fatalf("through trusted proxies: %s, want 1.2.3.4", got)
	}
	r.Header.Set("X-Forwarded-For", "garbage")
	if got := g.clientIP(r); got != "10.0.0.5" {
		t.Fatalf("garbled header: %s", got)
	}
	r.RemoteAddr = "[::ffff:10.1.2.3]:80"
	r.Header.Del("X-Forwarded-For")
	if got := g.clientIP(r); got != "10.1.2.3" {
		t.Fatalf("mapped address: %s", got)
	}
	if _, err := parseProxies([]string{"not-an-ip"}); err == nil {
		t.Fatal("bad proxy accepted")
	}
}

// FuzzACLInput: any grant header or AccessControlPolicy document is
// translated or refused with an S3 error, without a panic, and what is
// accepted names valid entries (users and groups named, rights within
// ALL, at most 2 entries per grant).
func FuzzACLInput(f *testing.F) {
	f.Add(`id="bob", uri="http://acs.amazonaws.com/groups/global/AllUsers"`, `<AccessControlPolicy><AccessControlList><Grant><Grantee xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" xsi:type="CanonicalUser"><ID>a</ID></Grantee><Permission>READ</Permission></Grant></AccessControlList></AccessControlPolicy>`)
	f.Add(`uri="urn:basalt:group:staff"`, `<AccessControlPolicy><AccessControlList><Grant><Grantee xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" xsi:type="Group"><URI>http://acs.amazonaws.com/groups/global/AuthenticatedUsers</URI></Grantee><Permission>FULL_CONTROL</Permission></Grant></AccessControlList></AccessControlPolicy>`)
	f.Add(`emailAddress="x@y"`, `<AccessControlPolicy/>`)
	check := func(t *testing.T, acls []*metapb.Acl) {
		for _, a := range acls {
			if a.Rights == 0 || a.Rights&^aclAllRights != 0 {
				t.Fatalf("entry with rights %#x", a.Rights)
			}
			named := a.Type == metapb.AclType_ACL_USER || a.Type == metapb.AclType_ACL_GROUP
			if named != (a.Name != "") {
				t.Fatalf("entry %v with name %q", a.Type, a.Name)
			}
		}
	}
	f.Fuzz(func(t *testing.T, header, doc string) {
		for _, bucket := range []bool{true, false} {
			h := http.Header{}
			h.Set("X-Amz-Grant-Full-Control", header)
			acls, _, e := aclFromHeaders(h, bucket, "me", "bo")
			if e == nil {
				check(t, acls)
			} else if e.Status < 400 || e.Status > 501 {
				t.Fatalf("status %d", e.Status)
			}
			var in accessControlPolicyIn
			if xml.Unmarshal([]byte(doc), &in) != nil {
				continue
			}
			acls, e = policyToACL(&in, bucket)
			if e == nil {
				check(t, acls)
				if len(acls) > 2*maxGrants {
					t.Fatalf("%d entries", len(acls))
				}
			}
		}
	})
}
