package namespace

import (
	"context"
	"slices"
	"strings"
	"sync"
	"unicode"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/policy"
)

// Access control lists, bucket policies and Block Public Access (see
// docs/SECURITY.md for the model; authz.go applies them).
//
// ACLs are stored with what they protect: Volume.acls, Bucket.acls,
// KeyInfo.acls (object keys and fs files), FsEntry.acls (fs directories).
// A bucket's policy and Block Public Access settings are stored in its
// row (Bucket.policy, Bucket.public_access_block) and returned only by
// their own RPCs. Every change is one Raft apply, validated before it is
// proposed and re-checked in Apply.

// Limits of an ACL.
const (
	MaxAclEntries   = 64
	MaxAclNameBytes = 128
)

const aclAllRights = uint32(metapb.AclRight_ACL_ALL)

// validateAcls checks entries a request would store or change.
func validateAcls(acls []*metapb.Acl, what string) error {
	if len(acls) > MaxAclEntries {
		return invalid("%s: %d ACL entries, at most %d", what, len(acls), MaxAclEntries)
	}
	for i, e := range acls {
		if e == nil {
			return invalid("%s: ACL entry %d is empty", what, i+1)
		}
		switch e.Type {
		case metapb.AclType_ACL_USER, metapb.AclType_ACL_GROUP:
			if e.Name == "" || len(e.Name) > MaxAclNameBytes || !utf8.ValidString(e.Name) ||
				strings.ContainsFunc(e.Name, func(r rune) bool { return unicode.IsControl(r) || unicode.IsSpace(r) || r == ':' || r == ',' }) {
				return invalid("%s: ACL entry %d: %s name %.64q: want 1 to %d bytes of UTF-8 without spaces, ':' or ','",
					what, i+1, aclTypeName(e.Type), e.Name, MaxAclNameBytes)
			}
		case metapb.AclType_ACL_WORLD, metapb.AclType_ACL_ANONYMOUS:
			if e.Name != "" {
				return invalid("%s: ACL entry %d: %s entries take no name (got %.64q)", what, i+1, aclTypeName(e.Type), e.Name)
			}
		default:
			return invalid("%s: ACL entry %d: unknown type %d", what, i+1, e.Type)
		}
		if e.Rights == 0 || e.Rights&^aclAllRights != 0 {
			return invalid("%s: ACL entry %d: rights %#x: want a non-empty set of ACL_READ..ACL_WRITE_ACL (at most %#x)", what, i+1, e.Rights, aclAllRights)
		}
	}
	return nil
}

func aclTypeName(t metapb.AclType) string {
	switch t {
	case metapb.AclType_ACL_USER:
		return "user"
	case metapb.AclType_ACL_GROUP:
		return "group"
	case metapb.AclType_ACL_WORLD:
		return "world"
	case metapb.AclType_ACL_ANONYMOUS:
		return "anonymous"
	}
	return "?"
}

// applyAclOp returns old changed by op with change: entries are keyed by
// (type, name); REPLACE merges duplicates, ADD ORs rights in, REMOVE
// clears them and drops entries left with none.
func applyAclOp(old []*metapb.Acl, op metapb.AclOp, change []*metapb.Acl) ([]*metapb.Acl, error) {
	var out []*metapb.Acl
	if op != metapb.AclOp_ACL_REPLACE {
		for _, e := range old {
			out = append(out, proto.Clone(e).(*metapb.Acl))
		}
	}
	find := func(e *metapb.Acl) int {
		return slices.IndexFunc(out, func(o *metapb.Acl) bool { return o.Type == e.Type && o.Name == e.Name })
	}
	for _, e := range change {
		i := find(e)
		switch op {
		case metapb.AclOp_ACL_REPLACE, metapb.AclOp_ACL_ADD:
			if i < 0 {
				out = append(out, &metapb.Acl{Type: e.Type, Name: e.Name, Rights: e.Rights})
			} else {
				out[i].Rights |= e.Rights
			}
		case metapb.AclOp_ACL_REMOVE:
			if i >= 0 {
				out[i].Rights &^= e.Rights
				if out[i].Rights == 0 {
					out = slices.Delete(out, i, i+1)
				}
			}
		default:
			return nil, invalid("set ACL: unknown operation %d", op)
		}
	}
	if len(out) > MaxAclEntries {
		return nil, invalid("set ACL: the result would have %d entries, at most %d", len(out), MaxAclEntries)
	}
	return out, nil
}

// publicAcl reports whether acls grant anything to WORLD or ANONYMOUS.
func publicAcl(acls []*metapb.Acl) bool {
	return slices.ContainsFunc(acls, func(e *metapb.Acl) bool {
		return e.Type == metapb.AclType_ACL_WORLD || e.Type == metapb.AclType_ACL_ANONYMOUS
	})
}

