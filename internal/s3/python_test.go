package s3_test

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// Pinned versions of the Python clients the test installs.
const (
	boto3Version  = "1.43.11"
	awscliVersion = "1.45.11"
)

// pythonEnv makes (once, in the user cache) a virtual environment with
// boto3 and the AWS CLI from PyPI, as `make test` must install what it
// needs itself.
func pythonEnv(t *testing.T) string {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed")
	}
	cache, err := os.UserCacheDir()
	if err != nil {
		cache = os.TempDir()
	}
	venv := filepath.Join(cache, "basalt", "pyenv-boto3-"+boto3Version+"-awscli-"+awscliVersion)
	if _, err := os.Stat(filepath.Join(venv, "ok")); err == nil {
		return venv
	}
	os.RemoveAll(venv)
	run := func(name string, args ...string) {
		cmd := exec.Command(name, args...)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
		}
	}
	run(py, "-m", "venv", venv)
	run(filepath.Join(venv, "bin", "pip"), "install", "--quiet", "boto3=="+boto3Version, "awscli=="+awscliVersion)
	if err := os.WriteFile(filepath.Join(venv, "ok"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	return venv
}

// TestPythonClients runs the core flows with boto3 and the AWS CLI.
func TestPythonClients(t *testing.T) {
	if testing.Short() {
		t.Skip("installs boto3 and the AWS CLI")
	}
	venv := pythonEnv(t)
	e := setup(t)
	env := append(os.Environ(), "ENDPOINT="+e.url, "AWS_ACCESS_KEY_ID="+accessKey, "AWS_SECRET_ACCESS_KEY="+secretKey,
		"AWS_DEFAULT_REGION="+region, "TMPDIR="+t.TempDir(), "AWS_CONFIG_FILE=/dev/null", "AWS_SHARED_CREDENTIALS_FILE=/dev/null")

	cmd := exec.Command(filepath.Join(venv, "bin", "python"), filepath.Join("testdata", "boto3_flows.py"))
	cmd.Env = env
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("boto3 flows: %v\n%s", err, out)
	}

	aws := func(stdin []byte, args ...string) string {
		cmd := exec.Command(filepath.Join(venv, "bin", "aws"), append([]string{"--endpoint-url", e.url}, args...)...)
		cmd.Env = env
		if stdin != nil {
			cmd.Stdin = bytes.NewReader(stdin)
		}
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("aws %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "f")
	data := bytes.Repeat([]byte("basalt-s3 "), 900000) // 9 MB: the CLI uses multipart above 8 MB
	os.WriteFile(src, data, 0o644)
	aws(nil, "s3", "mb", "s3://cli-bucket")
	aws(nil, "s3", "cp", src, "s3://cli-bucket/f")
	if out := aws(nil, "s3", "ls", "s3://cli-bucket/"); !strings.Contains(out, " f") {
		t.Fatalf("aws s3 ls: %s", out)
	}
	dst := filepath.Join(dir, "g")
	aws(nil, "s3", "cp", "s3://cli-bucket/f", dst)
	if got, _ := os.ReadFile(dst); !bytes.Equal(got, data) {
		t.Fatal("aws s3 cp returned different bytes")
	}
	aws(nil, "s3", "rm", "s3://cli-bucket/f")
	aws(nil, "s3", "rb", "s3://cli-bucket")
}
