package meta

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/applyhalt"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
	"github.com/basalt-store/basalt/internal/pki"
	"github.com/basalt-store/basalt/internal/raft"
)

// The cluster CA kept through Raft (the CA group, ID 3; see
// docs/SECURITY.md, "Certificates"):
//
//   - The CA certificate and key are recorded once, by the first leader of
//     the CA group, from Config.CA: the operator's CA (basalt meta
//     --ca-dir) or one `basalt meta` made when it started a new cluster
//     without certificates. Every meta node then holds them in its CA
//     store and can issue. With Config.CAKeySecret the key is sealed
//     (AES-256-GCM) before it is proposed, so the raft log, snapshots and
//     the store hold it encrypted; without it the key is protected only by
//     the meta nodes' data directories (and the mTLS of the raft port).
//   - Admins make one-time bootstrap tokens (CreateBootstrapToken); the
//     store keeps the secret's SHA-256, the role, the expiry. A new node
//     sends a CSR with the token to IssueCertificate, over TLS but
//     without a client certificate; the certificate is signed, and the
//     token checked and consumed in one apply (ConsumeToken), so a token
//     used twice, even by racing requests, issues one certificate.
//   - A node renews its certificate over its mTLS connection
//     (RenewCertificate, same identity only).
//   - Revoked serials are recorded through Raft; every meta node refuses
//     them at the handshake (pki.Credentials.SetRevoked) and datanodes
//     learn them with GetRevocations.

// caMaxTokenTTL bounds a bootstrap token's life.
const (
	caDefaultTokenTTL = time.Hour
	caMaxTokenTTL     = 7 * 24 * time.Hour
)

// caCertlessMethods may be called without a client certificate: they
// check their own credential (a bootstrap token) or serve only public
// data (the CA certificate).
// certOnlyMethods need a client certificate even from an admin: a user
// token (an S3 key) may not mint or revoke node identities.
var certOnlyMethods = map[string]bool{}

var caCertlessMethods = map[string]bool{
	metapb.Ca_GetCaCertificate_FullMethodName: true,
	metapb.Ca_IssueCertificate_FullMethodName: true,
}

func init() {
	for _, m := range []string{metapb.Ca_GetCaCertificate_FullMethodName, metapb.Ca_IssueCertificate_FullMethodName,
		metapb.Ca_RenewCertificate_FullMethodName, metapb.Ca_GetRevocations_FullMethodName} {
		methodRoles[m] = anyRole
	}
	for _, m := range []string{metapb.Ca_CreateBootstrapToken_FullMethodName, metapb.Ca_RevokeCertificate_FullMethodName} {
		methodRoles[m] = clientsAndMeta
		adminMethods[m] = true
		certOnlyMethods[m] = true
	}
}

// certlessCall reports whether a call to method may go on without a
// client certificate (auth.go lets it through unauthenticated).
func certlessCall(ctx context.Context, method string) bool {
	if !caCertlessMethods[method] {
		return false
	}
	_, ok, err := pki.CallIdentity(ctx)
	return !ok && err == nil
}

// caService is the Ca gRPC service and the CA group's state.
type caService struct {
	metapb.UnimplementedCaServer
	s     *Server
	state *caState
	group *raft.Group
}

func (s *Server) openCA(sopts store.Options) error {
	var seal []byte
	if len(s.cfg.CAKeySecret) > 0 {
		seal = sealKey(s.cfg.CAKeySecret)
	}
	st, err := openCaState(filepath.Join(s.cfg.DataDir, "ca"), sopts, seal, s.log, s.cfg.TestHiddenOps[CaGroup]...)
	if err != nil {
		return err
	}
	tls := s.cfg.TLS
	st.onRevoked = func(serials []string) { tls.SetRevoked(serials) }
	serials, _ := st.Revocations()
	tls.SetRevoked(serials)
	s.ca = &caService{s: s, state: st}
	return nil
}

