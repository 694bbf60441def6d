package datanode

import (
	"encoding/json"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

func mustJSON(v any) []byte {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		panic(err)
	}
	return b
}

func mustMarshal(m proto.Message) []byte {
	b, err := proto.Marshal(m)
	if err != nil {
		panic(err)
	}
	return b
}

func protoJSON(m proto.Message) ([]byte, error) { return protojson.Marshal(m) }

func protoUnJSON(b []byte, m proto.Message) error { return protojson.Unmarshal(b, m) }
