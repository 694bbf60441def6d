package pki

import "testing"

// The parsers a caller without a certificate reaches (IssueCertificate:
// a bootstrap token and a CSR) and those of the admin CLI (identities,
// serials): any input gets a value or an error, never a panic.

func FuzzParseBootstrapToken(f *testing.F) {
	f.Add("bt1.abc.def.0123456789abcdef")
	f.Add("")
	f.Add("bt1....")
	f.Fuzz(func(t *testing.T, s string) {
		_, _ = ParseBootstrapToken(s)
	})
}

func FuzzParseCSR(f *testing.F) {
	if _, der, err := NewCSR(Identity{Role: RoleDatanode, ID: "x"}); err == nil {
		f.Add(der)
	}
	f.Add([]byte{0x30, 0x00})
	f.Fuzz(func(t *testing.T, der []byte) {
		_, _, _, _ = ParseCSR(der)
	})
}

func FuzzParseIdentityAndSerial(f *testing.F) {
	f.Add("basalt://datanode/abc")
	f.Add("0a:ff")
	f.Fuzz(func(t *testing.T, s string) {
		_, _ = ParseIdentity(s)
		_, _ = ParseSerial(s)
	})
}
