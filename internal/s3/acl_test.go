package s3_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"

	bs3 "github.com/basalt-store/basalt/internal/s3"
)

// S3 access control through the real SDK and plain net/http: ACLs,
// bucket policies, Block Public Access, anonymous requests, HTTPS.

func TestAccessControl(t *testing.T) {
	e := setup(t)
	t.Run("BucketACL", e.testBucketACL)
	t.Run("CannedObjectACL", e.testCannedObjectACL)
	t.Run("ACLErrors", e.testACLErrors)
	t.Run("MultipartACL", e.testMultipartACL)
	t.Run("BucketPolicy", e.testBucketPolicy)
	t.Run("ExpectedOwnerProbe", e.testExpectedOwnerProbe)
}

// anon sends an unsigned request.
func (e *env) anon(t *testing.T, method, path, body string) (int, string) {
	t.Helper()
	r, err := http.NewRequest(method, e.url+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(r)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func (e *env) testBucketACL(t *testing.T) {
	ctx := e.ctx
	alice := e.keyFor(t, "AKIDACLALICE", "acl-alice", false)
	bob := e.keyFor(t, "AKIDACLBOB", "acl-bob", false)
	b := aws.String("acl-shared")
	if _, err := alice.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: b}); err != nil {
		t.Fatal(err)
	}
	if _, err := alice.PutObject(ctx, &s3.PutObjectInput{Bucket: b, Key: aws.String("doc"), Body: strings.NewReader("shared doc")}); err != nil {
		t.Fatal(err)
	}
	// Private: bob may do nothing.
	_, err := bob.ListObjectsV2(ctx, &s3.ListObjectsV2Input{Bucket: b})
	wantCode(t, err, "AccessDenied", 403)
	_, err = bob.GetObject(ctx, &s3.GetObjectInput{Bucket: b, Key: aws.String("doc")})
	wantCode(t, err, "AccessDenied", 403)
	_, err = bob.HeadBucket(ctx, &s3.HeadBucketInput{Bucket: b})
	wantCode(t, err, "", 403)
	_, err = bob.GetBucketAcl(ctx, &s3.GetBucketAclInput{Bucket: b})
	wantCode(t, err, "AccessDenied", 403)
	_, err = bob.PutBucketAcl(ctx, &s3.PutBucketAclInput{Bucket: b, ACL: types.BucketCannedACLPublicReadWrite})
	wantCode(t, err, "AccessDenied", 403)

	// The owner's ACL, as S3 shows it: the owner with FULL_CONTROL.
	acl, err := alice.GetBucketAcl(ctx, &s3.GetBucketAclInput{Bucket: b})
	if err != nil {
		t.Fatal(err)
	}
	if aws.ToString(acl.Owner.ID) != "acl-alice" || len(acl.Grants) != 1 || acl.Grants[0].Permission != types.PermissionFullControl ||
		aws.ToString(acl.Grants[0].Grantee.ID) != "acl-alice" || acl.Grants[0].Grantee.Type != types.TypeCanonicalUser {
		t.Fatalf("owner's ACL: %+v", acl)
	}

	// Alice grants bob READ (the document form, as SDKs send it).
	_, err = alice.PutBucketAcl(ctx, &s3.PutBucketAclInput{Bucket: b, AccessControlPolicy: &types.AccessControlPolicy{
		Owner: acl.Owner,
		Grants: []types.Grant{
			{Grantee: &types.Grantee{Type: types.TypeCanonicalUser, ID: aws.String("acl-alice")}, Permission: types.PermissionFullControl},
			{Grantee: &types.Grantee{Type: types.TypeCanonicalUser, ID: aws.String("acl-bob")}, Permission: types.PermissionRead},
		}}})
	if err != nil {
		t.Fatal(err)
	}
	acl, err = alice.GetBucketAcl(ctx, &s3.GetBucketAclInput{Bucket: b})
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, g := range acl.Grants {
		if aws.ToString(g.Grantee.ID) == "acl-bob" && g.Permission == types.PermissionRead {
			found = true
		}
	}
	if !found {
		t.Fatalf("bob's READ grant is not in %+v", acl.Grants)
	}
	// bob lists and reads, and may not write, delete or change the ACL.
	out, err := bob.ListObjectsV2(ctx, &s3.ListObjectsV2Input{Bucket: b})
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Contents) != 1 || aws.ToString(out.Contents[0].Key) != "doc" {
		t.Fatalf("bob lists %+v", out.Contents)
	}
	if _, err := bob.HeadBucket(ctx, &s3.HeadBucketInput{Bucket: b}); err != nil {
		t.Fatal(err)
	}
	if got := e.getWith(t, bob, "acl-shared", "doc"); got != "shared doc" {
		t.Fatalf("bob reads %q", got)
	}
	_, err = bob.PutObject(ctx, &s3.PutObjectInput{Bucket: b, Key: aws.String("doc"), Body: strings.NewReader("bob was here")})
	wantCode(t, err, "AccessDenied", 403)
	_, err = bob.PutObject(ctx, &s3.PutObjectInput{Bucket: b, Key: aws.String("new"), Body: strings.NewReader("bob was here")})
	wantCode(t, err, "AccessDenied", 403)
	_, err = bob.DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: b, Key: aws.String("doc")})
	wantCode(t, err, "AccessDenied", 403)
	_, err = bob.DeleteBucket(ctx, &s3.DeleteBucketInput{Bucket: b})
	wantCode(t, err, "AccessDenied", 403)
	_, err = bob.PutBucketAcl(ctx, &s3.PutBucketAclInput{Bucket: b, ACL: types.BucketCannedACLPublicReadWrite})
	wantCode(t, err, "AccessDenied", 403)
	if got := e.getWith(t, alice, "acl-shared", "doc"); got != "shared doc" {
		t.Fatalf("alice's object after bob's writes: %q", got)
	}
	// Anonymous requesters still get nothing.
	if code, body := e.anon(t, "GET", "/acl-shared/doc", ""); code != 403 || strings.Contains(body, "shared doc") {
		t.Fatalf("anonymous GET of a bucket shared with bob: %d %s", code, body)
	}
	// x-amz-grant-* headers replace the ACL: bob loses READ.
	if _, err := alice.PutBucketAcl(ctx, &s3.PutBucketAclInput{Bucket: b, GrantFullControl: aws.String(`id="acl-alice"`)}); err != nil {
		t.Fatal(err)
	}
	_, err = bob.ListObjectsV2(ctx, &s3.ListObjectsV2Input{Bucket: b})
	wantCode(t, err, "AccessDenied", 403)
}

