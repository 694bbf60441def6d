#!/bin/sh
# Regenerates internal/meta/metapb from proto/meta. Needs protoc (3.21+),
# protoc-gen-go v1.36.12 and protoc-gen-go-grpc v1.5.1 on PATH:
#   apt-get install -y protobuf-compiler
#   go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
#   go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
set -eu
cd "$(dirname "$0")/.."
protoc -I proto \
  --go_out=. --go_opt=module=github.com/basalt-store/basalt \
  --go-grpc_out=. --go-grpc_opt=module=github.com/basalt-store/basalt \
  proto/meta/meta.proto proto/meta/command.proto proto/meta/ca.proto proto/meta/usertoken.proto proto/meta/upgrade.proto proto/meta/members.proto \
  proto/datanode/datanode.proto