// startCA joins the CA group.
func (c *caService) start(voters []uint64) error {
	g, err := c.s.host.AddGroup(raft.GroupConfig{ID: CaGroup, Peers: voters, StateMachine: &raftSM{sm: c.state}})
	if err != nil {
		return fmt.Errorf("meta: CA group: %w", err)
	}
	c.group = g
	return nil
}

// establish records Config.CA as the cluster's CA once a leader is elected,
// unless one is recorded; it returns when one is.
func (c *caService) establish(ctx context.Context) {
	if c.s.cfg.TLS.IsInsecure() && c.s.cfg.CA == nil {
		return // no certificates anywhere (benchmarks)
	}
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	warned := false
	for {
		if ca, der, err := c.state.CA(); der != nil {
			c.checkTrusted(der, ca, err)
			return
		}
		if c.group.IsLeader() && c.s.cfg.CA != nil {
			if err := c.proposeInit(ctx); err != nil && ctx.Err() == nil {
				c.s.log.Debug("meta: recording the cluster CA", "err", err)
			}
		} else if c.s.cfg.CA == nil && !warned && c.group.IsLeader() {
			warned = true
			c.s.log.Warn("meta: no cluster CA recorded and none given (basalt meta --ca-dir): bootstrap tokens and renewals are unavailable until a meta node that has one leads the CA group")
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (c *caService) proposeInit(ctx context.Context) error {
	ca := c.s.cfg.CA
	key, err := ca.MarshalKey()
	if err != nil {
		return err
	}
	op := &metapb.CaInitOp{CertDer: ca.Cert.Raw, Key: key}
	if c.state.seal != nil {
		if op.Key, err = sealCAKey(c.state.seal, key, ca.Cert.Raw); err != nil {
			return err
		}
		op.KeySealed = true
	}
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, err = c.propose(pctx, &metapb.CaCommand{Op: &metapb.CaCommand_Init{Init: op}})
	return err
}

// checkTrusted warns when this node's credentials do not trust the
// recorded CA (the certificates it issues would be refused here).
func (c *caService) checkTrusted(der []byte, ca *pki.CA, err error) {
	if err != nil {
		c.s.log.Warn("meta: this node cannot issue certificates", "err", err)
	}
	if c.s.cfg.TLS.IsInsecure() {
		return
	}
	if _, _, perr := pki.PoolWithFingerprint(c.s.cfg.TLS.CAPEM(), pki.Fingerprint(der)); perr != nil {
		c.s.log.Error("meta: this node's CA file does not hold the cluster CA recorded in Raft: certificates the cluster issues will be refused by this node", "cluster_ca_sha256", pki.Fingerprint(der))
	}
}

// halted refuses CA reads and proposals on a replica whose CA apply
// halted (upgrade.go).
func (c *caService) halted() error { return c.s.groupHaltedErr("ca", c.state.halt) }

func (c *caService) propose(ctx context.Context, cmd *metapb.CaCommand) (any, error) {
	cmd.NowUnixMs = time.Now().UnixMilli()
	b, err := proto.Marshal(cmd)
	if err != nil {
		return nil, err
	}
	v, err := proposeUnlessHalted(ctx, c.s, c.group, b, c.halted(), applyhalt.ErrHalted)
	if err != nil {
		return nil, c.raftErr(err)
	}
	return v, nil
}

// raftErr turns a proposal's failure into a status: a refusal from the
// apply as it is, "not the leader" as UNAVAILABLE with the CA group
// leader's address (clients follow it).
func (c *caService) raftErr(err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	var nle *raft.NotLeaderError
	if errors.As(err, &nle) || errors.Is(err, raft.ErrNotLeader) || errors.Is(err, raft.ErrProposalDropped) || errors.Is(err, raft.ErrStopped) {
		return c.notLeader()
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return status.Errorf(codes.DeadlineExceeded, "meta node %d: CA: %v", c.s.cfg.NodeID, err)
	}
	// Outcome unknown and the rest: the token may or may not be consumed.
	return status.Errorf(codes.Unknown, "meta node %d: CA: %v", c.s.cfg.NodeID, err)
}

func (c *caService) notLeader() error {
	leader := c.group.Leader()
	nl := &metapb.NotLeader{GroupId: CaGroup}
	if leader != c.s.cfg.NodeID {
		nl.LeaderId = leader
		if p, ok := c.s.peer(leader); ok {
			nl.LeaderAddr = p.GRPCAddr
		}
	}
	st, _ := status.Newf(codes.Unavailable, "meta node %d: not the CA group's leader", c.s.cfg.NodeID).WithDetails(nl)
	return st.Err()
}

// issuer is the CA, if this node leads the CA group and can use the key.
func (c *caService) issuer() (*pki.CA, error) {
	if err := c.halted(); err != nil {
		return nil, err
	}
	if !c.group.IsLeader() {
		return nil, c.notLeader()
	}
	ca, der, err := c.state.CA()
	if der == nil {
		return nil, status.Errorf(codes.FailedPrecondition, "meta node %d: the cluster has no CA recorded yet (start a meta node with --ca-dir, or a new cluster without certificates)", c.s.cfg.NodeID)
	}
	if err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "meta node %d: %v", c.s.cfg.NodeID, err)
	}
	return ca, nil
}

// bundle is what an issued node trusts: the CA certificates this node
// trusts, and the recorded CA.
func (c *caService) bundle() []byte {
	out := bytes.Clone(c.s.cfg.TLS.CAPEM())
	if _, der, _ := c.state.CA(); der != nil {
		if _, _, err := pki.PoolWithFingerprint(out, pki.Fingerprint(der)); err != nil {
			out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})...)
		}
	}
	return out
}

