package namespace

import (
	"bytes"
	"context"
	"sync"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/meta/store"
)

// Expiry of incomplete multipart uploads (S3's lifecycle rule
// AbortIncompleteMultipartUpload, applied to every bucket).
//
// Upload rows are sorted by bucket and key, not by age, so the leader
// walks them with a cursor, a bounded number of rows per round, and
// aborts the old ones with the ordinary AbortMultipartUpload command: an
// upload's creation time never changes and its ID is never reused, so
// the check made on the leader's snapshot still holds when the command
// applies, and no new Raft command is needed. Abort releases the parts'
// blocks to the deleted queue, which goes to SCM like any other.

const (
	// DefaultUploadExpiry is S3's customary lifecycle setting.
	DefaultUploadExpiry = 7 * 24 * time.Hour
	// uploadScanRows bounds the upload rows read per round, and
	// uploadAbortsPerRound the aborts proposed per round.
	uploadScanRows       = 10000
	uploadAbortsPerRound = 100
)

// uploadScan is where the expiry walk resumes (nil: from the start).
type uploadScan struct {
	mu     sync.Mutex
	cursor []byte
}

// ExpiredUploads returns up to limit uploads created before olderThan,
// reading at most maxRows upload rows after the row key after (nil: from
// the first). next is where to resume; nil when the walk reached the end.
func (s *State) ExpiredUploads(olderThanUnixMs int64, after []byte, maxRows, limit int) (ups []*metapb.MultipartUpload, next []byte, err error) {
	err = s.view(func(r pebble.Reader) error {
		lower := pfxUpload
		if after != nil {
			lower = append(bytes.Clone(after), 0) // the first key after it
		}
		it, err := r.NewIter(&pebble.IterOptions{LowerBound: lower, UpperBound: store.PrefixEnd(pfxUpload)})
		if err != nil {
			return err
		}
		defer it.Close()
		n := 0
		for it.First(); it.Valid(); it.Next() {
			if n == maxRows || len(ups) == limit {
				return it.Error()
			}
			n++
			next = bytes.Clone(it.Key())
			u := &metapb.MultipartUpload{}
			if err := proto.Unmarshal(it.Value(), u); err != nil {
				return err
			}
			if u.CreatedUnixMs < olderThanUnixMs {
				ups = append(ups, u)
			}
		}
		next = nil // the walk is complete
		return it.Error()
	})
	return ups, next, err
}

// expireUploads runs one round of the upload expiry.
func (s *Service) expireUploads(ctx context.Context) error {
	if s.cfg.UploadExpiry < 0 {
		return nil
	}
	s.uploadScan.mu.Lock()
	defer s.uploadScan.mu.Unlock()
	cutoff := s.cfg.Now().Add(-s.cfg.UploadExpiry).UnixMilli()
	ups, next, err := s.st.ExpiredUploads(cutoff, s.uploadScan.cursor, uploadScanRows, uploadAbortsPerRound)
	if err != nil {
		return err
	}
	s.uploadScan.cursor = next
	for _, u := range ups {
		_, err := s.propose(ctx, &metapb.NsCommand{Op: &metapb.NsCommand_AbortMultipart{AbortMultipart: &metapb.AbortMultipartUploadRequest{
			Volume: u.Volume, Bucket: u.Bucket, Key: u.Key, UploadId: u.UploadId}}})
		switch {
		case err == nil:
			s.cfg.Logger.Info("namespace: aborted an expired multipart upload", "volume", u.Volume, "bucket", u.Bucket,
				"key", u.Key, "upload", u.UploadId, "created", time.UnixMilli(u.CreatedUnixMs).UTC())
		case status.Code(err) == codes.NotFound:
			// Completed or aborted since the scan.
		default:
			return err
		}
	}
	return nil
}