func (e *env) testCannedObjectACL(t *testing.T) {
	ctx := e.ctx
	e.mkBucket(t, "acl-canned")
	b := aws.String("acl-canned")
	if _, err := e.s3.PutObject(ctx, &s3.PutObjectInput{Bucket: b, Key: aws.String("pub"), Body: strings.NewReader("hello world"),
		ACL: types.ObjectCannedACLPublicRead}); err != nil {
		t.Fatal(err)
	}
	e.put(t, "acl-canned", "priv", []byte("private"))
	// Anonymous GET (no signature at all) of the public-read object.
	if code, body := e.anon(t, "GET", "/acl-canned/pub", ""); code != 200 || body != "hello world" {
		t.Fatalf("anonymous GET of a public-read object: %d %q", code, body)
	}
	// Not of its neighbour, and no anonymous writes or deletes.
	code, body := e.anon(t, "GET", "/acl-canned/priv", "")
	wantHTTP(t, "anonymous GET of a private object", code, body, 403, "AccessDenied")
	code, body = e.anon(t, "PUT", "/acl-canned/pub", "defaced")
	wantHTTP(t, "anonymous PUT over a public-read object", code, body, 403, "AccessDenied")
	code, body = e.anon(t, "PUT", "/acl-canned/new", "dropped")
	wantHTTP(t, "anonymous PUT into the bucket", code, body, 403, "AccessDenied")
	code, body = e.anon(t, "DELETE", "/acl-canned/pub", "")
	wantHTTP(t, "anonymous DELETE", code, body, 403, "AccessDenied")
	code, body = e.anon(t, "GET", "/acl-canned", "")
	wantHTTP(t, "anonymous listing", code, body, 403, "AccessDenied")
	code, body = e.anon(t, "GET", "/", "")
	wantHTTP(t, "anonymous ListBuckets", code, body, 403, "AccessDenied")
	code, body = e.anon(t, "PUT", "/acl-anon-bucket", "")
	wantHTTP(t, "anonymous CreateBucket", code, body, 403, "AccessDenied")
	if got := e.get(t, "acl-canned", "pub"); string(got) != "hello world" {
		t.Fatalf("public object after anonymous writes: %q", got)
	}
	// The object's ACL shows AllUsers READ.
	acl, err := e.s3.GetObjectAcl(ctx, &s3.GetObjectAclInput{Bucket: b, Key: aws.String("pub")})
	if err != nil {
		t.Fatal(err)
	}
	public := false
	for _, g := range acl.Grants {
		if g.Grantee.Type == types.TypeGroup && strings.HasSuffix(aws.ToString(g.Grantee.URI), "/AllUsers") && g.Permission == types.PermissionRead {
			public = true
		}
	}
	if !public {
		t.Fatalf("public-read object's ACL: %+v", acl.Grants)
	}
	// PutObjectAcl private takes it back.
	if _, err := e.s3.PutObjectAcl(ctx, &s3.PutObjectAclInput{Bucket: b, Key: aws.String("pub"), ACL: types.ObjectCannedACLPrivate}); err != nil {
		t.Fatal(err)
	}
	code, body = e.anon(t, "GET", "/acl-canned/pub", "")
	wantHTTP(t, "anonymous GET after PutObjectAcl private", code, body, 403, "AccessDenied")
	// A copy made public-read by its request.
	if _, err := e.s3.CopyObject(ctx, &s3.CopyObjectInput{Bucket: b, Key: aws.String("pub-copy"), CopySource: aws.String("acl-canned/priv"),
		ACL: types.ObjectCannedACLPublicRead}); err != nil {
		t.Fatal(err)
	}
	if code, body := e.anon(t, "GET", "/acl-canned/pub-copy", ""); code != 200 || body != "private" {
		t.Fatalf("anonymous GET of a public-read copy: %d %q", code, body)
	}
	// A public-read-write bucket takes anonymous writes.
	if _, err := e.s3.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: aws.String("acl-open"), ACL: types.BucketCannedACLPublicReadWrite}); err != nil {
		t.Fatal(err)
	}
	if code, body := e.anon(t, "PUT", "/acl-open/drop", "anonymous drop"); code != 200 {
		t.Fatalf("anonymous PUT into a public-read-write bucket: %d %s", code, body)
	}
	if code, body := e.anon(t, "GET", "/acl-open", ""); code != 200 || !strings.Contains(body, "<Key>drop</Key>") {
		t.Fatalf("anonymous listing of a public-read-write bucket: %d %s", code, body)
	}
}