func (c *caService) validity() time.Duration {
	if c.s.cfg.CertValidity > 0 {
		return c.s.cfg.CertValidity
	}
	return pki.NodeValidity
}

func (c *caService) GetCaCertificate(ctx context.Context, _ *metapb.GetCaCertificateRequest) (*metapb.GetCaCertificateResponse, error) {
	if err := c.halted(); err != nil {
		return nil, err
	}
	resp := &metapb.GetCaCertificateResponse{CaPem: c.bundle()}
	if _, der, _ := c.state.CA(); der != nil {
		resp.Fingerprint = pki.Fingerprint(der)
	}
	return resp, nil
}

func refused(format string, args ...any) error {
	return status.Errorf(codes.PermissionDenied, "bootstrap token refused: "+format, args...)
}

// forward reports whether a call should go to the CA group's leader
// through this node (it is not the leader, and the caller is not a meta
// node forwarding already): a new node given one meta address need not
// find the leader itself.
func (c *caService) forward(ctx context.Context) bool {
	if c.group.IsLeader() || c.s.fwd() == nil {
		return false
	}
	id, ok, _ := pki.CallIdentity(ctx)
	return !ok || id.Role != pki.RoleMeta
}

func (c *caService) IssueCertificate(ctx context.Context, req *metapb.IssueCertificateRequest) (*metapb.IssueCertificateResponse, error) {
	if c.forward(ctx) {
		return c.s.fwd().Ca.IssueCertificate(ctx, req)
	}
	tok, err := pki.ParseBootstrapToken(req.GetToken())
	if err != nil {
		return nil, refused("%v", err)
	}
	ca, err := c.issuer()
	if err != nil {
		return nil, err
	}
	if tok.CAHash != "" && tok.CAHash != ca.Fingerprint() {
		return nil, refused("it names another cluster's CA")
	}
	// Checked here so that nothing is signed for a bad token; checked
	// again, and consumed, in the apply.
	t, err := c.state.token(tok.ID)
	switch {
	case err != nil:
		return nil, status.Errorf(codes.Internal, "meta node %d: %v", c.s.cfg.NodeID, err)
	case t == nil, !tok.SecretMatches(t.GetSecretHash()):
		return nil, refused("unknown token")
	case t.GetUsedUnixMs() != 0:
		return nil, refused("already used")
	case time.Now().UnixMilli() >= t.GetExpiresUnixMs():
		return nil, refused("expired")
	}
	csr, _, _, err := pki.ParseCSR(req.GetCsrDer())
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "%v", err)
	}
	id := pki.Identity{Role: pki.Role(t.GetRole()), ID: t.GetIdentityId()}
	if id.Role == pki.RoleMeta {
		// A token made before its node was removed.
		if err := c.s.refuseRemovedMeta(ctx, id.ID); err != nil {
			return nil, err
		}
	}
	if id.ID == "" {
		// A datanode gets a new UUID: the server chooses, so a token's
		// holder cannot take an existing datanode's identity (a datanode
		// that keeps its UUID gets a token made for it: --id).
		var u [16]byte
		rand.Read(u[:])
		id.ID = hex.EncodeToString(u[:])
	}
	certPEM, serial, notAfter, err := ca.SignCSR(csr, id, c.validity())
	if err != nil {
		return nil, status.Errorf(codes.Internal, "meta node %d: signing: %v", c.s.cfg.NodeID, err)
	}
	issued := &metapb.CaIssuedCert{Serial: serial, Identity: id.String(), NotAfterUnixMs: notAfter.UnixMilli()}
	if _, err := c.propose(ctx, &metapb.CaCommand{Op: &metapb.CaCommand_ConsumeToken{ConsumeToken: &metapb.CaConsumeTokenOp{
		TokenId: tok.ID, SecretHash: tok.SecretHash(), Issued: issued}}}); err != nil {
		return nil, err
	}
	c.s.log.Info("meta: certificate issued against a bootstrap token", "identity", id, "serial", serial, "token", tok.ID)
	return &metapb.IssueCertificateResponse{CertPem: certPEM, CaPem: c.bundle(), Serial: serial, Identity: id.String(), NotAfterUnixMs: notAfter.UnixMilli()}, nil
}

