package namespace

import (
	"context"

	"github.com/basalt-store/basalt/internal/blocktoken"
	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// TokenIssuer signs block tokens (SCM's Manager, with the keys of the
// local SCM replica).
type TokenIssuer interface {
	IssueToken(ctx context.Context, id *metapb.BlockID, modes blocktoken.Mode, owner string) ([]byte, error)
}

// Modes granted with block locations: a writer may read back what it
// writes; a reader only reads.
const (
	writeModes = blocktoken.Read | blocktoken.Write
	readModes  = blocktoken.Read
)

// attachTokens sets a block token on every location: datanodes serve no
// data call without one. Without an issuer (the namespace tested alone)
// locations carry none.
func (s *Service) attachTokens(ctx context.Context, locs []*metapb.BlockLocation, modes blocktoken.Mode) error {
	if s.cfg.Tokens == nil {
		return nil
	}
	for _, l := range locs {
		tok, err := s.cfg.Tokens.IssueToken(ctx, l.Id, modes, "")
		if err != nil {
			return err
		}
		l.Token = tok
	}
	return nil
}
