package s3

import (
	"encoding/xml"
	"errors"
	"net/http"
	"sort"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// S3 ACLs on Basalt ACLs (docs/S3.md, "Access control"). The namespace
// keeps and checks Ozone-style ACLs (user / group / world / anonymous ×
// rights); the gateway translates S3's grants to them and back:
//
//	S3 permission   on a bucket                  on an object
//	READ            READ | LIST                  READ
//	WRITE           CREATE | WRITE | DELETE      WRITE
//	READ_ACP        READ_ACL                     READ_ACL
//	WRITE_ACP       WRITE_ACL                    WRITE_ACL
//	FULL_CONTROL    ALL                          ALL
//
//	S3 grantee                                   Basalt ACL entries
//	CanonicalUser ID=name                        USER name
//	Group .../global/AllUsers                    ANONYMOUS and WORLD
//	Group .../global/AuthenticatedUsers          WORLD
//	Group urn:basalt:group:NAME                  GROUP NAME
//
// Reading an ACL back, an entry shows the S3 permissions its rights
// cover in full (FULL_CONTROL alone when it has every right); rights no
// S3 permission names (LIST alone, say) are not shown. The owner has
// every right whatever the ACL and is listed with FULL_CONTROL, as S3
// lists it.

const (
	allUsersURI      = "http://acs.amazonaws.com/groups/global/AllUsers"
	authUsersURI     = "http://acs.amazonaws.com/groups/global/AuthenticatedUsers"
	logDeliveryURI   = "http://acs.amazonaws.com/groups/s3/LogDelivery"
	basaltGroupURN   = "urn:basalt:group:"
	xsiNS            = "http://www.w3.org/2001/XMLSchema-instance"
	maxGrants        = 100 // S3's limit per ACL
	aclReadRights    = uint32(metapb.AclRight_ACL_READ)
	aclAllRights     = uint32(metapb.AclRight_ACL_ALL)
	permRead         = "READ"
	permWrite        = "WRITE"
	permReadACP      = "READ_ACP"
	permWriteACP     = "WRITE_ACP"
	permFullControl  = "FULL_CONTROL"
	cannedPrivate    = "private"
	grantHeaderStart = "x-amz-grant-"
)

// s3Permissions in the order they are shown.
var s3Permissions = []string{permRead, permWrite, permReadACP, permWriteACP}

// rightsOf maps an S3 permission to ACL rights (ok false: no such
// permission).
func rightsOf(perm string, bucket bool) (uint32, bool) {
	r := func(rs ...metapb.AclRight) uint32 {
		var out uint32
		for _, x := range rs {
			out |= uint32(x)
		}
		return out
	}
	switch perm {
	case permRead:
		if bucket {
			return r(metapb.AclRight_ACL_READ, metapb.AclRight_ACL_LIST), true
		}
		return r(metapb.AclRight_ACL_READ), true
	case permWrite:
		if bucket {
			return r(metapb.AclRight_ACL_CREATE, metapb.AclRight_ACL_WRITE, metapb.AclRight_ACL_DELETE), true
		}
		return r(metapb.AclRight_ACL_WRITE), true
	case permReadACP:
		return r(metapb.AclRight_ACL_READ_ACL), true
	case permWriteACP:
		return r(metapb.AclRight_ACL_WRITE_ACL), true
	case permFullControl:
		return aclAllRights, true
	}
	return 0, false
}

// permissionsOf lists the S3 permissions rights cover in full.
func permissionsOf(rights uint32, bucket bool) []string {
	if rights&aclAllRights == aclAllRights {
		return []string{permFullControl}
	}
	var out []string
	for _, p := range s3Permissions {
		if want, _ := rightsOf(p, bucket); rights&want == want {
			out = append(out, p)
		}
	}
	return out
}

// grantee is one S3 grantee, as decoded.
type grantee struct {
	kind string // CanonicalUser, Group, AmazonCustomerByEmail
	id   string
	uri  string
}

// aclEntries are the Basalt ACL entries of a grantee.
func (gr grantee) aclEntries(rights uint32) ([]*metapb.Acl, *Error) {
	switch gr.kind {
	case "CanonicalUser":
		if gr.id == "" {
			return nil, errorf("MalformedACLError", 400, "The XML you provided was not well-formed or did not validate against our published schema: a CanonicalUser grantee needs an ID")
		}
		return []*metapb.Acl{{Type: metapb.AclType_ACL_USER, Name: gr.id, Rights: rights}}, nil
	case "Group":
		switch {
		case gr.uri == allUsersURI:
			return []*metapb.Acl{{Type: metapb.AclType_ACL_ANONYMOUS, Rights: rights}, {Type: metapb.AclType_ACL_WORLD, Rights: rights}}, nil
		case gr.uri == authUsersURI:
			return []*metapb.Acl{{Type: metapb.AclType_ACL_WORLD, Rights: rights}}, nil
		case strings.HasPrefix(gr.uri, basaltGroupURN) && len(gr.uri) > len(basaltGroupURN):
			return []*metapb.Acl{{Type: metapb.AclType_ACL_GROUP, Name: strings.TrimPrefix(gr.uri, basaltGroupURN), Rights: rights}}, nil
		case gr.uri == logDeliveryURI:
			return nil, errNotImplemented("the LogDelivery group (server access logging)")
		}
		return nil, errInvalidArgument("Invalid group uri: %s", gr.uri)
	case "AmazonCustomerByEmail":
		return nil, errorf("UnresolvableGrantByEmailAddress", 400, "The email address you provided does not match any account on record: this gateway names users by ID only")
	}
	return nil, errorf("MalformedACLError", 400, "The XML you provided was not well-formed or did not validate against our published schema: unknown grantee type %q", gr.kind)
}

// aclBuilder gathers ACL entries, merging rights per grantee.
type aclBuilder struct {
	m     map[[2]string]*metapb.Acl
	order [][2]string
}

func (b *aclBuilder) add(entries []*metapb.Acl) {
	if b.m == nil {
		b.m = map[[2]string]*metapb.Acl{}
	}
	for _, a := range entries {
		k := [2]string{a.Type.String(), a.Name}
		if e, ok := b.m[k]; ok {
			e.Rights |= a.Rights
			continue
		}
		c := &metapb.Acl{Type: a.Type, Name: a.Name, Rights: a.Rights}
		b.m[k] = c
		b.order = append(b.order, k)
	}
}

func (b *aclBuilder) list() []*metapb.Acl {
	out := []*metapb.Acl{}
	for _, k := range b.order {
		out = append(out, b.m[k])
	}
	return out
}

// cannedACL returns the ACL entries of a canned ACL besides the owner's
// own full control (which needs no entry). bucketOwner is the bucket's
// owner (for bucket-owner-* on objects).
func cannedACL(name string, bucket bool, objectOwner, bucketOwner string) ([]*metapb.Acl, *Error) {
	read, _ := rightsOf(permRead, bucket)
	write, _ := rightsOf(permWrite, bucket)
	public := func(rights uint32) []*metapb.Acl {
		return []*metapb.Acl{{Type: metapb.AclType_ACL_ANONYMOUS, Rights: rights}, {Type: metapb.AclType_ACL_WORLD, Rights: rights}}
	}
	switch name {
	case cannedPrivate:
		return nil, nil
	case "public-read":
		return public(read), nil
	case "public-read-write":
		return public(read | write), nil
	case "authenticated-read":
		return []*metapb.Acl{{Type: metapb.AclType_ACL_WORLD, Rights: read}}, nil
	case "bucket-owner-read", "bucket-owner-full-control":
		// On a bucket S3 ignores them (its owner is the bucket owner).
		if bucket || bucketOwner == "" || bucketOwner == objectOwner {
			return nil, nil
		}
		rights := aclReadRights
		if name == "bucket-owner-full-control" {
			rights = aclAllRights
		}
		return []*metapb.Acl{{Type: metapb.AclType_ACL_USER, Name: bucketOwner, Rights: rights}}, nil
	case "aws-exec-read":
		// Grants read to Amazon EC2 (AMI bundles): there is no EC2 here.
		return nil, errNotImplemented("the canned ACL aws-exec-read (it grants Amazon EC2 read access)")
	case "log-delivery-write":
		return nil, errNotImplemented("the canned ACL log-delivery-write (server access logging)")
	}
	return nil, errInvalidArgument("Invalid canned ACL: %q", name)
}

// grantHeaders are the x-amz-grant-* headers and their permissions.
var grantHeaders = map[string]string{
	"x-amz-grant-read": permRead, "x-amz-grant-write": permWrite, "x-amz-grant-read-acp": permReadACP,
	"x-amz-grant-write-acp": permWriteACP, "x-amz-grant-full-control": permFullControl,
}

// parseGrantHeader reads `id="alice", uri="http://acs.amazonaws.com/groups/global/AllUsers"`.
func parseGrantHeader(v string) ([]grantee, *Error) {
	var out []grantee
	for _, part := range strings.Split(v, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		k, val, ok := strings.Cut(part, "=")
		if !ok {
			return nil, errInvalidArgument("Invalid grant header value %q: want type=\"value\" pairs", part)
		}
		val = strings.TrimSpace(val)
		if len(val) >= 2 && val[0] == '"' && val[len(val)-1] == '"' {
			val = val[1 : len(val)-1]
		}
		if val == "" {
			return nil, errInvalidArgument("Invalid grant header value %q: empty grantee", part)
		}
		switch strings.ToLower(strings.TrimSpace(k)) {
		case "id":
			out = append(out, grantee{kind: "CanonicalUser", id: val})
		case "uri":
			out = append(out, grantee{kind: "Group", uri: val})
		case "emailaddress":
			out = append(out, grantee{kind: "AmazonCustomerByEmail"})
		default:
			return nil, errInvalidArgument("Invalid grant header value %q: the grantee type must be id, uri or emailAddress", part)
		}
	}
	return out, nil
}

// aclFromHeaders reads x-amz-acl or x-amz-grant-* (not both, as S3).
// given: the request carries either.
func aclFromHeaders(h http.Header, bucket bool, objectOwner, bucketOwner string) (acls []*metapb.Acl, given bool, e *Error) {
	canned := strings.TrimSpace(h.Get("X-Amz-Acl"))
	var grants []string
	for k := range grantHeaders {
		if h.Get(k) != "" {
			grants = append(grants, k)
		}
	}
	if canned == "" && len(grants) == 0 {
		return nil, false, nil
	}
	if canned != "" && len(grants) > 0 {
		return nil, true, errInvalidRequest("Specifying both Canned ACLs and Header Grants is not allowed")
	}
	if canned != "" {
		acls, e = cannedACL(canned, bucket, objectOwner, bucketOwner)
		return acls, true, e
	}
	sort.Strings(grants)
	var b aclBuilder
	n := 0
	for _, k := range grants {
		rights, _ := rightsOf(grantHeaders[k], bucket)
		gs, e := parseGrantHeader(strings.Join(h.Values(k), ","))
		if e != nil {
			return nil, true, e
		}
		for _, gr := range gs {
			if n++; n > maxGrants {
				return nil, true, errorf("MalformedACLError", 400, "The ACL has more than %d grants", maxGrants)
			}
			entries, e := gr.aclEntries(rights)
			if e != nil {
				return nil, true, e
			}
			b.add(entries)
		}
	}
	return b.list(), true, nil
}

// hasACLHeaders reports whether the request asks for an ACL.
func hasACLHeaders(h http.Header) bool {
	if h.Get("X-Amz-Acl") != "" {
		return true
	}
	for _, k := range grantHeaderKeys {
		if h.Get(k) != "" {
			return true
		}
	}
	return false
}

// grantHeaderKeys are grantHeaders' names in canonical form, so that
// looking them up on every write allocates nothing.
var grantHeaderKeys = func() (ks []string) {
	for k := range grantHeaders {
		ks = append(ks, http.CanonicalHeaderKey(k))
	}
	return ks
}()

// ---------------------------------------------------------------- XML

// xmlGrantee is a grantee as S3 writes it.
type xmlGrantee struct {
	XMLNSXsi    string `xml:"xmlns:xsi,attr"`
	Type        string `xml:"xsi:type,attr"`
	ID          string `xml:"ID,omitempty"`
	DisplayName string `xml:"DisplayName,omitempty"`
	URI         string `xml:"URI,omitempty"`
}

type xmlGrant struct {
	Grantee    xmlGrantee `xml:"Grantee"`
	Permission string     `xml:"Permission"`
}

type accessControlPolicyOut struct {
	XMLName xml.Name   `xml:"http://s3.amazonaws.com/doc/2006-03-01/ AccessControlPolicy"`
	Owner   owner      `xml:"Owner"`
	Grants  []xmlGrant `xml:"AccessControlList>Grant"`
}

// accessControlPolicyIn is the document PutBucketAcl and PutObjectAcl
// take (the grantee's type is the xsi:type attribute).
type accessControlPolicyIn struct {
	XMLName xml.Name `xml:"AccessControlPolicy"`
	Owner   *struct {
		ID string `xml:"ID"`
	} `xml:"Owner"`
	ACL *struct {
		Grants []struct {
			Grantee *struct {
				Type         string `xml:"http://www.w3.org/2001/XMLSchema-instance type,attr"`
				ID           string `xml:"ID"`
				URI          string `xml:"URI"`
				EmailAddress string `xml:"EmailAddress"`
			} `xml:"Grantee"`
			Permission string `xml:"Permission"`
		} `xml:"Grant"`
	} `xml:"AccessControlList"`
}

// policyToACL translates an AccessControlPolicy document.
func policyToACL(doc *accessControlPolicyIn, bucket bool) ([]*metapb.Acl, *Error) {
	malformed := func(why string) *Error {
		return errorf("MalformedACLError", 400, "The XML you provided was not well-formed or did not validate against our published schema: %s", why)
	}
	if doc.ACL == nil {
		return nil, malformed("no AccessControlList")
	}
	if len(doc.ACL.Grants) > maxGrants {
		return nil, malformed("more than 100 grants")
	}
	var b aclBuilder
	for _, g := range doc.ACL.Grants {
		if g.Grantee == nil {
			return nil, malformed("a Grant without a Grantee")
		}
		rights, ok := rightsOf(g.Permission, bucket)
		if !ok {
			return nil, malformed("unknown Permission " + g.Permission)
		}
		gr := grantee{kind: g.Grantee.Type, id: g.Grantee.ID, uri: g.Grantee.URI}
		entries, e := gr.aclEntries(rights)
		if e != nil {
			return nil, e
		}
		b.add(entries)
	}
	return b.list(), nil
}

// aclToPolicy renders a stored ACL as S3's document.
func aclToPolicy(l *metapb.AclList, bucket bool) accessControlPolicyOut {
	out := accessControlPolicyOut{Owner: owner{ID: l.Owner, DisplayName: l.Owner}, Grants: []xmlGrant{}}
	user := func(name string) xmlGrantee {
		return xmlGrantee{XMLNSXsi: xsiNS, Type: "CanonicalUser", ID: name, DisplayName: name}
	}
	group := func(uri string) xmlGrantee { return xmlGrantee{XMLNSXsi: xsiNS, Type: "Group", URI: uri} }
	add := func(gr xmlGrantee, rights uint32) {
		for _, p := range permissionsOf(rights, bucket) {
			out.Grants = append(out.Grants, xmlGrant{Grantee: gr, Permission: p})
		}
	}
	if l.Owner != "" {
		add(user(l.Owner), aclAllRights)
	}
	var anon, world uint32
	for _, a := range l.Acls {
		switch a.Type {
		case metapb.AclType_ACL_USER:
			if a.Name != l.Owner {
				add(user(a.Name), a.Rights)
			}
		case metapb.AclType_ACL_GROUP:
			add(group(basaltGroupURN+a.Name), a.Rights)
		case metapb.AclType_ACL_WORLD:
			world |= a.Rights
		case metapb.AclType_ACL_ANONYMOUS:
			anon |= a.Rights
		}
	}
	// AllUsers: what anonymous requesters may do (S3's AllUsers includes
	// authenticated ones, to whom WORLD grants); AuthenticatedUsers: what
	// WORLD grants beyond it.
	add(group(allUsersURI), anon)
	add(group(authUsersURI), world&^anon)
	return out
}

// ---------------------------------------------------------------- handlers

func (g *Gateway) getBucketACL(req *request) *Error { return g.getACL(req, true) }
func (g *Gateway) getObjectACL(req *request) *Error { return g.getACL(req, false) }
func (g *Gateway) putBucketACL(req *request) *Error { return g.putACL(req, true) }
func (g *Gateway) putObjectACL(req *request) *Error { return g.putACL(req, false) }

func (req *request) aclKey(bucket bool) string {
	if bucket {
		return ""
	}
	return req.key
}

func (g *Gateway) getACL(req *request, bucket bool) *Error {
	var l *metapb.AclList
	err := req.meta(func() (err error) {
		l, err = g.cl.GetAcl(req.r.Context(), g.cfg.Volume, req.bucket, req.aclKey(bucket))
		return err
	})
	if err != nil {
		return aclError(err, req.bucket, req.key)
	}
	return writeXML(req, aclToPolicy(l, bucket))
}

func (g *Gateway) putACL(req *request, bucket bool) *Error {
	ctx := req.r.Context()
	var acls []*metapb.Acl
	given := hasACLHeaders(req.r.Header)
	if given && req.r.ContentLength > 0 {
		return errorf("UnexpectedContent", 400, "This request does not support content when ACL headers are given")
	}
	if given {
		bucketOwner, objectOwner, e := g.aclOwners(req, bucket)
		if e != nil {
			return e
		}
		var e2 *Error
		if acls, _, e2 = aclFromHeaders(req.r.Header, bucket, objectOwner, bucketOwner); e2 != nil {
			return e2
		}
	} else {
		var doc accessControlPolicyIn
		if e := readXML(req, &doc); e != nil {
			if e.Code == "MalformedXML" {
				e = errorf("MalformedACLError", 400, "The XML you provided was not well-formed or did not validate against our published schema: %s", e.Message)
			}
			return e
		}
		var e *Error
		if acls, e = policyToACL(&doc, bucket); e != nil {
			return e
		}
	}
	if acls == nil {
		acls = []*metapb.Acl{}
	}
	err := req.meta(func() error {
		_, err := g.cl.SetAcl(ctx, g.cfg.Volume, req.bucket, req.aclKey(bucket), metapb.AclOp_ACL_REPLACE, acls)
		return err
	})
	if err != nil {
		return aclError(err, req.bucket, req.key)
	}
	req.w.WriteHeader(http.StatusOK)
	return nil
}

// aclOwners returns the bucket's owner and the owner an object written
// now gets (the requester) for bucket-owner-* canned ACLs.
func (g *Gateway) aclOwners(req *request, bucket bool) (bucketOwner, objectOwner string, e *Error) {
	if bucket || !strings.HasPrefix(req.r.Header.Get("X-Amz-Acl"), "bucket-owner-") {
		return "", req.auth.owner, nil
	}
	err := req.meta(func() (err error) {
		bucketOwner, _, err = g.owners.get(req.r.Context(), g.cfg.Volume, req.bucket)
		return err
	})
	if err != nil {
		return "", "", fromBasalt(err, req.bucket, "")
	}
	return bucketOwner, req.auth.owner, nil
}

// aclFromRequest reads the ACL headers of a request that creates a
// bucket or an object (nil, false: none given, the defaults apply).
func (g *Gateway) aclFromRequest(req *request, bucket bool) ([]*metapb.Acl, bool, *Error) {
	if !hasACLHeaders(req.r.Header) {
		return nil, false, nil
	}
	bucketOwner, objectOwner, e := g.aclOwners(req, bucket)
	if e != nil {
		return nil, true, e
	}
	return aclFromHeaders(req.r.Header, bucket, objectOwner, bucketOwner)
}

// applyACL sets the ACL a create request asked for on what it created
// (key "" : the bucket). It is a second step: between the two the new
// bucket or object has the default (private) ACL, never a wider one.
func (g *Gateway) applyACL(req *request, key string, acls []*metapb.Acl) *Error {
	if acls == nil {
		acls = []*metapb.Acl{}
	}
	err := req.meta(func() error {
		_, err := g.cl.SetAcl(req.r.Context(), g.cfg.Volume, req.bucket, key, metapb.AclOp_ACL_REPLACE, acls)
		return err
	})
	if err != nil {
		return aclError(err, req.bucket, key)
	}
	return nil
}

// aclError maps errors of the access-control calls: Unimplemented (a
// metadata service without them) is NotImplemented, not InternalError.
func aclError(err error, bucket, key string) *Error {
	if isUnimplemented(err) {
		return errNotImplemented("access control (the metadata service does not serve it)")
	}
	return fromBasalt(err, bucket, key)
}

func isUnimplemented(err error) bool {
	for e := err; e != nil; e = errors.Unwrap(e) {
		if st, ok := status.FromError(e); ok && st.Code() == codes.Unimplemented {
			return true
		}
	}
	var ce *client.Error
	return errors.As(err, &ce) && ce.Code == codes.Unimplemented
}