func (e *env) testACLErrors(t *testing.T) {
	ctx := e.ctx
	e.mkBucket(t, "acl-errors")
	b := aws.String("acl-errors")
	_, err := e.s3.PutObject(ctx, &s3.PutObjectInput{Bucket: b, Key: aws.String("k"), Body: strings.NewReader("x"), ACL: "no-such-acl"})
	wantCode(t, err, "InvalidArgument", 400)
	_, err = e.s3.PutObject(ctx, &s3.PutObjectInput{Bucket: b, Key: aws.String("k"), Body: strings.NewReader("x"), ACL: types.ObjectCannedACLAwsExecRead})
	wantCode(t, err, "NotImplemented", 501)
	_, err = e.s3.PutObject(ctx, &s3.PutObjectInput{Bucket: b, Key: aws.String("k"), Body: strings.NewReader("x"),
		ACL: types.ObjectCannedACLPublicRead, GrantRead: aws.String(`id="x"`)})
	wantCode(t, err, "InvalidRequest", 400)
	_, err = e.s3.HeadObject(ctx, &s3.HeadObjectInput{Bucket: b, Key: aws.String("k")})
	wantCode(t, err, "", 404) // refused before any data was written
	code, body := e.do(t, "PUT", "/acl-errors?acl", []byte("<AccessControlPolicy><AccessControlList><Grant><Permission>READ</Permission></Grant></AccessControlList></AccessControlPolicy>"), nil)
	wantHTTP(t, "grant without a grantee", code, body, 400, "MalformedACLError")
	code, body = e.do(t, "PUT", "/acl-errors?acl", []byte("<AccessControlPolicy><AccessControlList>"), nil)
	wantHTTP(t, "truncated ACL", code, body, 400, "MalformedACLError")
	_, err = e.s3.PutBucketAcl(ctx, &s3.PutBucketAclInput{Bucket: b, GrantRead: aws.String(`uri="http://acs.amazonaws.com/groups/global/Nobody"`)})
	wantCode(t, err, "InvalidArgument", 400)
	_, err = e.s3.PutBucketAcl(ctx, &s3.PutBucketAclInput{Bucket: b, AccessControlPolicy: &types.AccessControlPolicy{Grants: []types.Grant{
		{Grantee: &types.Grantee{Type: types.TypeCanonicalUser, ID: aws.String("u")}, Permission: "EVERYTHING"}}}})
	wantCode(t, err, "MalformedACLError", 400)
}

