package datanode

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/datanode/datanodepb"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/stream"
)

// Block tokens (package blocktoken): every data call (WriteChunk,
// PutBlock, PutSmallFile, ReadBlock, GetBlock), every V2 stream header
// (on every hop) and every ExportContainer must carry a token that SCM's
// keys signed for that block (or container) and mode. Without one a
// datanode reachable on the network would serve any block by ID and
// create any container a write names (container 0 included); with one, a
// write reaches a container only if SCM allocated a block in it, since
// only the namespace issues write tokens, and only for allocated blocks.
// Internal traffic between datanodes (pipeline Raft, stream forwarding
// within the route the client's token admitted) is the pipeline's own.

// tokenCheck holds the keys SCM sent and counts refusals.
type tokenCheck struct {
	v       blocktoken.Verifier
	refused atomic.Uint64
	expired atomic.Uint64 // of refused: the token had expired (the client refreshes it)
}

// setKeys installs the key set from a registration or heartbeat answer.
// A set that does not validate is ignored (the old one stays) and logged,
// and so is an empty one (SCM always has a key once it ran).
func (d *Datanode) setKeys(keys []*metapb.SecretKey) {
	if len(keys) == 0 {
		return
	}
	ks := make([]blocktoken.Key, len(keys))
	for i, k := range keys {
		ks[i] = blocktoken.Key{ID: k.GetId(), Secret: k.GetSecret(), ActivateUnixMs: k.GetActivateUnixMs(), RetireUnixMs: k.GetRetireUnixMs()}
	}
	set, err := blocktoken.NewKeySet(ks)
	if err != nil {
		d.log.Warn("block token keys from SCM refused", "err", err)
		return
	}
	if d.tokens.v.Set(set) {
		d.log.Debug("block token keys", "count", set.Len())
	}
}

// TokenKeys is the datanode's block token key set (tests).
func (d *Datanode) TokenKeys() *blocktoken.KeySet { return d.tokens.v.Keys() }

// TokensRefused counts data calls and streams refused for their token.
func (d *Datanode) TokensRefused() uint64 { return d.tokens.refused.Load() }

// TokensExpired counts the refusals of TokensRefused whose token had
// expired (blocktoken.ErrExpired): a client holding a lookup longer than
// the token lives, which it renews by looking the key up again. The rest
// are tokens that did not verify (unknown or retired key, bad MAC, wrong
// block, mode or pipeline).
func (d *Datanode) TokensExpired() uint64 { return d.tokens.expired.Load() }

// tokenCollectors export the refusals: expired tokens (clients renew
// them; many mean clients hold lookups too long or clocks disagree) and
// the others (a client without rights, a forged token, or keys SCM did
// not send in time).
func (d *Datanode) tokenCollectors() []prometheus.Collector {
	t := &d.tokens
	return []prometheus.Collector{
		prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "basalt", Subsystem: "datanode", Name: "block_tokens_expired_total",
			Help: "Data calls and streams refused because their block token had expired."}, func() float64 { return float64(t.expired.Load()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: "basalt", Subsystem: "datanode", Name: "block_tokens_invalid_total",
			Help: "Data calls and streams refused because their block token did not verify (unknown or retired key, bad MAC, wrong block, mode or pipeline)."},
			func() float64 {
				e := t.expired.Load() // first: refused counts each refusal before expired does
				return float64(t.refused.Load() - e)
			}),
	}
}

// verifyToken checks tok for mode on block (container, local).
func (d *Datanode) verifyToken(tok []byte, container, local uint64, mode blocktoken.Mode) error {
	return d.verifyTokenVia(tok, container, local, mode, 0)
}

// verifyTokenVia is verifyToken for a call through pipeline: a write
// token must name that pipeline (blocktoken.Claims.CheckPipeline).
func (d *Datanode) verifyTokenVia(tok []byte, container, local uint64, mode blocktoken.Mode, pipeline uint64) error {
	c, err := d.tokens.v.Verify(tok, blocktoken.Block{Container: container, Local: local}, mode, time.Now())
	if err == nil && mode&blocktoken.Write != 0 {
		err = c.CheckPipeline(pipeline)
	}
	if err != nil {
		d.tokens.refused.Add(1)
		if errors.Is(err, blocktoken.ErrExpired) {
			d.tokens.expired.Add(1)
		}
		return fmt.Errorf("datanode %d: %v access to block %d/%d refused: %w", d.ident.ID, mode, container, local, err)
	}
	return nil
}

// checkToken checks the token a gRPC call carried; the answer is
// PERMISSION_DENIED with kind TOKEN_EXPIRED (look the key up again) or
// TOKEN_INVALID.
func (s *service) checkToken(ctx context.Context, container, local uint64, mode blocktoken.Mode) error {
	return tokenStatus(s.d.verifyToken(blocktoken.FromIncoming(ctx), container, local, mode))
}

// checkWriteToken is checkToken for a write through pipeline.
func (s *service) checkWriteToken(ctx context.Context, container, local, pipeline uint64) error {
	return tokenStatus(s.d.verifyTokenVia(blocktoken.FromIncoming(ctx), container, local, blocktoken.Write, pipeline))
}

func tokenStatus(err error) error {
	if err == nil {
		return nil
	}
	kind := datanodepb.Error_TOKEN_INVALID
	if errors.Is(err, blocktoken.ErrExpired) {
		kind = datanodepb.Error_TOKEN_EXPIRED
	}
	return dnError(codes.PermissionDenied, kind, err.Error(), nil)
}

// checkStreamToken checks a V2 stream header's token (write, through
// the header's pipeline).
func (d *Datanode) checkStreamToken(h *stream.Header) *stream.Error {
	if err := d.verifyTokenVia(h.Token, h.Block.Container, h.Block.Local, blocktoken.Write, h.Pipeline); err != nil {
		return &stream.Error{Code: stream.CodePermissionDenied, Datanode: d.ident.ID, Reason: err.Error()}
	}
	return nil
}
