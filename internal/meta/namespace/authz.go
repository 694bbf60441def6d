package namespace

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Who may do what in the namespace (see docs/ARCHITECTURE.md, Security).
//
// Every RPC runs for a Caller, put into its context by the meta server
// from the client certificate (or, for a gateway, the end user it acts
// for). The Authorizer decides before anything is proposed:
//
//   - admins may do everything;
//   - volumes: create and delete are admin-only (a gateway in its own
//     name may create a volume: the S3 gateway's volume); attributes:
//     the volume's owner;
//   - buckets: created by whoever may write the volume (its owner; others
//     if the volume's mode grants write, as the S3 volume's 1777 does);
//     deleted by the bucket's owner or the volume's owner (sticky);
//   - volume and bucket records (Get/List) are visible to every
//     authenticated user: names, owners and modes, not contents;
//   - contents of an OBJECT bucket: read (lookup, list, parts) needs r on
//     the bucket, write (open, commit, delete, rename, copy, metadata,
//     multipart) needs w;
//   - an FS bucket is a POSIX tree: every directory on the way needs x
//     (the bucket is the root), listing a directory needs r on it,
//     reading a file r on the file, creating, deleting or renaming an
//     entry w on its parent directory; attributes may be changed by the
//     entry's owner, and only an admin gives an entry to someone else.
//
// Modes are FileAttrs.permission (owner/group/other rwx). The owner of a
// volume is Volume.owner (attrs.owner if set); of a bucket attrs.owner,
// else Bucket.owner; of an fs entry its attrs' owner, else the bucket's.
// Without a recorded mode: volumes 0755, OBJECT buckets 0700 (private,
// as S3), FS buckets and directories 0755, files 0644. The owner's bits
// apply to the owner, the group bits to members of the entry's group
// (FileAttrs.group, a file's hdfs-group; else the bucket's) by the meta
// nodes' mapping (basalt meta --groups), the other bits to everyone else.
//
// Beside owners and modes (authz_acl.go, docs/SECURITY.md): a bucket's
// policy is evaluated first (an explicit Deny refuses even the owner, an
// Allow grants), then owners and modes, then the ACLs (the bucket's plus
// the entry's own). Anonymous callers get nothing from modes.
//
// The check reads the committed state before proposing: a change of
// owner or mode racing with a request may let that one request through
// under the old rule, as in HDFS.

// Caller is who an RPC runs for.
type Caller struct {
	User  string // the authenticated user (or the end user a gateway acts for)
	Admin bool   // may do everything
	// Gateway: a gateway acting in its own name (no end user): it may read
	// S3 secrets and create volumes, and is otherwise an ordinary user.
	Gateway bool
	// Groups are the user's groups (basalt meta --groups): ACL entries of
	// type GROUP and policy principals "group:<name>" match them.
	Groups []string
	// Anonymous: a gateway acts for an unauthenticated requester (an S3
	// request without credentials). User is "". Only ACL entries of type
	// ANONYMOUS and policies granting to "*" give it anything; modes do not.
	Anonymous bool
	// Request is what the gateway (or the connection) says about the
	// request, for bucket policy conditions; nil: nothing known.
	Request *RequestInfo
}

// RequestInfo: the request's attributes that policy conditions test
// (aws:SourceIp, aws:SecureTransport, aws:UserAgent, aws:Referer).
type RequestInfo struct {
	SourceIP        string
	SecureTransport bool
	UserAgent       string
	Referer         string
}

func (c Caller) String() string {
	switch {
	case c.Anonymous:
		return "anonymous user"
	case c.Admin:
		return "admin " + strconv.Quote(c.User)
	case c.Gateway:
		return "gateway " + strconv.Quote(c.User)
	}
	return "user " + strconv.Quote(c.User)
}

type callerKey struct{}

// WithCaller returns ctx carrying c: the namespace service authorizes
// the calls made with it as c.
func WithCaller(ctx context.Context, c Caller) context.Context {
	return context.WithValue(ctx, callerKey{}, c)
}

// CallerOf is ctx's caller. ok is false for in-process calls that carry
// none (the service's own background work, tests of this package): those
// are trusted. The meta server gives every gRPC call a caller.
func CallerOf(ctx context.Context) (c Caller, ok bool) {
	c, ok = ctx.Value(callerKey{}).(Caller)
	return c, ok
}