func blockedPublicAcl(b *metapb.Bucket, acls []*metapb.Acl, what string) error {
	if b.GetPublicAccessBlock().GetBlockPublicAcls() && publicAcl(acls) {
		return status.Errorf(codes.PermissionDenied, "%s: bucket %q blocks public ACLs (Block Public Access: BlockPublicAcls); WORLD and ANONYMOUS entries are refused", what, b.Name)
	}
	return nil
}

func checkObjectRef(r *metapb.ObjectRef) error {
	if r == nil {
		return invalid("no object named (ref)")
	}
	if err := checkNameBound("volume", r.Volume, 63); err != nil {
		return err
	}
	if r.Bucket == "" {
		if r.Key != "" {
			return invalid("a key needs a bucket")
		}
		return nil
	}
	if err := checkNameBound("bucket", r.Bucket, 63); err != nil {
		return err
	}
	if r.Key != "" {
		return checkKeyRef(r.Key)
	}
	return nil
}

func refString(r *metapb.ObjectRef) string {
	s := "/" + r.Volume
	if r.Bucket != "" {
		s += "/" + r.Bucket
	}
	if r.Key != "" {
		s += "/" + r.Key
	}
	return s
}

// ---------------------------------------------------------------- apply

// aclTarget reads the ACL of what ref names in the batch and returns it
// with a function that stores a new one.
func (t *tx) aclTarget(ref *metapb.ObjectRef) (owner string, acls []*metapb.Acl, b *metapb.Bucket, store func([]*metapb.Acl), err error) {
	if ref.Bucket == "" {
		v := &metapb.Volume{}
		if !t.get(volumeKey(ref.Volume), v) {
			return "", nil, nil, nil, noSuchVolume(ref.Volume)
		}
		return volumeOwner(v), v.Acls, nil, func(a []*metapb.Acl) { v.Acls = a; t.put(volumeKey(ref.Volume), v) }, nil
	}
	b, err = t.bucket(ref.Volume, ref.Bucket)
	if err != nil {
		return "", nil, nil, nil, err
	}
	if ref.Key == "" {
		return BucketOwner(b), b.Acls, b, func(a []*metapb.Acl) {
			b.Acls = a
			t.put(bucketKey(ref.Volume, ref.Bucket), b)
			t.bucketsChanged = true
		}, nil
	}
	if b.Layout != metapb.BucketLayout_FS {
		ki := &metapb.KeyInfo{}
		if !t.get(objKey(b.Id, ref.Key), ki) {
			return "", nil, nil, nil, noSuchKey(ref.Bucket, ref.Key)
		}
		return BucketOwner(b), ki.Acls, b, func(a []*metapb.Acl) { ki.Acls = a; t.put(objKey(b.Id, ref.Key), ki) }, nil
	}
	parts, err := SplitPath(ref.Key, false)
	if err != nil {
		return "", nil, nil, nil, err
	}
	parent, e, err := resolve(t.b, b, parts, ref.Key)
	if err != nil {
		return "", nil, nil, nil, err
	}
	if e == nil {
		return "", nil, nil, nil, noSuchKey(ref.Bucket, ref.Key)
	}
	owner, _ = entryOwnerMode(b, e)
	k := fsKey(b.Id, parent, parts[len(parts)-1])
	if e.IsDir {
		return owner, e.Acls, b, func(a []*metapb.Acl) { e.Acls = a; t.put(k, e) }, nil
	}
	return owner, e.File.Acls, b, func(a []*metapb.Acl) { e.File.Acls = a; t.put(k, e) }, nil
}

func (t *tx) setAcl(req *metapb.SetAclRequest) any {
	if err := checkObjectRef(req.Ref); err != nil {
		return err
	}
	if err := validateAcls(req.Acls, "set ACL of "+refString(req.Ref)); err != nil {
		return err
	}
	owner, old, b, store, err := t.aclTarget(req.Ref)
	if err != nil {
		return err
	}
	if b != nil && req.Op != metapb.AclOp_ACL_REMOVE {
		if err := blockedPublicAcl(b, req.Acls, "set ACL of "+refString(req.Ref)); err != nil {
			return err
		}
	}
	acls, err := applyAclOp(old, req.Op, req.Acls)
	if err != nil {
		return err
	}
	store(acls)
	return &metapb.AclList{Owner: owner, Acls: acls}
}

func (t *tx) setBucketPolicy(req *metapb.BucketPolicy) any {
	b, err := t.bucket(req.Volume, req.Bucket)
	if err != nil {
		return err
	}
	if req.Policy != "" {
		p, err := parseBucketPolicy(req.Policy, req.Bucket)
		if err != nil {
			return err
		}
		if b.GetPublicAccessBlock().GetBlockPublicPolicy() && p.IsPublic() {
			return status.Errorf(codes.PermissionDenied, "bucket %q blocks public policies (Block Public Access: BlockPublicPolicy); this policy grants access to everyone", req.Bucket)
		}
	}
	b.Policy = req.Policy
	t.put(bucketKey(req.Volume, req.Bucket), b)
	t.bucketsChanged = true
	return &metapb.BucketPolicy{Volume: req.Volume, Bucket: req.Bucket, Policy: req.Policy}
}

