// Package s3 is Basalt's S3 REST gateway: a stateless HTTP server that
// speaks the S3 API over the Basalt client, so any number of gateways can
// serve one cluster (Ozone's s3g).
//
// Buckets are the buckets of one volume (s3v by default, created on first
// use). Requests are path-style, or virtual-host-style for hosts under a
// configured domain. Every request is authenticated with AWS Signature V4
// (Authorization header, presigned URL, or chunk-signed aws-chunked body)
// against access keys kept by the namespace manager; the gateway caches
// them briefly so a request costs no extra metadata call.
//
// Object attributes (ETag, content headers, user metadata, tags, flexible
// checksums) are stored with the key in the namespace manager and committed
// atomically with its data: a PUT is visible with all of them or not at
// all. Bodies stream from the socket to the datanodes and back, with every
// declared digest and signature checked before the commit. Copies
// (CopyObject, UploadPartCopy) share the source's blocks instead, through
// the namespace manager's reference counts, and stream only when they
// cannot.
//
// Per-operation latency is split into auth, meta and data stages
// (basalt_s3_stage_duration_seconds), after seed 003's latency breakdown.
package s3