// testMultipartACL: the ACL of CreateMultipartUpload is the completed
// object's.
func (e *env) testMultipartACL(t *testing.T) {
	ctx := e.ctx
	e.mkBucket(t, "acl-mp")
	b := aws.String("acl-mp")
	for _, c := range []struct {
		key    string
		acl    types.ObjectCannedACL
		public bool
	}{{"mp-public", types.ObjectCannedACLPublicRead, true}, {"mp-private", "", false}} {
		up, err := e.s3.CreateMultipartUpload(ctx, &s3.CreateMultipartUploadInput{Bucket: b, Key: aws.String(c.key), ACL: c.acl})
		if err != nil {
			t.Fatal(err)
		}
		code, body := e.anon(t, "GET", "/acl-mp/"+c.key, "")
		wantHTTP(t, "anonymous GET before Complete", code, body, 403, "AccessDenied")
		part, err := e.s3.UploadPart(ctx, &s3.UploadPartInput{Bucket: b, Key: aws.String(c.key), UploadId: up.UploadId, PartNumber: aws.Int32(1),
			Body: strings.NewReader("multipart " + c.key)})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.s3.CompleteMultipartUpload(ctx, &s3.CompleteMultipartUploadInput{Bucket: b, Key: aws.String(c.key), UploadId: up.UploadId,
			MultipartUpload: &types.CompletedMultipartUpload{Parts: []types.CompletedPart{{PartNumber: aws.Int32(1), ETag: part.ETag}}}}); err != nil {
			t.Fatal(err)
		}
		code, body = e.anon(t, "GET", "/acl-mp/"+c.key, "")
		if c.public && (code != 200 || body != "multipart "+c.key) || !c.public && code != 403 {
			t.Fatalf("anonymous GET of %s (public %v): %d %q", c.key, c.public, code, body)
		}
	}
	// A writer the bucket policy lets put objects and nothing else (no
	// listing of parts) completes uploads; one with an ACL is refused at
	// once, not completed without it.
	carol := e.keyFor(t, "AKIDACLCAROL", "acl-carol", false)
	if _, err := e.s3.PutBucketPolicy(ctx, &s3.PutBucketPolicyInput{Bucket: b, Policy: aws.String(`{"Version":"2012-10-17","Statement":[{"Effect":"Allow",
		"Principal":{"AWS":["acl-carol"]},"Action":"s3:PutObject","Resource":"arn:aws:s3:::acl-mp/drop/*"}]}`)}); err != nil {
		t.Fatal(err)
	}
	up, err := carol.CreateMultipartUpload(ctx, &s3.CreateMultipartUploadInput{Bucket: b, Key: aws.String("drop/f")})
	if err != nil {
		t.Fatal(err)
	}
	part, err := carol.UploadPart(ctx, &s3.UploadPartInput{Bucket: b, Key: aws.String("drop/f"), UploadId: up.UploadId, PartNumber: aws.Int32(1),
		Body: strings.NewReader("dropped")})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := carol.CompleteMultipartUpload(ctx, &s3.CompleteMultipartUploadInput{Bucket: b, Key: aws.String("drop/f"), UploadId: up.UploadId,
		MultipartUpload: &types.CompletedMultipartUpload{Parts: []types.CompletedPart{{PartNumber: aws.Int32(1), ETag: part.ETag}}}}); err != nil {
		t.Fatalf("PutObject-only writer completing an upload: %v", err)
	}
	if got := e.get(t, "acl-mp", "drop/f"); string(got) != "dropped" {
		t.Fatalf("completed upload: %q", got)
	}
	_, err = carol.CreateMultipartUpload(ctx, &s3.CreateMultipartUploadInput{Bucket: b, Key: aws.String("drop/g"), ACL: types.ObjectCannedACLPublicRead})
	wantCode(t, err, "AccessDenied", 403)
	ups, err := e.s3.ListMultipartUploads(ctx, &s3.ListMultipartUploadsInput{Bucket: b})
	if err != nil {
		t.Fatal(err)
	}
	if len(ups.Uploads) != 0 {
		t.Fatalf("uploads left: %+v", ups.Uploads)
	}
}

