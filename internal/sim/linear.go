package sim

import (
	"fmt"
	"math"
	"time"

	"github.com/anishathalye/porcupine"
)

// kvOp is one client operation on the metadata group, with its call and
// return in simulated time. An operation whose outcome the client could
// not learn (timeout, the node crashed, ErrOutcomeUnknown) returns at
// "never" with unknown set: it may or may not have taken effect, at any
// point after its call.
type kvOp struct {
	client     int
	cmd        kvCmd
	call, ret  time.Duration
	res        kvResult
	unknown    bool
	failed     bool // definitely not applied (refused before the log)
	pending    bool
	proposedOn uint64
}

type kvInput struct {
	put        bool
	key, value string
}

type kvOutput struct {
	value   string
	found   bool
	unknown bool
}

type kvState struct {
	value string
	found bool
}

// kvModel is a register per key; porcupine checks each key alone.
var kvModel = porcupine.Model{
	Partition: func(h []porcupine.Operation) [][]porcupine.Operation {
		byKey := map[string][]porcupine.Operation{}
		var keys []string
		for _, op := range h {
			k := op.Input.(kvInput).key
			if _, ok := byKey[k]; !ok {
				keys = append(keys, k)
			}
			byKey[k] = append(byKey[k], op)
		}
		out := make([][]porcupine.Operation, 0, len(keys))
		for _, k := range keys {
			out = append(out, byKey[k])
		}
		return out
	},
	Init: func() any { return kvState{} },
	Step: func(state, input, output any) (bool, any) {
		s, in, out := state.(kvState), input.(kvInput), output.(kvOutput)
		if in.put {
			return true, kvState{value: in.value, found: true}
		}
		if out.unknown {
			return true, s
		}
		return out.found == s.found && out.value == s.value, s
	},
	DescribeOperation: func(input, output any) string {
		in, out := input.(kvInput), output.(kvOutput)
		if in.put {
			return fmt.Sprintf("put(%s,%s) unknown=%v", in.key, in.value, out.unknown)
		}
		return fmt.Sprintf("get(%s) -> %q found=%v", in.key, out.value, out.found)
	},
}

// checkLinearizable checks the recorded history; gets with unknown
// outcome and operations that certainly failed say nothing and are left
// out.
func checkLinearizable(ops []*kvOp, timeout time.Duration) (porcupine.CheckResult, string) {
	var h []porcupine.Operation
	for _, op := range ops {
		if op.failed || op.pending && op.cmd.op == kvGet || op.unknown && op.cmd.op == kvGet {
			continue
		}
		ret := int64(op.ret)
		if op.unknown || op.pending {
			ret = math.MaxInt64
		}
		h = append(h, porcupine.Operation{
			ClientId: op.client,
			Input:    kvInput{put: op.cmd.op == kvPut, key: op.cmd.key, value: op.cmd.value},
			Call:     int64(op.call),
			Output:   kvOutput{value: op.res.value, found: op.res.found, unknown: op.unknown || op.pending},
			Return:   ret,
		})
	}
	res, info := porcupine.CheckOperationsVerbose(kvModel, h, timeout)
	if res != porcupine.Illegal {
		return res, ""
	}
	// Name the first key whose history is not linearizable.
	for _, part := range kvModel.Partition(h) {
		if porcupine.CheckOperations(kvModel, part) {
			continue
		}
		s := fmt.Sprintf("key %s:", part[0].Input.(kvInput).key)
		for _, op := range part {
			s += fmt.Sprintf("\n  client %d [%v, %v] %s", op.ClientId, time.Duration(op.Call),
				time.Duration(op.Return), kvModel.DescribeOperation(op.Input, op.Output))
		}
		return res, s
	}
	_ = info
	return res, "history not linearizable"
}