func (c *caService) RenewCertificate(ctx context.Context, req *metapb.RenewCertificateRequest) (*metapb.IssueCertificateResponse, error) {
	id, err := pki.FromContext(ctx)
	if err != nil {
		return nil, status.Errorf(codes.Unauthenticated, "RenewCertificate: %v", err)
	}
	csr, asked, ok, err := pki.ParseCSR(req.GetCsrDer())
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "%v", err)
	}
	if ok && asked != id {
		return nil, status.Errorf(codes.PermissionDenied, "RenewCertificate: %s may renew only its own identity, not %s", id, asked)
	}
	ca, err := c.issuer()
	if err != nil {
		return nil, err
	}
	certPEM, serial, notAfter, err := ca.SignCSR(csr, id, c.validity())
	if err != nil {
		return nil, status.Errorf(codes.Internal, "meta node %d: signing: %v", c.s.cfg.NodeID, err)
	}
	issued := &metapb.CaIssuedCert{Serial: serial, Identity: id.String(), NotAfterUnixMs: notAfter.UnixMilli(), RenewedFrom: callerSerial(ctx)}
	if _, err := c.propose(ctx, &metapb.CaCommand{Op: &metapb.CaCommand_RecordIssued{RecordIssued: issued}}); err != nil {
		return nil, err
	}
	return &metapb.IssueCertificateResponse{CertPem: certPEM, CaPem: c.bundle(), Serial: serial, Identity: id.String(), NotAfterUnixMs: notAfter.UnixMilli()}, nil
}