// Default modes of entries without a recorded one.
const (
	DefaultVolumeMode       = 0o755
	DefaultObjectBucketMode = 0o700
	DefaultFSDirMode        = 0o755
	DefaultFileMode         = 0o644
)

// Permission bits asked for.
const (
	permR = 4
	permW = 2
	permX = 1
)

// Authorizer checks one call's rights against the committed state.
type Authorizer struct {
	st      *State
	pols    *policyCache
	now     func() time.Time
	c       Caller
	trusted bool // no caller in the context, or an admin
	quiet   bool // deny returns errQuiet (see contents)
}

func (s *Service) authz(ctx context.Context) *Authorizer {
	c, ok := CallerOf(ctx)
	return &Authorizer{st: s.st, pols: &s.pols, now: s.cfg.Now, c: c, trusted: !ok || c.Admin}
}

// errQuiet stands for a refusal while quiet: the caller tries other
// grants first and formats the message only if all fail.
var errQuiet = status.Error(codes.PermissionDenied, "permission denied")

func (a *Authorizer) deny(format string, args ...any) error {
	if a.quiet {
		return errQuiet
	}
	return denied(a.c, format, args...)
}

func denied(c Caller, format string, args ...any) error {
	return status.Errorf(codes.PermissionDenied, "permission denied: %s may not %s", c, clipArg(fmt.Sprintf(format, args...)))
}

func clipArg(s string) string {
	if len(s) > 300 {
		return s[:300] + "…"
	}
	return s
}

// allows reports whether mode grants want to the caller, the entry
// being owner's and group's: the owner's bits for the owner, the group
// bits for members of group (basalt meta --groups), else the other bits.
func (a *Authorizer) allows(owner, group string, mode uint32, want uint32) bool {
	if a.trusted {
		return true
	}
	if a.c.Anonymous {
		return false // modes are for authenticated users
	}
	if owner != "" && owner == a.c.User {
		return (mode>>6)&want == want
	}
	if group != "" && slices.Contains(a.c.Groups, group) {
		return (mode>>3)&want == want
	}
	return mode&want == want
}

// entryGroup is an fs entry's group (files: WebHDFS's hdfs-group, then
// their attrs), else the bucket's.
func entryGroup(b *metapb.Bucket, e *metapb.FsEntry) string {
	at := e.GetAttrs()
	g := ""
	if !e.GetIsDir() {
		g = e.GetFile().GetMeta().GetUser()["hdfs-group"]
		at = e.GetFile().GetAttrs()
	}
	if at.GetGroup() != "" {
		g = at.GetGroup()
	}
	if g == "" {
		g = b.GetAttrs().GetGroup()
	}
	return g
}

func attrMode(at *metapb.FileAttrs, def uint32) uint32 {
	if at != nil && at.Permission != nil {
		return *at.Permission
	}
	return def
}

func volumeOwner(v *metapb.Volume) string {
	if o := v.GetAttrs().GetOwner(); o != "" {
		return o
	}
	return v.GetOwner()
}

// BucketOwner is the bucket's effective owner: attrs.owner, else owner.
func BucketOwner(b *metapb.Bucket) string {
	if o := b.GetAttrs().GetOwner(); o != "" {
		return o
	}
	return b.GetOwner()
}

func bucketMode(b *metapb.Bucket) uint32 {
	def := uint32(DefaultObjectBucketMode)
	if b.GetLayout() == metapb.BucketLayout_FS {
		def = DefaultFSDirMode
	}
	return attrMode(b.GetAttrs(), def)
}

// Admin requires an admin (or a trusted in-process call).
func (a *Authorizer) Admin(what string) error {
	if a.trusted {
		return nil
	}
	return a.deny("%s (admins only)", what)
}

// CreateVolume: admins, or a gateway in its own name. The owner recorded
// defaults to the caller.
func (a *Authorizer) CreateVolume(req *metapb.CreateVolumeRequest) error {
	if !a.trusted && !a.c.Gateway {
		return a.deny("create volume %q (admins only)", req.Name)
	}
	if req.Owner == "" && req.GetAttrs().GetOwner() == "" && a.c.User != "" {
		req.Owner = a.c.User
	}
	return nil
}

