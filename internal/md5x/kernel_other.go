//go:build !amd64 || purego

package md5x

const hasAVX512 = false

type kernelArgs struct {
	st   [4 * MaxLanes]uint32
	ptrs [MaxLanes]*byte
}

func runKernel(*kernelArgs, int) { panic("md5x: no kernel") }