func (c *caService) CreateBootstrapToken(ctx context.Context, req *metapb.CreateBootstrapTokenRequest) (*metapb.CreateBootstrapTokenResponse, error) {
	role := pki.Role(req.GetRole())
	if role == "" {
		role = pki.RoleDatanode
	}
	if role != pki.RoleDatanode && role != pki.RoleClient && role != pki.RoleMeta {
		return nil, status.Errorf(codes.InvalidArgument, "CreateBootstrapToken: role %q: want datanode, client or meta", clip(string(role)))
	}
	if req.GetIdentityId() != "" || role == pki.RoleClient || role == pki.RoleMeta {
		if err := (pki.Identity{Role: role, ID: req.GetIdentityId()}).Validate(); err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "CreateBootstrapToken: %v (a client or meta token names its identity: --id)", err)
		}
	}
	if role == pki.RoleMeta {
		// A meta node's certificate ID is its raft node ID: an initial
		// member, one about to join (basalt meta --join, then admin meta
		// add), never a removed one (checked below, on the CA leader,
		// after a barrier on the members group).
		if n, err := strconv.ParseUint(req.GetIdentityId(), 10, 64); err != nil || n == 0 || strconv.FormatUint(n, 10) != req.GetIdentityId() {
			return nil, status.Errorf(codes.InvalidArgument, "CreateBootstrapToken: a meta token names the node's ID (a positive integer), not %q", clip(req.GetIdentityId()))
		}
	}
	ttl := time.Duration(req.GetTtlMs()) * time.Millisecond
	if ttl == 0 {
		ttl = caDefaultTokenTTL
	}
	if ttl < 0 || ttl > caMaxTokenTTL {
		return nil, status.Errorf(codes.InvalidArgument, "CreateBootstrapToken: ttl %v: want up to %v", ttl, caMaxTokenTTL)
	}
	if c.forward(ctx) {
		return c.s.fwd().Ca.CreateBootstrapToken(ctx, req) // the caller was checked here: an admin
	}
	if !c.group.IsLeader() {
		return nil, c.notLeader()
	}
	if role == pki.RoleMeta {
		if err := c.s.refuseRemovedMeta(ctx, req.GetIdentityId()); err != nil {
			return nil, err
		}
	}
	_, der, _ := c.state.CA()
	if der == nil {
		return nil, status.Errorf(codes.FailedPrecondition, "meta node %d: the cluster has no CA recorded yet", c.s.cfg.NodeID)
	}
	tok := pki.NewBootstrapToken(pki.Fingerprint(der))
	exp := time.Now().Add(ttl).UnixMilli()
	if _, err := c.propose(ctx, &metapb.CaCommand{Op: &metapb.CaCommand_AddToken{AddToken: &metapb.CaAddTokenOp{
		TokenId: tok.ID, SecretHash: tok.SecretHash(), Role: string(role), ExpiresUnixMs: exp, IdentityId: req.GetIdentityId()}}}); err != nil {
		return nil, err
	}
	return &metapb.CreateBootstrapTokenResponse{Token: tok.String(), ExpiresUnixMs: exp}, nil
}

func (c *caService) RevokeCertificate(ctx context.Context, req *metapb.RevokeCertificateRequest) (*metapb.RevokeCertificateResponse, error) {
	op := &metapb.RevokeCertificateRequest{}
	if req.GetSerial() != "" {
		sn, err := pki.ParseSerial(req.GetSerial())
		if err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "RevokeCertificate: %v", err)
		}
		op.Serial = sn
	}
	if req.GetIdentity() != "" {
		id, err := pki.ParseIdentity(req.GetIdentity())
		if err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "RevokeCertificate: %v", err)
		}
		op.Identity = id.String()
	}
	if op.Serial == "" && op.Identity == "" {
		return nil, status.Error(codes.InvalidArgument, "RevokeCertificate: give a serial or an identity")
	}
	if c.forward(ctx) {
		return c.s.fwd().Ca.RevokeCertificate(ctx, op)
	}
	if !c.group.IsLeader() {
		return nil, c.notLeader()
	}
	v, err := c.propose(ctx, &metapb.CaCommand{Op: &metapb.CaCommand_Revoke{Revoke: op}})
	if err != nil {
		return nil, err
	}
	added, _ := v.([]string)
	return &metapb.RevokeCertificateResponse{Serials: added}, nil
}

func (c *caService) GetRevocations(ctx context.Context, _ *metapb.GetRevocationsRequest) (*metapb.GetRevocationsResponse, error) {
	if err := c.halted(); err != nil {
		return nil, err
	}
	serials, v := c.state.Revocations()
	return &metapb.GetRevocationsResponse{Serials: serials, Version: v}, nil
}

