package namespace

import (
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/policy"
)

// ACL rights asked for.
const (
	rightRead     = uint32(metapb.AclRight_ACL_READ)
	rightWrite    = uint32(metapb.AclRight_ACL_WRITE)
	rightCreate   = uint32(metapb.AclRight_ACL_CREATE)
	rightList     = uint32(metapb.AclRight_ACL_LIST)
	rightDelete   = uint32(metapb.AclRight_ACL_DELETE)
	rightReadAcl  = uint32(metapb.AclRight_ACL_READ_ACL)
	rightWriteAcl = uint32(metapb.AclRight_ACL_WRITE_ACL)
)

// isOwner: owner names the (authenticated) caller.
func (a *Authorizer) isOwner(owner string) bool {
	return !a.c.Anonymous && owner != "" && owner == a.c.User
}

// aclGrants reports whether the entries of acls that match the caller
// together hold every bit of right. ignorePublic (IgnorePublicAcls)
// makes WORLD and ANONYMOUS entries grant nothing.
func (a *Authorizer) aclGrants(acls []*metapb.Acl, right uint32, ignorePublic bool) bool {
	var got uint32
	for _, e := range acls {
		switch e.Type {
		case metapb.AclType_ACL_USER:
			if !a.c.Anonymous && e.Name == a.c.User {
				got |= e.Rights
			}
		case metapb.AclType_ACL_GROUP:
			if !a.c.Anonymous && slices.Contains(a.c.Groups, e.Name) {
				got |= e.Rights
			}
		case metapb.AclType_ACL_WORLD:
			if !a.c.Anonymous && !ignorePublic {
				got |= e.Rights
			}
		case metapb.AclType_ACL_ANONYMOUS:
			if a.c.Anonymous && !ignorePublic {
				got |= e.Rights
			}
		}
	}
	return got&right == right
}

// policyAllows evaluates b's policy (if any) for action on key ("": the
// bucket). An explicit Deny is an error (admins never get here); an
// Allow is true, except that with RestrictPublicBuckets a public policy
// grants only the bucket's owner.
func (a *Authorizer) policyAllows(b *metapb.Bucket, action, key string, extra map[string]string) (bool, error) {
	if b.Policy == "" {
		return false, nil
	}
	p, err := a.pols.get(b.Policy)
	if err != nil {
		return false, nil // validated when stored; an unreadable one grants nothing
	}
	res := "arn:aws:s3:::" + b.Name
	if b.Layout == metapb.BucketLayout_FS {
		key = strings.TrimLeft(key, "/") // "/a/b" and "a/b" are one path
	}
	if key != "" {
		res += "/" + key
	}
	switch p.Evaluate(&policy.Request{User: a.c.User, Groups: a.c.Groups, Anonymous: a.c.Anonymous, Action: action, Resource: res, Context: a.policyContext(p, extra)}) {
	case policy.Deny:
		if key != "" {
			return false, a.deny("%s on %q: explicitly denied by the policy of bucket %q", action, key, b.Name)
		}
		return false, a.deny("%s: explicitly denied by the policy of bucket %q", action, b.Name)
	case policy.Allow:
		if b.GetPublicAccessBlock().GetRestrictPublicBuckets() && p.IsPublic() && !a.isOwner(BucketOwner(b)) {
			return false, nil
		}
		return true, nil
	}
	return false, nil
}

// policyContext is the values of the condition keys p tests for this
// call (only those: the others cost nothing).
func (a *Authorizer) policyContext(p *policy.Policy, extra map[string]string) map[string]string {
	m := make(map[string]string, 4)
	set := func(k, v string) {
		if p.UsesKey(k) {
			m[k] = v
		}
	}
	if p.UsesKey("aws:currenttime") || p.UsesKey("aws:epochtime") {
		now := time.Now()
		if a.now != nil {
			now = a.now()
		}
		set("aws:currenttime", now.UTC().Format(time.RFC3339))
		set("aws:epochtime", strconv.FormatInt(now.Unix(), 10))
	}
	if a.c.Anonymous {
		set("aws:principaltype", "Anonymous")
	} else {
		set("aws:principaltype", "User")
		set("aws:username", a.c.User)
	}
	if r := a.c.Request; r != nil {
		if r.SourceIP != "" {
			set("aws:sourceip", r.SourceIP)
		}
		set("aws:securetransport", strconv.FormatBool(r.SecureTransport))
		if r.UserAgent != "" {
			set("aws:useragent", r.UserAgent)
		}
		if r.Referer != "" {
			set("aws:referer", r.Referer)
		}
	}
	for k, v := range extra {
		set(k, v)
	}
	return m
}