func (e *env) testBucketPolicy(t *testing.T) {
	ctx := e.ctx
	e.mkBucket(t, "pol")
	b := aws.String("pol")
	e.put(t, "pol", "public/a.txt", []byte("public a"))
	e.put(t, "pol", "secret/b.txt", []byte("secret b"))
	_, err := e.s3.GetBucketPolicy(ctx, &s3.GetBucketPolicyInput{Bucket: b})
	wantCode(t, err, "NoSuchBucketPolicy", 404)
	st, err := e.s3.GetBucketPolicyStatus(ctx, &s3.GetBucketPolicyStatusInput{Bucket: b})
	if err != nil {
		t.Fatal(err)
	}
	if aws.ToBool(st.PolicyStatus.IsPublic) {
		t.Fatal("a bucket without a policy is public")
	}
	_, err = e.s3.PutBucketPolicy(ctx, &s3.PutBucketPolicyInput{Bucket: b, Policy: aws.String(`{"Version":"2012-10-17","Statement":[{"Effect":"Allow"`)})
	wantCode(t, err, "MalformedPolicy", 400)
	_, err = e.s3.PutBucketPolicy(ctx, &s3.PutBucketPolicyInput{Bucket: b, Policy: aws.String(`{"Version":"2012-10-17","Statement":[{"Effect":"Perhaps","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::pol/*"}]}`)})
	wantCode(t, err, "MalformedPolicy", 400)

	policy := `{"Version":"2012-10-17","Statement":[{"Sid":"PublicRead","Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::pol/public/*"}]}`
	if _, err := e.s3.PutBucketPolicy(ctx, &s3.PutBucketPolicyInput{Bucket: b, Policy: aws.String(policy)}); err != nil {
		t.Fatal(err)
	}
	got, err := e.s3.GetBucketPolicy(ctx, &s3.GetBucketPolicyInput{Bucket: b})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(aws.ToString(got.Policy), "PublicRead") {
		t.Fatalf("policy read back: %s", aws.ToString(got.Policy))
	}
	st, err = e.s3.GetBucketPolicyStatus(ctx, &s3.GetBucketPolicyStatusInput{Bucket: b})
	if err != nil {
		t.Fatal(err)
	}
	if !aws.ToBool(st.PolicyStatus.IsPublic) {
		t.Fatal("a bucket whose policy lets anyone read is not public")
	}
	if code, body := e.anon(t, "GET", "/pol/public/a.txt", ""); code != 200 || body != "public a" {
		t.Fatalf("anonymous GET under public/: %d %q", code, body)
	}
	code, body := e.anon(t, "GET", "/pol/secret/b.txt", "")
	wantHTTP(t, "anonymous GET outside public/", code, body, 403, "AccessDenied")
	code, body = e.anon(t, "PUT", "/pol/public/c.txt", "x")
	wantHTTP(t, "anonymous PUT under public/", code, body, 403, "AccessDenied")
	code, body = e.anon(t, "GET", "/pol", "")
	wantHTTP(t, "anonymous listing", code, body, 403, "AccessDenied")

	// Block Public Access: RestrictPublicBuckets stops the public policy.
	_, err = e.s3.GetPublicAccessBlock(ctx, &s3.GetPublicAccessBlockInput{Bucket: b})
	wantCode(t, err, "NoSuchPublicAccessBlockConfiguration", 404)
	if _, err := e.s3.PutPublicAccessBlock(ctx, &s3.PutPublicAccessBlockInput{Bucket: b, PublicAccessBlockConfiguration: &types.PublicAccessBlockConfiguration{
		BlockPublicAcls: aws.Bool(true), IgnorePublicAcls: aws.Bool(true), BlockPublicPolicy: aws.Bool(true), RestrictPublicBuckets: aws.Bool(true)}}); err != nil {
		t.Fatal(err)
	}
	pab, err := e.s3.GetPublicAccessBlock(ctx, &s3.GetPublicAccessBlockInput{Bucket: b})
	if err != nil {
		t.Fatal(err)
	}
	if c := pab.PublicAccessBlockConfiguration; !aws.ToBool(c.BlockPublicAcls) || !aws.ToBool(c.IgnorePublicAcls) || !aws.ToBool(c.BlockPublicPolicy) || !aws.ToBool(c.RestrictPublicBuckets) {
		t.Fatalf("public access block read back: %+v", c)
	}
	code, body = e.anon(t, "GET", "/pol/public/a.txt", "")
	wantHTTP(t, "anonymous GET with RestrictPublicBuckets", code, body, 403, "AccessDenied")
	// BlockPublicPolicy refuses a new public policy; BlockPublicAcls a
	// public ACL.
	_, err = e.s3.PutBucketPolicy(ctx, &s3.PutBucketPolicyInput{Bucket: b, Policy: aws.String(policy)})
	wantCode(t, err, "AccessDenied", 403)
	_, err = e.s3.PutObject(ctx, &s3.PutObjectInput{Bucket: b, Key: aws.String("public/d.txt"), Body: strings.NewReader("x"), ACL: types.ObjectCannedACLPublicRead})
	wantCode(t, err, "AccessDenied", 403)
	if _, err := e.s3.DeletePublicAccessBlock(ctx, &s3.DeletePublicAccessBlockInput{Bucket: b}); err != nil {
		t.Fatal(err)
	}
	if code, body := e.anon(t, "GET", "/pol/public/a.txt", ""); code != 200 || body != "public a" {
		t.Fatalf("anonymous GET after DeletePublicAccessBlock: %d %q", code, body)
	}
	// Deleting the policy makes the bucket private again.
	if _, err := e.s3.DeleteBucketPolicy(ctx, &s3.DeleteBucketPolicyInput{Bucket: b}); err != nil {
		t.Fatal(err)
	}
	_, err = e.s3.GetBucketPolicy(ctx, &s3.GetBucketPolicyInput{Bucket: b})
	wantCode(t, err, "NoSuchBucketPolicy", 404)
	code, body = e.anon(t, "GET", "/pol/public/a.txt", "")
	wantHTTP(t, "anonymous GET after DeleteBucketPolicy", code, body, 403, "AccessDenied")
	st, err = e.s3.GetBucketPolicyStatus(ctx, &s3.GetBucketPolicyStatusInput{Bucket: b})
	if err != nil {
		t.Fatal(err)
	}
	if aws.ToBool(st.PolicyStatus.IsPublic) {
		t.Fatal("public after its policy was deleted")
	}
}

