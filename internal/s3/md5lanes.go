package s3

import (
	"sync"

	md5simd "github.com/minio/md5-simd"
)

// The ETag of a large body is its MD5, which S3 clients compare, so it
// must be computed; at ~800 MB/s per core it was the gateway's largest
// cost per byte (about 1.2 CPU-s per GiB). MD5 is serial within one
// body, but the gateway usually hashes several bodies at once: warp and
// the AWS SDKs send a large object as parts uploaded in parallel (four
// 16 MiB parts at a time per client from minio-go), and several clients
// write at once. md5-simd hashes up to 16 independent bodies side by side
// in the lanes of AVX-512 registers (8 with AVX2) on one goroutine: on
// this machine's CPU one body still hashes at ~800 MB/s, four at
// ~2.3 GB/s and twelve at ~6 GB/s per core (BenchmarkETagLanes). Without
// AVX2 it falls back to crypto/md5.
//
// Writes copy the bytes into the server's own 32 KiB buffers and return
// (the hashing runs on the server goroutine), so the body hands them over
// from the read path without a copy of its own; a write blocks only when
// all buffers are in use, which bounds the memory (16 lanes × 4 × 32 KiB).
var (
	md5LanesOnce sync.Once
	md5Lanes     md5simd.Server
)

// newLaneMD5 returns an MD5 hash that runs in the shared lanes. Close it
// once done (after Sum), or its lane stays taken.
func newLaneMD5() md5simd.Hasher {
	md5LanesOnce.Do(func() { md5Lanes = md5simd.NewServer() })
	return md5Lanes.NewHash()
}
