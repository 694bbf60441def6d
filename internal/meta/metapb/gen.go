// Package metapb holds the generated protobuf and gRPC code of the metadata
// service (sources in proto/meta). The generated files are committed so that
// `go build` needs no protoc.
package metapb

//go:generate sh ../../../scripts/gen-proto.sh
