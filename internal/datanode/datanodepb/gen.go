// Package datanodepb holds the generated protobuf and gRPC code of the
// datanode protocol (sources in proto/datanode). Generated files are
// committed so that `go build` needs no protoc.
package datanodepb

//go:generate sh ../../../scripts/gen-proto.sh
