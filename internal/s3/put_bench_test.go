package s3_test

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
	"net/http"
	"syscall"
	"testing"
	"time"
)

func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkPutLarge PUTs 128 MiB objects through the gateway of an
// in-process secured cluster (256 MiB blocks, the gateway's client with a
// 64 MiB write buffer, V2 streams over mutual TLS) the way current SDKs
// do: UNSIGNED-PAYLOAD with an x-amz-checksum-crc32c header, from a plain
// net/http client (no SDK, so the process's CPU is the gateway's, the
// cluster's and a socket writer's). cpu-s/GiB is the whole process's CPU
// per GiB stored three times: steadier than MiB/s on a shared machine.
//
//	go test -run '^$' -bench PutLarge -benchtime 8x ./internal/s3/
func BenchmarkPutLarge(b *testing.B) {
	e := setupWith(b, 256<<20, 2<<30, 64<<20)
	e.mkBucket(b, "large")
	data := randBytes(9, 128<<20)
	ck := base64.StdEncoding.EncodeToString(binary.BigEndian.AppendUint32(nil, crc32.Checksum(data, crc32.MakeTable(crc32.Castagnoli))))
	put := func(i int) {
		r, _ := http.NewRequest("PUT", fmt.Sprintf("%s/large/obj-%d", e.url, i%4), bytes.NewReader(data))
		r.Header.Set("X-Amz-Checksum-Crc32c", ck)
		e.sign(b, r, "UNSIGNED-PAYLOAD", time.Now(), secretKey)
		resp, err := http.DefaultClient.Do(r)
		if err != nil {
			b.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || resp.Header.Get("X-Amz-Checksum-Crc32c") != ck {
			b.Fatalf("PUT: %d %s", resp.StatusCode, body)
		}
	}
	put(0) // warm: pipelines, containers, connections
	b.SetBytes(int64(len(data)))
	cpu0 := cpuTime()
	b.ResetTimer()
	for i := range b.N {
		put(i + 1)
	}
	b.StopTimer()
	b.ReportMetric((cpuTime()-cpu0).Seconds()/(float64(b.N)*float64(len(data))/(1<<30)), "cpu-s/GiB")
}
