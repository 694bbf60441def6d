package main

import "testing"

func TestDebugListenAddr(t *testing.T) {
	for in, want := range map[string]string{":9879": "127.0.0.1:9879", "0.0.0.0:9879": "0.0.0.0:9879", "[::1]:1": "[::1]:1", "10.0.0.1:80": "10.0.0.1:80"} {
		got, err := debugListenAddr(in)
		if err != nil || got != want {
			t.Fatalf("%q: %q %v, want %q", in, got, err, want)
		}
	}
	if _, err := debugListenAddr("9879"); err == nil {
		t.Fatal("a port without a colon was accepted")
	}
	stop, addr, err := serveDebug(":0", newRegistry())
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	if addr[:10] != "127.0.0.1:" {
		t.Fatalf("debug endpoints on %s, want loopback", addr)
	}
}