// TestHTTPS: a gateway given a certificate serves HTTPS (the SDK with
// the custom CA works) and no plain HTTP.
func TestHTTPS(t *testing.T) {
	e := setup(t)
	dir := t.TempDir()
	caPEM, certFile, keyFile := makeServerCert(t, dir)
	gw, err := bs3.New(bs3.Config{Client: e.gcl, Listen: "127.0.0.1:0", TLSCertFile: certFile, TLSKeyFile: keyFile})
	if err != nil {
		t.Fatal(err)
	}
	go gw.Serve()
	t.Cleanup(func() { gw.Close() })
	if !gw.TLS() {
		t.Fatal("the gateway does not say it serves TLS")
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	c := s3.New(s3.Options{Region: region, BaseEndpoint: aws.String("https://" + gw.Addr()), UsePathStyle: true, RetryMaxAttempts: 1, HTTPClient: hc,
		Credentials: credentials.NewStaticCredentialsProvider(accessKey, secretKey, "")})
	ctx := context.Background()
	if _, err := c.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: aws.String("tls-bucket")}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.PutObject(ctx, &s3.PutObjectInput{Bucket: aws.String("tls-bucket"), Key: aws.String("k"), Body: strings.NewReader("over tls")}); err != nil {
		t.Fatal(err)
	}
	out, err := c.GetObject(ctx, &s3.GetObjectInput{Bucket: aws.String("tls-bucket"), Key: aws.String("k")})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(out.Body)
	out.Body.Close()
	if string(b) != "over tls" {
		t.Fatalf("read %q over TLS", b)
	}
	// Without the CA: refused by the client.
	bad := s3.New(s3.Options{Region: region, BaseEndpoint: aws.String("https://" + gw.Addr()), UsePathStyle: true, RetryMaxAttempts: 1,
		Credentials: credentials.NewStaticCredentialsProvider(accessKey, secretKey, "")})
	if _, err := bad.ListBuckets(ctx, &s3.ListBucketsInput{}); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("a client without the CA: %v", err)
	}
	// Plain HTTP on the same port gets no S3 answer.
	resp, err := (&http.Client{Timeout: 30 * time.Second}).Get("http://" + gw.Addr() + "/tls-bucket/k")
	if err == nil {
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 400 || strings.Contains(string(body), "over tls") {
			t.Fatalf("plain HTTP to the HTTPS gateway: %d %s", resp.StatusCode, body)
		}
	}
	// Policy conditions see the transport and the client's address.
	e.testRequestInfo(t, hc, "https://"+gw.Addr())
	// A certificate without its key is refused at start.
	if _, err := bs3.New(bs3.Config{Client: e.gcl, Listen: "127.0.0.1:0", TLSCertFile: certFile}); err == nil {
		t.Fatal("a certificate without a key was accepted")
	}
}