// contentOp is one operation on a bucket or its contents, as the checks
// see it.
type contentOp struct {
	action string            // what the bucket policy sees (docs/SECURITY.md)
	key    string            // the policy's resource below the bucket ("" = the bucket)
	entry  string            // whose own ACL counts besides the bucket's ("" = none)
	right  uint32            // the ACL right that grants it
	create bool              // right is WRITE, and CREATE on the bucket grants it for a new entry
	extra  map[string]string // more condition keys (s3:prefix, ...)
}

// contents decides o on b: the policy's Deny refuses and its Allow
// grants; then owners and modes (modes()); then the bucket's ACL and the
// entry's own ACL (inheritance: a key's effective ACL is its own plus
// its bucket's).
func (a *Authorizer) contents(b *metapb.Bucket, o contentOp, modes func() error) error {
	ok, err := a.policyAllows(b, o.action, o.key, o.extra)
	if err != nil || ok {
		return err
	}
	a.quiet = true
	merr := modes()
	a.quiet = false
	if merr == nil || status.Code(merr) != codes.PermissionDenied {
		return merr
	}
	ignore := b.GetPublicAccessBlock().GetIgnorePublicAcls()
	if a.aclGrants(b.Acls, o.right, ignore) {
		return nil
	}
	if o.entry != "" || o.create {
		acls, exists, err := a.st.entryAcls(b, o.entry)
		if err != nil {
			return err
		}
		switch {
		case exists && a.aclGrants(acls, o.right, ignore):
			return nil
		case !exists && o.create && a.aclGrants(b.Acls, rightCreate, ignore):
			return nil
		}
	}
	if merr == errQuiet {
		merr = modes() // again, for the message
	}
	return merr
}

// entryAcls reads the own ACL of key in b (object key, fs file or
// directory) and whether it exists.
func (s *State) entryAcls(b *metapb.Bucket, key string) ([]*metapb.Acl, bool, error) {
	if key == "" {
		return nil, false, nil
	}
	var acls []*metapb.Acl
	exists := false
	err := s.view(func(r pebble.Reader) error {
		if b.Layout != metapb.BucketLayout_FS {
			ki, _, ok, err := s.readKey(r, b, key)
			acls, exists = ki.GetAcls(), ok
			return err
		}
		parts, err := SplitPath(key, true)
		if err != nil || len(parts) == 0 {
			return err
		}
		_, e, err := resolve(r, b, parts, key)
		if err != nil || e == nil {
			return nil // a missing parent: the entry does not exist
		}
		exists = true
		if e.IsDir {
			acls = e.Acls
		} else {
			acls = e.File.GetAcls()
		}
		return nil
	})
	return acls, exists, err
}

// ListAs checks a listing of a bucket (or an fs directory) for action
// (s3:ListBucket, s3:ListBucketMultipartUploads, ...): LIST.
func (a *Authorizer) ListAs(volume, bucket, dir, action string, extra map[string]string) error {
	if a.trusted {
		return nil
	}
	b, err := a.st.cachedBucket(volume, bucket)
	if err != nil {
		return err
	}
	if extra == nil && dir != "" {
		extra = map[string]string{"s3:prefix": dir}
	}
	return a.contents(b, contentOp{action: action, entry: dir, right: rightList, extra: extra}, func() error {
		if b.Layout != metapb.BucketLayout_FS || dir == "" {
			_, err := a.bucketModes(b, permR|permX, "list")
			return err
		}
		return a.fsPath(b, dir, 0, permR, "list "+strconv.Quote(dir))
	})
}

// change checks creating, overwriting or deleting key for action:
// object buckets w on the bucket, fs buckets w on the parent directory;
// ACLs: WRITE (or CREATE on the bucket for a new key), DELETE to delete.
func (a *Authorizer) change(volume, bucket, key, what, action string, del bool) error {
	if a.trusted {
		return nil
	}
	b, err := a.st.cachedBucket(volume, bucket)
	if err != nil {
		return err
	}
	what += " " + strconv.Quote(key)
	o := contentOp{action: action, key: key, entry: key, right: rightWrite, create: true}
	if del {
		o.right, o.create = rightDelete, false
	}
	return a.contents(b, o, func() error {
		if b.Layout != metapb.BucketLayout_FS {
			_, err := a.bucketModes(b, permW, what)
			return err
		}
		return a.createPath(b, key, what)
	})
}