// VolumeAttrs: the volume's owner (and admins) may change its attributes.
func (a *Authorizer) volumeAttrs(volume string) error {
	if a.trusted {
		return nil
	}
	v, err := a.st.GetVolume(volume)
	if err != nil {
		return err
	}
	if !a.isOwner(volumeOwner(v)) {
		return a.deny("change the attributes of volume %q (its owner is %q)", volume, volumeOwner(v))
	}
	return nil
}

// CreateBucket: write on the volume. The owner recorded is the caller's
// (a non-admin may not create a bucket for someone else).
func (a *Authorizer) CreateBucket(req *metapb.CreateBucketRequest) error {
	if a.c.Anonymous {
		return a.deny("create bucket %q (buckets need an owner)", req.Name)
	}
	if a.c.User != "" {
		if !a.trusted && (req.Owner != "" && req.Owner != a.c.User || req.GetAttrs().GetOwner() != "" && req.GetAttrs().GetOwner() != a.c.User) {
			return a.deny("create bucket %q for %q", req.Name, req.Owner)
		}
		if req.Owner == "" {
			req.Owner = a.c.User
		}
	}
	if a.trusted {
		return nil
	}
	v, err := a.st.GetVolume(req.Volume)
	if err != nil {
		return err
	}
	if !a.allows(volumeOwner(v), v.GetAttrs().GetGroup(), attrMode(v.GetAttrs(), DefaultVolumeMode), permW|permX) && !a.aclGrants(v.Acls, rightCreate, false) {
		return a.deny("create a bucket in volume %q (owner %q, mode %o)", req.Volume, volumeOwner(v), attrMode(v.GetAttrs(), DefaultVolumeMode))
	}
	return nil
}

// DeleteBucket: the bucket's owner or the volume's, or DELETE in the
// bucket's or the volume's ACL; the policy (s3:DeleteBucket) first.
func (a *Authorizer) DeleteBucket(volume, bucket string) error {
	if a.trusted {
		return nil
	}
	b, err := a.st.cachedBucket(volume, bucket)
	if err != nil {
		return err
	}
	return a.contents(b, contentOp{action: "s3:DeleteBucket", right: rightDelete}, func() error {
		if a.isOwner(BucketOwner(b)) {
			return nil
		}
		if v, err := a.st.GetVolume(volume); err == nil && (a.isOwner(volumeOwner(v)) ||
			a.aclGrants(v.Acls, rightDelete, b.GetPublicAccessBlock().GetIgnorePublicAcls())) { // inherited public entries are ignored too
			return nil
		}
		return a.deny("delete bucket %q (its owner is %q)", bucket, BucketOwner(b))
	})
}

// bucketModes checks want on the bucket's own mode.
func (a *Authorizer) bucketModes(b *metapb.Bucket, want uint32, what string) (*metapb.Bucket, error) {
	if !a.allows(BucketOwner(b), b.GetAttrs().GetGroup(), bucketMode(b), want) {
		return nil, a.deny("%s in bucket %q (owner %q, mode %o)", what, b.Name, BucketOwner(b), bucketMode(b))
	}
	return b, nil
}

// entryOwnerMode is an fs entry's owner and mode (files: the WebHDFS
// attributes in its metadata, then its own attrs).
func entryOwnerMode(b *metapb.Bucket, e *metapb.FsEntry) (string, uint32) {
	owner, mode := "", uint32(DefaultFSDirMode)
	at := e.GetAttrs()
	if !e.GetIsDir() {
		mode = DefaultFileMode
		if u := e.GetFile().GetMeta().GetUser(); u != nil {
			owner = u["hdfs-owner"]
			if v, err := strconv.ParseUint(u["hdfs-permission"], 8, 32); err == nil && v <= MaxPermission {
				mode = uint32(v)
			}
		}
		at = e.GetFile().GetAttrs()
	}
	if at.GetOwner() != "" {
		owner = at.GetOwner()
	}
	mode = attrMode(at, mode)
	if owner == "" {
		owner = BucketOwner(b)
	}
	return owner, mode
}