// makeServerCert writes a CA-signed certificate for 127.0.0.1 and its
// key; it returns the CA's PEM.
func makeServerCert(t *testing.T, dir string) (caPEM []byte, certFile, keyFile string) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"}, NotBefore: time.Now().Add(-time.Hour),
		NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "s3 gateway"}, NotBefore: time.Now().Add(-time.Hour),
		NotAfter: time.Now().Add(time.Hour), IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600); err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), certFile, keyFile
}

// testRequestInfo: aws:SecureTransport and aws:SourceIp reach the
// namespace's policy evaluation. X-Forwarded-For counts only from a
// trusted proxy.
func (e *env) testRequestInfo(t *testing.T, tlsClient *http.Client, tlsURL string) {
	ctx := e.ctx
	e.mkBucket(t, "reqinfo")
	e.put(t, "reqinfo", "tls/a", []byte("secure only"))
	e.put(t, "reqinfo", "ip/a", []byte("from 10.9.9.9"))
	policy := `{"Version":"2012-10-17","Statement":[
	 {"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::reqinfo/tls/*","Condition":{"Bool":{"aws:SecureTransport":"true"}}},
	 {"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::reqinfo/ip/*","Condition":{"IpAddress":{"aws:SourceIp":"10.9.9.0/24"}}}]}`
	if _, err := e.s3.PutBucketPolicy(ctx, &s3.PutBucketPolicyInput{Bucket: aws.String("reqinfo"), Policy: aws.String(policy)}); err != nil {
		t.Fatal(err)
	}
	get := func(c *http.Client, base, path, xff string) (int, string) {
		t.Helper()
		r, _ := http.NewRequest("GET", base+path, nil)
		if xff != "" {
			r.Header.Set("X-Forwarded-For", xff)
		}
		resp, err := c.Do(r)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	plain := &http.Client{Timeout: 30 * time.Second}
	if code, body := get(tlsClient, tlsURL, "/reqinfo/tls/a", ""); code != 200 || body != "secure only" {
		t.Fatalf("anonymous GET over TLS: %d %q", code, body)
	}
	code, body := get(plain, e.url, "/reqinfo/tls/a", "")
	wantHTTP(t, "anonymous GET over plain HTTP of a TLS-only object", code, body, 403, "AccessDenied")
	// The gateway trusts no proxy: the header is the client's word.
	code, body = get(plain, e.url, "/reqinfo/ip/a", "10.9.9.9")
	wantHTTP(t, "X-Forwarded-For to a gateway trusting no proxy", code, body, 403, "AccessDenied")
	proxied, err := bs3.New(bs3.Config{Client: e.gcl, Listen: "127.0.0.1:0", TrustedProxies: []string{"127.0.0.1"}})
	if err != nil {
		t.Fatal(err)
	}
	go proxied.Serve()
	t.Cleanup(func() { proxied.Close() })
	purl := "http://" + proxied.Addr()
	if code, body := get(plain, purl, "/reqinfo/ip/a", "10.9.9.9"); code != 200 || body != "from 10.9.9.9" {
		t.Fatalf("anonymous GET through a trusted proxy for 10.9.9.9: %d %q", code, body)
	}
	code, body = get(plain, purl, "/reqinfo/ip/a", "10.8.0.1")
	wantHTTP(t, "anonymous GET through a trusted proxy for another address", code, body, 403, "AccessDenied")
	code, body = get(plain, purl, "/reqinfo/ip/a", "")
	wantHTTP(t, "anonymous GET from the proxy itself", code, body, 403, "AccessDenied")
}

// testExpectedOwnerProbe: X-Amz-Expected-Bucket-Owner does not tell a
// requester the bucket does not serve whether its guess of the owner is
// right: the right and a wrong guess get the same plain Access Denied.
// A requester the bucket serves (a public-read object) gets it as S3
// does: served if the owner matches, 403 if not; the owner is told why.
// Fails on the old code: a wrong guess answered "the bucket's owner is
// not the expected bucket owner", a right one the namespace's refusal.
func (e *env) testExpectedOwnerProbe(t *testing.T) {
	ctx := e.ctx
	alice := e.keyFor(t, "AKIDPROBEALICE", "probe-alice", false)
	b := aws.String("probe-private")
	if _, err := alice.CreateBucket(ctx, &s3.CreateBucketInput{Bucket: b}); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"secret", "public"} {
		in := &s3.PutObjectInput{Bucket: b, Key: aws.String(k), Body: strings.NewReader(k + " data")}
		if k == "public" {
			in.ACL = types.ObjectCannedACLPublicRead
		}
		if _, err := alice.PutObject(ctx, in); err != nil {
			t.Fatal(err)
		}
	}
	anon := func(method, path, owner string) (int, string) {
		t.Helper()
		r, err := http.NewRequest(method, e.url+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		r.Header.Set("X-Amz-Expected-Bucket-Owner", owner)
		resp, err := http.DefaultClient.Do(r)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		// The request ID differs per request: compare the rest.
		s := string(body)
		if i, j := strings.Index(s, "<RequestId>"), strings.Index(s, "</RequestId>"); i >= 0 && j > i {
			s = s[:i] + s[j:]
		}
		return resp.StatusCode, s
	}
	for _, path := range []string{"/probe-private/secret", "/probe-private?list-type=2", "/probe-private?acl"} {
		rc, rb := anon("GET", path, "probe-alice")
		wc, wb := anon("GET", path, "probe-mallory")
		if rc != 403 || wc != 403 || rb != wb {
			t.Fatalf("anonymous GET %s: right owner %d %q, wrong owner %d %q: want the same 403", path, rc, rb, wc, wb)
		}
	}
	if code, body := anon("GET", "/probe-private/public", "probe-alice"); code != 200 || body != "public data" {
		t.Fatalf("anonymous GET of a public-read object, right owner: %d %q", code, body)
	}
	if code, _ := anon("GET", "/probe-private/public", "probe-mallory"); code != 403 {
		t.Fatalf("anonymous GET of a public-read object, wrong owner: %d, want 403", code)
	}
	_, err := alice.GetObject(ctx, &s3.GetObjectInput{Bucket: b, Key: aws.String("secret"), ExpectedBucketOwner: aws.String("probe-mallory")})
	wantCode(t, err, "AccessDenied", 403)
}