// Delete checks deleting key (or renaming it away): DELETE.
func (a *Authorizer) Delete(volume, bucket, key, what string) error {
	return a.change(volume, bucket, key, what, "s3:DeleteObject", true)
}

// AbortUpload checks aborting a multipart upload of key.
func (a *Authorizer) AbortUpload(volume, bucket, key string) error {
	return a.change(volume, bucket, key, "abort an upload of", "s3:AbortMultipartUpload", false)
}

// objectAcl reads the owner and ACL of what ref names.
func (s *State) objectAcl(ref *metapb.ObjectRef) (owner string, acls []*metapb.Acl, err error) {
	err = s.view(func(r pebble.Reader) error {
		if ref.Bucket == "" {
			v := &metapb.Volume{}
			ok, err := get(r, volumeKey(ref.Volume), v)
			if err == nil && !ok {
				err = noSuchVolume(ref.Volume)
			}
			owner, acls = volumeOwner(v), v.Acls
			return err
		}
		b, err := readBucket(r, ref.Volume, ref.Bucket)
		if err != nil {
			return err
		}
		if ref.Key == "" {
			owner, acls = BucketOwner(b), b.Acls
			return nil
		}
		owner = BucketOwner(b)
		if b.Layout != metapb.BucketLayout_FS {
			ki := &metapb.KeyInfo{}
			ok, err := get(r, objKey(b.Id, ref.Key), ki)
			if err == nil && !ok {
				err = noSuchKey(ref.Bucket, ref.Key)
			}
			acls = ki.Acls
			return err
		}
		parts, err := SplitPath(ref.Key, false)
		if err != nil {
			return err
		}
		_, e, err := resolve(r, b, parts, ref.Key)
		if err != nil {
			return err
		}
		if e == nil {
			return noSuchKey(ref.Bucket, ref.Key)
		}
		owner, _ = entryOwnerMode(b, e)
		if e.IsDir {
			acls = e.Acls
		} else {
			acls = e.File.Acls
		}
		return nil
	})
	return owner, acls, err
}

// objectAcl is the ACL GetAcl returns (checked by Acl).
func (a *Authorizer) objectAcl(ref *metapb.ObjectRef) (string, []*metapb.Acl, error) {
	return a.st.objectAcl(ref)
}

// Acl checks reading (READ_ACL) or changing (WRITE_ACL) the ACL of what
// ref names: admins and the owner always may (a bucket policy's Deny
// still refuses the owner); else the ACL must grant it (a key's: its own
// or its bucket's) or the bucket policy allow s3:Get/Put(Bucket|Object)Acl.
func (a *Authorizer) Acl(ref *metapb.ObjectRef, write bool) error {
	if a.trusted {
		return nil
	}
	right, verb := rightReadAcl, "read the ACL of"
	if write {
		right, verb = rightWriteAcl, "change the ACL of"
	}
	if ref.Bucket == "" {
		v, err := a.st.GetVolume(ref.Volume)
		if err != nil {
			return err
		}
		if a.isOwner(volumeOwner(v)) || a.aclGrants(v.Acls, right, false) {
			return nil
		}
		return a.deny("%s volume %q (owner %q)", verb, ref.Volume, volumeOwner(v))
	}
	b, err := a.st.cachedBucket(ref.Volume, ref.Bucket)
	if err != nil {
		return err
	}
	action := map[[2]bool]string{{false, false}: "s3:GetBucketAcl", {false, true}: "s3:PutBucketAcl", {true, false}: "s3:GetObjectAcl", {true, true}: "s3:PutObjectAcl"}[[2]bool{ref.Key != "", write}]
	return a.contents(b, contentOp{action: action, key: ref.Key, entry: ref.Key, right: right}, func() error {
		owner, _, err := a.st.objectAcl(ref)
		if err != nil {
			return err
		}
		if a.isOwner(owner) {
			return nil
		}
		return a.deny("%s %q (owner %q)", verb, refString(ref), owner)
	})
}

// BucketConfig checks reading or changing a bucket's policy or Block
// Public Access settings (action): admins and the bucket's owner always
// may (so an owner can repair a policy that denies everyone), others only
// if the policy allows action. It returns the bucket row (shared: not to
// be modified).
func (a *Authorizer) BucketConfig(volume, bucket, action string) (*metapb.Bucket, error) {
	b, err := a.st.cachedBucket(volume, bucket)
	if err != nil || a.trusted || a.isOwner(BucketOwner(b)) {
		return b, err
	}
	ok, err := a.policyAllows(b, action, "", nil)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, a.deny("%s on bucket %q (its owner is %q)", action, bucket, BucketOwner(b))
	}
	return b, nil
}
