//go:build amd64 && !purego

package md5x

import (
	"unsafe"

	"golang.org/x/sys/cpu"
)

var hasAVX512 = cpu.X86.HasAVX512F && cpu.X86.HasAVX512VL

type kernelArgs struct {
	st   [4 * MaxLanes]uint32
	ptrs [MaxLanes]*byte
}

//go:noescape
func block16(state *[4 * MaxLanes]uint32, ptrs *[MaxLanes]unsafe.Pointer, nblocks int)

func runKernel(k *kernelArgs, nblocks int) {
	block16(&k.st, (*[MaxLanes]unsafe.Pointer)(unsafe.Pointer(&k.ptrs)), nblocks)
}