func (t *tx) setPublicAccessBlock(req *metapb.PublicAccessBlockConfig) any {
	b, err := t.bucket(req.Volume, req.Bucket)
	if err != nil {
		return err
	}
	b.PublicAccessBlock = req.Config
	if proto.Equal(req.Config, &metapb.PublicAccessBlock{}) {
		b.PublicAccessBlock = nil
	}
	t.put(bucketKey(req.Volume, req.Bucket), b)
	t.bucketsChanged = true
	return &metapb.PublicAccessBlockConfig{Volume: req.Volume, Bucket: req.Bucket, Config: b.PublicAccessBlock}
}

// parseBucketPolicy validates a policy document for bucket.
func parseBucketPolicy(doc, bucket string) (*policy.Policy, error) {
	p, err := policy.Parse([]byte(doc))
	if err == nil {
		err = p.CheckBucket(bucket)
	}
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	return p, nil
}

// ---------------------------------------------------------------- policy cache

// policyCache keeps parsed policies by document: a bucket with a policy
// pays the JSON parse once, not per request. Bounded; past the bound it
// starts over.
type policyCache struct {
	mu sync.RWMutex
	m  map[string]*policy.Policy
}

const maxCachedPolicies = 1024

func (c *policyCache) get(doc string) (*policy.Policy, error) {
	c.mu.RLock()
	p := c.m[doc]
	c.mu.RUnlock()
	if p != nil {
		return p, nil
	}
	p, err := policy.Parse([]byte(doc))
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	if c.m == nil || len(c.m) >= maxCachedPolicies {
		c.m = map[string]*policy.Policy{}
	}
	c.m[doc] = p
	c.mu.Unlock()
	return p, nil
}

// ---------------------------------------------------------------- service

// GetAcl returns the ACL of a volume, bucket or key with its owner.
func (s *Service) GetAcl(ctx context.Context, req *metapb.GetAclRequest) (*metapb.AclList, error) {
	if err := checkObjectRef(req.Ref); err != nil {
		return nil, err
	}
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	az := s.authz(ctx)
	owner, acls, err := az.objectAcl(req.Ref)
	if err != nil {
		return nil, err
	}
	if err := az.Acl(req.Ref, false); err != nil {
		return nil, err
	}
	return &metapb.AclList{Owner: owner, Acls: acls}, nil
}

// SetAcl replaces, adds to or removes from an ACL in one Raft apply.
func (s *Service) SetAcl(ctx context.Context, req *metapb.SetAclRequest) (*metapb.AclList, error) {
	if err := checkObjectRef(req.Ref); err != nil {
		return nil, err
	}
	if req.Op != metapb.AclOp_ACL_REPLACE && req.Op != metapb.AclOp_ACL_ADD && req.Op != metapb.AclOp_ACL_REMOVE {
		return nil, invalid("set ACL: unknown operation %d", req.Op)
	}
	if err := validateAcls(req.Acls, "set ACL of "+refString(req.Ref)); err != nil {
		return nil, err
	}
	if err := s.current(ctx); err != nil {
		return nil, err
	}
	if err := s.authz(ctx).Acl(req.Ref, true); err != nil {
		return nil, err
	}
	if req.Ref.Bucket != "" && req.Op != metapb.AclOp_ACL_REMOVE {
		b, err := s.st.cachedBucket(req.Ref.Volume, req.Ref.Bucket)
		if err != nil {
			return nil, err
		}
		if err := blockedPublicAcl(b, req.Acls, "set ACL of "+refString(req.Ref)); err != nil {
			return nil, err
		}
	}
	r, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_SetAcl{SetAcl: req}})
	if err != nil {
		return nil, err
	}
	return r.(*metapb.AclList), nil
}

// GetBucketPolicy returns the bucket's policy ("" if none).
func (s *Service) GetBucketPolicy(ctx context.Context, req *metapb.BucketRef) (*metapb.BucketPolicy, error) {
	if err := checkBucketRef(req.Volume, req.Bucket); err != nil {
		return nil, err
	}
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	b, err := s.authz(ctx).BucketConfig(req.Volume, req.Bucket, "s3:GetBucketPolicy")
	if err != nil {
		return nil, err
	}
	return &metapb.BucketPolicy{Volume: req.Volume, Bucket: req.Bucket, Policy: b.Policy}, nil
}

