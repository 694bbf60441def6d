package namespace

import (
	"context"
	"fmt"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TokenIssuer signs block tokens (SCM's Manager, with the keys of the
// local SCM replica). pipeline is the pipeline a write token lets its
// holder write through (0 for read tokens).
type TokenIssuer interface {
	IssuePipelineToken(ctx context.Context, id *metapb.BlockID, pipeline uint64, modes blocktoken.Mode, owner string) ([]byte, error)
}

// Modes granted with block locations: a writer may read back what it
// writes; a reader only reads.
const (
	writeModes = blocktoken.Read | blocktoken.Write
	readModes  = blocktoken.Read
)

// attachTokens sets a block token on every location: datanodes serve no
// data call without one. A write token names the location's pipeline
// (the one SCM allocated the block's container to): datanodes take its
// writes through that pipeline only, never through another pipeline they
// share with it. Without an issuer (the namespace tested alone)
// locations carry none.
func (s *Service) attachTokens(ctx context.Context, locs []*metapb.BlockLocation, modes blocktoken.Mode) error {
	if s.cfg.Tokens == nil {
		return nil
	}
	for _, l := range locs {
		var pipeline uint64
		if modes&blocktoken.Write != 0 {
			if pipeline = l.GetPipelineId(); pipeline == 0 {
				return fmt.Errorf("namespace: write location of block %v has no pipeline", l.GetId())
			}
		}
		tok, err := s.cfg.Tokens.IssuePipelineToken(ctx, l.Id, pipeline, modes, "")
		if err != nil {
			return err
		}
		l.Token = tok
	}
	return nil
}