// pathEntries reads the entries of parts' prefixes in one view: entries[i]
// is parts[:i+1]'s; it stops at the first missing one or after a file.
func (s *State) pathEntries(b *metapb.Bucket, parts []string) ([]*metapb.FsEntry, error) {
	var out []*metapb.FsEntry
	err := s.view(func(r pebble.Reader) error {
		parent := uint64(0)
		for _, p := range parts {
			e := &metapb.FsEntry{}
			ok, err := get(r, fsKey(b.Id, parent, p), e)
			if err != nil || !ok {
				return err
			}
			out = append(out, e)
			if !e.IsDir {
				return nil
			}
			parent = e.DirId
		}
		return nil
	})
	return out, err
}

// fsPath checks an FS bucket path: x on the bucket and every directory
// above the last component, parentWant on its parent and entryWant on the
// entry itself. A missing component ends the walk: the request itself
// reports it.
func (a *Authorizer) fsPath(b *metapb.Bucket, path string, parentWant, entryWant uint32, what string) error {
	parts, err := SplitPath(path, true)
	if err != nil {
		return err
	}
	owner, group, mode := BucketOwner(b), b.GetAttrs().GetGroup(), bucketMode(b)
	want := uint32(permX)
	if len(parts) <= 1 {
		want |= parentWant
	}
	if len(parts) == 0 {
		want = permX | entryWant
	}
	if !a.allows(owner, group, mode, want) {
		return a.deny("%s: bucket %q (owner %q, mode %o)", what, b.Name, owner, mode)
	}
	entries, err := a.st.pathEntries(b, parts)
	if err != nil {
		return err
	}
	for i, e := range entries {
		owner, mode := entryOwnerMode(b, e)
		group := entryGroup(b, e)
		var want uint32
		switch {
		case i == len(parts)-1:
			want = entryWant
			if e.IsDir && entryWant != 0 {
				want |= permX
			}
		case i == len(parts)-2:
			want = permX | parentWant
		default:
			want = permX
		}
		if want != 0 && !a.allows(owner, group, mode, want) {
			return a.deny("%s: %q (owner %q, mode %o)", what, joinPath(parts[:i+1]), owner, mode)
		}
	}
	return nil
}

// createPath checks creating, replacing or deleting path (and creating
// any missing parents): x on every existing directory on the way, w on
// the deepest existing one.
func (a *Authorizer) createPath(b *metapb.Bucket, path string, what string) error {
	parts, err := SplitPath(path, false)
	if err != nil {
		return err
	}
	entries, err := a.st.pathEntries(b, parts)
	if err != nil {
		return err
	}
	owner, group, mode := BucketOwner(b), b.GetAttrs().GetGroup(), bucketMode(b)
	at := ""
	for i := range parts {
		if i >= len(entries) || !entries[i].IsDir || i == len(parts)-1 {
			// parts[i] is missing (created here), a file (the request
			// fails), or the target itself: its parent must be writable.
			if !a.allows(owner, group, mode, permW|permX) {
				return a.deny("%s: %q (owner %q, mode %o)", what, "/"+at, owner, mode)
			}
			return nil
		}
		if !a.allows(owner, group, mode, permX) {
			return a.deny("%s: %q (owner %q, mode %o)", what, "/"+at, owner, mode)
		}
		owner, mode = entryOwnerMode(b, entries[i])
		group = entryGroup(b, entries[i])
		at = joinPath(parts[:i+1])
	}
	return nil
}

// Read checks reading key (lookup) in a bucket: s3:GetObject, r, READ.
func (a *Authorizer) Read(volume, bucket, key string) error {
	if a.trusted {
		return nil
	}
	b, err := a.st.cachedBucket(volume, bucket)
	if err != nil {
		return err
	}
	what := "read " + strconv.Quote(key)
	return a.contents(b, contentOp{action: "s3:GetObject", key: key, entry: key, right: rightRead}, func() error {
		if b.Layout != metapb.BucketLayout_FS {
			_, err := a.bucketModes(b, permR, what)
			return err
		}
		return a.fsPath(b, key, 0, permR, what)
	})
}

// Stat checks a key's or an entry's status (no contents): object buckets
// r on the bucket, fs buckets x on the way.
func (a *Authorizer) Stat(volume, bucket, key string) error {
	if a.trusted {
		return nil
	}
	b, err := a.st.cachedBucket(volume, bucket)
	if err != nil {
		return err
	}
	return a.contents(b, contentOp{action: "s3:GetObject", key: key, entry: key, right: rightRead}, func() error {
		if b.Layout != metapb.BucketLayout_FS {
			_, err := a.bucketModes(b, permR, "read "+strconv.Quote(key))
			return err
		}
		return a.fsPath(b, key, 0, 0, "stat "+strconv.Quote(key))
	})
}