// SetBucketPolicy validates and stores a policy ("" deletes it).
func (s *Service) SetBucketPolicy(ctx context.Context, req *metapb.BucketPolicy) (*metapb.BucketPolicy, error) {
	if err := checkBucketRef(req.Volume, req.Bucket); err != nil {
		return nil, err
	}
	action := "s3:PutBucketPolicy"
	if req.Policy == "" {
		action = "s3:DeleteBucketPolicy"
	} else {
		p, err := parseBucketPolicy(req.Policy, req.Bucket)
		if err != nil {
			return nil, err
		}
		b, err := s.st.cachedBucket(req.Volume, req.Bucket)
		if err != nil {
			return nil, err
		}
		if b.GetPublicAccessBlock().GetBlockPublicPolicy() && p.IsPublic() {
			return nil, status.Errorf(codes.PermissionDenied, "bucket %q blocks public policies (Block Public Access: BlockPublicPolicy); this policy grants access to everyone", req.Bucket)
		}
	}
	if err := s.current(ctx); err != nil {
		return nil, err
	}
	if _, err := s.authz(ctx).BucketConfig(req.Volume, req.Bucket, action); err != nil {
		return nil, err
	}
	r, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_SetBucketPolicy{SetBucketPolicy: req}})
	if err != nil {
		return nil, err
	}
	return r.(*metapb.BucketPolicy), nil
}

// GetBucketPolicyStatus reports whether the bucket's policy is public.
func (s *Service) GetBucketPolicyStatus(ctx context.Context, req *metapb.BucketRef) (*metapb.BucketPolicyStatus, error) {
	if err := checkBucketRef(req.Volume, req.Bucket); err != nil {
		return nil, err
	}
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	b, err := s.authz(ctx).BucketConfig(req.Volume, req.Bucket, "s3:GetBucketPolicyStatus")
	if err != nil {
		return nil, err
	}
	if b.Policy == "" {
		return &metapb.BucketPolicyStatus{}, nil
	}
	p, err := s.pols.get(b.Policy)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "stored policy of bucket %q: %v", req.Bucket, err)
	}
	return &metapb.BucketPolicyStatus{IsPublic: p.IsPublic()}, nil
}

// GetPublicAccessBlock returns the bucket's Block Public Access settings.
func (s *Service) GetPublicAccessBlock(ctx context.Context, req *metapb.BucketRef) (*metapb.PublicAccessBlockConfig, error) {
	if err := checkBucketRef(req.Volume, req.Bucket); err != nil {
		return nil, err
	}
	if err := s.raft.ReadBarrier(ctx); err != nil {
		return nil, err
	}
	b, err := s.authz(ctx).BucketConfig(req.Volume, req.Bucket, "s3:GetBucketPublicAccessBlock")
	if err != nil {
		return nil, err
	}
	return &metapb.PublicAccessBlockConfig{Volume: req.Volume, Bucket: req.Bucket, Config: b.PublicAccessBlock}, nil
}

// SetPublicAccessBlock stores (or, config unset, deletes) the settings.
func (s *Service) SetPublicAccessBlock(ctx context.Context, req *metapb.PublicAccessBlockConfig) (*metapb.PublicAccessBlockConfig, error) {
	if err := checkBucketRef(req.Volume, req.Bucket); err != nil {
		return nil, err
	}
	if err := s.current(ctx); err != nil {
		return nil, err
	}
	if _, err := s.authz(ctx).BucketConfig(req.Volume, req.Bucket, "s3:PutBucketPublicAccessBlock"); err != nil {
		return nil, err
	}
	r, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_SetPublicAccessBlock{SetPublicAccessBlock: req}})
	if err != nil {
		return nil, err
	}
	return r.(*metapb.PublicAccessBlockConfig), nil
}

// publicBucket strips what only its own RPCs return from a bucket record.
func publicBucket(b *metapb.Bucket) {
	b.Policy = ""
	b.PublicAccessBlock = nil
}

// Volume and bucket records are visible to every authenticated user
// (names, owners, modes), but their ACLs only to whoever may read them
// (READ_ACL, or the owner): an ACL names users and groups.

// hideBucketAcl clears b's ACL unless the caller may read it.
func (s *Service) hideBucketAcl(ctx context.Context, b *metapb.Bucket) {
	if len(b.Acls) > 0 && s.authz(ctx).Acl(&metapb.ObjectRef{Volume: b.Volume, Bucket: b.Name}, false) != nil {
		b.Acls = nil
	}
}

// volumeForCaller is v, or a copy without its ACL if the caller may not
// read it.
func (s *Service) volumeForCaller(ctx context.Context, v *metapb.Volume) *metapb.Volume {
	if len(v.Acls) == 0 || s.authz(ctx).Acl(&metapb.ObjectRef{Volume: v.Name}, false) == nil {
		return v
	}
	v = proto.Clone(v).(*metapb.Volume)
	v.Acls = nil
	return v
}
