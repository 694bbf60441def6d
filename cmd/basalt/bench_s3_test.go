package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awss3 "github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/basalt-store/basalt/client"
	"github.com/basalt-store/basalt/internal/meta/metapb"
	"github.com/basalt-store/basalt/internal/s3"
)

// TestBenchS3 runs "basalt bench s3" put, get and stat against a gateway on
// an in-process cluster: each phase does work without errors, reports it
// as JSON, and deletes what it wrote; wrong credentials fail the run.
func TestBenchS3(t *testing.T) {
	dir, bin, c := binaryAndCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cl, err := client.New(client.Config{MetaAddrs: []string{c.MetaAddr()}, Credentials: c.ClientCredentials(), ServiceToken: c.ServiceToken()})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	sec, err := cl.Namespace().CreateS3Secret(ctx, &metapb.CreateS3SecretRequest{AccessKeyId: "benchkey", Owner: "test"})
	if err != nil {
		t.Fatal(err)
	}
	gw, err := s3.New(s3.Config{MetaAddrs: []string{c.MetaAddr()}, Listen: "127.0.0.1:0", ServiceToken: c.ServiceToken(), Credentials: c.ClientCredentials()})
	if err != nil {
		t.Fatal(err)
	}
	go gw.Serve()
	defer gw.Close()
	endpoint := "http://" + gw.Addr()

	run := func(secret string, args ...string) ([]s3BenchResult, string, int) {
		cmd := exec.CommandContext(ctx, bin, append([]string{"bench", "s3"}, append(args, "--endpoint", endpoint, "--json", "--bucket", "benchb")...)...)
		cmd.Env = append(cmd.Environ(), "AWS_ACCESS_KEY_ID=benchkey", "AWS_SECRET_ACCESS_KEY="+secret)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		code := 0
		if err := cmd.Run(); err != nil {
			ee, ok := err.(*exec.ExitError)
			if !ok {
				t.Fatal(err)
			}
			code = ee.ExitCode()
		}
		var res []s3BenchResult
		if code == 0 {
			if err := json.Unmarshal(out.Bytes(), &res); err != nil || len(res) != 1 {
				t.Fatalf("%v: output %q is not one JSON result: %v", args, out.String(), err)
			}
		}
		return res, errb.String(), code
	}
	for _, tc := range []struct {
		args []string
		size int64
	}{
		{[]string{"put", "--size", "64KiB", "-t", "4", "--duration", "1s"}, 64 << 10},
		{[]string{"put", "--size", "9MiB", "-t", "2", "-n", "3", "--duration", "20s"}, 9 << 20},
		{[]string{"get", "--size", "1MiB", "-t", "2", "-n", "4", "--duration", "1s"}, 1 << 20},
		{[]string{"stat", "--size", "4KiB", "-t", "8", "-n", "16", "--duration", "1s"}, 4 << 10},
		// --lean: hand-signed HEADs, which the gateway verifies (a bad
		// signature would fail every one with 403).
		{[]string{"stat", "--lean", "--size", "4KiB", "-t", "8", "-n", "16", "--duration", "1s"}, 4 << 10},
		{[]string{"put", "--size", "4KiB", "-t", "2", "-n", "5", "--payload", "signed", "--checksum", "sha256"}, 4 << 10},
	} {
		res, stderr, code := run(sec.GetSecretAccessKey(), tc.args...)
		if code != 0 {
			t.Fatalf("%v: exit %d: %s", tc.args, code, stderr)
		}
		r := res[0]
		if r.Ops == 0 || r.Errors != 0 || r.OpsPerSec <= 0 || r.P50Ms <= 0 || r.ObjectSize != tc.size {
			t.Errorf("%v: %+v", tc.args, r)
		}
		if r.Op != "stat" && r.Bytes != int64(r.Ops)*tc.size {
			t.Errorf("%v: %d bytes for %d ops of %d", tc.args, r.Bytes, r.Ops, tc.size)
		}
		if tc.args[0] == "put" && strings.Contains(strings.Join(tc.args, " "), "-n") && r.Ops != map[int64]int{9 << 20: 3, 4 << 10: 5}[tc.size] {
			t.Errorf("%v: -n caps puts, got %d ops", tc.args, r.Ops)
		}
	}
	// Everything written was deleted.
	sc := awss3.New(awss3.Options{Region: "us-east-1", BaseEndpoint: aws.String(endpoint), UsePathStyle: true,
		Credentials: credentials.NewStaticCredentialsProvider("benchkey", sec.GetSecretAccessKey(), "")})
	l, err := sc.ListObjectsV2(ctx, &awss3.ListObjectsV2Input{Bucket: aws.String("benchb")})
	if err != nil {
		t.Fatal(err)
	}
	if len(l.Contents) != 0 {
		t.Errorf("bench s3 left %d objects behind, first %s", len(l.Contents), aws.ToString(l.Contents[0].Key))
	}
	// A wrong secret fails the run with the server's error.
	if _, stderr, code := run("wrong-secret", "put", "--size", "1KiB", "-n", "1"); code == 0 || !strings.Contains(stderr, "SignatureDoesNotMatch") {
		t.Errorf("wrong secret: exit %d, stderr %q", code, stderr)
	}
	// No credentials: a usage error before any request.
	cmd := exec.CommandContext(ctx, bin, "bench", "s3", "put", "--endpoint", endpoint)
	cmd.Env = []string{"HOME=" + dir}
	if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), "credentials") {
		t.Errorf("no credentials: err %v, output %q", err, out)
	}
}