// List checks listing a bucket (object: r on it) or a directory of an fs
// bucket (r on it; prefix listings of fs buckets: r on the bucket).
func (a *Authorizer) List(volume, bucket, dir string) error {
	return a.ListAs(volume, bucket, dir, "s3:ListBucket", nil)
}

// Write checks creating, replacing or deleting key: object buckets w on
// the bucket; fs buckets w on the parent directory.
func (a *Authorizer) Write(volume, bucket, key, what string) error {
	return a.change(volume, bucket, key, what, "s3:PutObject", false)
}

// WriteOpen checks a commit or block allocation against the open key's
// own bucket and key.
func (a *Authorizer) WriteOpen(openID uint64, what string) error {
	if a.trusted {
		return nil
	}
	row, err := a.st.OpenKey(openID)
	if err != nil {
		return err
	}
	return a.Write(row.Volume, row.Bucket, row.Key, what)
}

// SetFileAttrs: volume attributes its owner; a bucket's or entry's the
// owner (fs: who may also reach it); only an admin changes the owner to
// someone else.
func (a *Authorizer) SetFileAttrs(req *metapb.SetFileAttrsRequest) error {
	if a.trusted {
		return nil
	}
	if o := req.GetAttrs().GetOwner(); o != "" && o != a.c.User {
		return a.deny("give %q to %q (admins only)", "/"+req.Volume+"/"+req.Bucket+"/"+req.Path, o)
	}
	if req.Bucket == "" {
		return a.volumeAttrs(req.Volume)
	}
	b, err := a.st.cachedBucket(req.Volume, req.Bucket)
	if err != nil {
		return err
	}
	owner := BucketOwner(b)
	if req.Path != "" {
		if b.Layout != metapb.BucketLayout_FS {
			return nil // the request fails: paths need an FS bucket
		}
		if err := a.fsPath(b, req.Path, 0, 0, "change attributes of "+strconv.Quote(req.Path)); err != nil {
			return err
		}
		parts, _ := SplitPath(req.Path, false)
		entries, err := a.st.pathEntries(b, parts)
		if err != nil {
			return err
		}
		if len(entries) < len(parts) {
			return nil // missing: the request reports it
		}
		owner, _ = entryOwnerMode(b, entries[len(parts)-1])
	}
	if !a.isOwner(owner) {
		return a.deny("change the attributes of %q (its owner is %q)", "/"+req.Volume+"/"+req.Bucket+"/"+req.Path, owner)
	}
	return nil
}

// OwnAttrs makes attributes a non-admin gives what it creates name the
// caller: another owner is refused, none becomes the caller.
func (a *Authorizer) OwnAttrs(at *metapb.FileAttrs, what string) (*metapb.FileAttrs, error) {
	if a.c.Anonymous && at.GetOwner() != "" {
		return nil, a.deny("create %s owned by %q", what, at.GetOwner())
	}
	if a.trusted || a.c.User == "" {
		return at, nil
	}
	if o := at.GetOwner(); o != "" && o != a.c.User {
		return nil, a.deny("create %s owned by %q", what, o)
	}
	if at.GetOwner() == "" {
		if at == nil {
			at = &metapb.FileAttrs{}
		}
		at.Owner = a.c.User
	}
	return at, nil
}

// S3Secret: reading a secret is for admins and gateways in their own
// name (to check signatures); creating and deleting for admins.
func (a *Authorizer) S3Secret(read bool) error {
	if a.trusted || read && a.c.Gateway {
		return nil
	}
	if read {
		return a.deny("read S3 secrets (admins and gateways only)")
	}
	return a.deny("manage S3 secrets (admins only)")
}

// cachedBucket is the bucket row through the read path's cache (shared:
// not to be modified): the check costs no Pebble read for a known bucket.
func (s *State) cachedBucket(volume, name string) (*metapb.Bucket, error) {
	var b *metapb.Bucket
	gen := s.buckets.generation()
	err := s.view(func(r pebble.Reader) error {
		var err error
		b, err = s.buckets.get(r, gen, volume, name)
		return err
	})
	return b, err
}