// caRenewCheckInterval is how often a meta node looks at its own
// certificate's expiry.
var caRenewCheckInterval = 30 * time.Second

// renewOwn renews this meta node's own certificate from the recorded CA
// when less than a third of its life is left (a meta node holds the CA, so
// it signs locally; the certificate is recorded through Raft when this
// node can propose, so revoking the identity covers it). The new one is
// swapped into the credentials every port uses.
func (c *caService) renewOwn(ctx context.Context) {
	creds := c.s.cfg.TLS
	if creds.IsInsecure() {
		return
	}
	t := time.NewTicker(caRenewCheckInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		l := creds.Leaf()
		if time.Until(l.NotAfter) > l.NotAfter.Sub(l.NotBefore)/3 {
			continue
		}
		if err := c.renewOwnOnce(ctx, creds); err != nil && ctx.Err() == nil {
			c.s.log.Warn("meta: renewing this node's certificate", "err", err, "not_after", l.NotAfter)
		}
	}
}

func (c *caService) renewOwnOnce(ctx context.Context, creds *pki.Credentials) error {
	keyPEM, der, err := pki.NewCSR(creds.Identity)
	if err != nil {
		return err
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var certPEM []byte
	var serial string
	var notAfter time.Time
	if !c.group.IsLeader() && c.s.fwd() != nil {
		// Through the CA group's leader, like any node: it signs and
		// records the new certificate, so a revocation by identity
		// covers it.
		r, err := c.s.fwd().Ca.RenewCertificate(pctx, &metapb.RenewCertificateRequest{CsrDer: der})
		if err != nil {
			return err
		}
		certPEM, serial, notAfter = r.CertPem, r.Serial, time.UnixMilli(r.NotAfterUnixMs)
	} else {
		ca, _, err := c.state.CA()
		if ca == nil {
			if err == nil {
				err = errors.New("no cluster CA recorded")
			}
			return err
		}
		csr, _, _, err := pki.ParseCSR(der)
		if err != nil {
			return err
		}
		if certPEM, serial, notAfter, err = ca.SignCSR(csr, creds.Identity, c.validity()); err != nil {
			return err
		}
		// Recorded before it is used: an unrecorded certificate would
		// escape a revocation by identity.
		if _, err := c.propose(pctx, &metapb.CaCommand{Op: &metapb.CaCommand_RecordIssued{RecordIssued: &metapb.CaIssuedCert{
			Serial: serial, Identity: creds.Identity.String(), NotAfterUnixMs: notAfter.UnixMilli(),
			RenewedFrom: pki.SerialString(creds.Leaf().SerialNumber)}}}); err != nil {
			return fmt.Errorf("recording the renewed certificate: %w", err)
		}
	}
	if err := creds.Swap(certPEM, keyPEM); err != nil {
		return err
	}
	c.s.log.Info("meta: renewed this node's certificate", "serial", serial, "not_after", notAfter)
	if c.s.cfg.CertRenewed != nil {
		c.s.cfg.CertRenewed(creds)
	}
	return nil
}

// streamAuth guards streaming RPCs (the metadata service has none today):
// the port lets TLS clients without a certificate in for the bootstrap
// calls only, so a stream added later must not be reachable without one.
func (s *Server) streamAuth(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if !s.cfg.TLS.IsInsecure() {
		if _, err := pki.RequireRole(ss.Context(), methodName(info.FullMethod), anyRole...); err != nil {
			return err
		}
		if err := s.cfg.TLS.RefuseRevoked(ss.Context(), methodName(info.FullMethod)); err != nil {
			return err
		}
	}
	return handler(srv, ss)
}

// callerSerial is the serial of the call's client certificate ("" if
// none).
func callerSerial(ctx context.Context) string {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return ""
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(ti.State.PeerCertificates) == 0 {
		return ""
	}
	return pki.SerialString(ti.State.PeerCertificates[0].SerialNumber)
}
