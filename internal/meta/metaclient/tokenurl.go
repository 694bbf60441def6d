package metaclient

import (
	"encoding/base64"
	"errors"
	"fmt"
	"unicode/utf8"
)

// Hadoop's Token URL string (Token.encodeToUrlString): base64url without
// padding of the Writable
//
//	vint len | identifier | vint len | password | Text kind | Text service
//
// (a Text is a vint length and UTF-8 bytes). User tokens travel in this
// form everywhere, so a WebHDFS delegation token is one Hadoop's client
// decodes, stores and sends back as it does the NameNode's.

// Token kinds: what the metadata service issues, and what the WebHDFS
// gateway hands to Hadoop's client (whose renewer looks tokens up by
// kind).
const (
	UserTokenKind    = "BASALT_USER_TOKEN"
	WebHDFSTokenKind = "WEBHDFS delegation"
)

// MaxTokenURLBytes bounds a token URL string before it is decoded.
const MaxTokenURLBytes = 2048

// TokenParts are the fields of a Hadoop token.
type TokenParts struct {
	Identifier, Password []byte
	Kind, Service        string
}

// EncodeTokenURL encodes t as Hadoop's Token.encodeToUrlString does.
func EncodeTokenURL(t TokenParts) string {
	var b []byte
	b = writeVLong(b, int64(len(t.Identifier)))
	b = append(b, t.Identifier...)
	b = writeVLong(b, int64(len(t.Password)))
	b = append(b, t.Password...)
	b = writeVLong(b, int64(len(t.Kind)))
	b = append(b, t.Kind...)
	b = writeVLong(b, int64(len(t.Service)))
	b = append(b, t.Service...)
	return base64.RawURLEncoding.EncodeToString(b)
}

// ErrBadToken: a token that does not decode.
var ErrBadToken = errors.New("malformed token")

// DecodeTokenURL decodes a token URL string (padding optional), checking
// every length against what is left before it reads on.
func DecodeTokenURL(s string) (TokenParts, error) {
	if len(s) == 0 || len(s) > MaxTokenURLBytes {
		return TokenParts{}, fmt.Errorf("%w: %d characters (want 1 to %d)", ErrBadToken, len(s), MaxTokenURLBytes)
	}
	for len(s) > 0 && s[len(s)-1] == '=' {
		s = s[:len(s)-1]
	}
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil {
		return TokenParts{}, fmt.Errorf("%w: %v", ErrBadToken, err)
	}
	var t TokenParts
	field := func() ([]byte, error) {
		n, rest, err := readVLong(b)
		if err != nil {
			return nil, err
		}
		if n < 0 || n > int64(len(rest)) {
			return nil, fmt.Errorf("%w: a field of %d bytes with %d left", ErrBadToken, n, len(rest))
		}
		b = rest[n:]
		return rest[:n], nil
	}
	if t.Identifier, err = field(); err != nil {
		return t, err
	}
	if t.Password, err = field(); err != nil {
		return t, err
	}
	kind, err := field()
	if err != nil {
		return t, err
	}
	svc, err := field()
	if err != nil {
		return t, err
	}
	if len(b) != 0 || !utf8.Valid(kind) || !utf8.Valid(svc) {
		return t, fmt.Errorf("%w: trailing bytes or invalid text", ErrBadToken)
	}
	t.Kind, t.Service = string(kind), string(svc)
	return t, nil
}

// writeVLong is Hadoop's WritableUtils.writeVLong.
func writeVLong(b []byte, i int64) []byte {
	if i >= -112 && i <= 127 {
		return append(b, byte(i))
	}
	l := -112
	if i < 0 {
		i ^= -1
		l = -120
	}
	for tmp := i; tmp != 0; tmp >>= 8 {
		l--
	}
	b = append(b, byte(int8(l)))
	if l < -120 {
		l = -(l + 120)
	} else {
		l = -(l + 112)
	}
	for idx := l; idx != 0; idx-- {
		b = append(b, byte(i>>((idx-1)*8)))
	}
	return b
}

// readVLong is Hadoop's WritableUtils.readVLong.
func readVLong(b []byte) (int64, []byte, error) {
	if len(b) == 0 {
		return 0, nil, fmt.Errorf("%w: truncated", ErrBadToken)
	}
	first := int8(b[0])
	if first >= -112 {
		return int64(first), b[1:], nil
	}
	size := -111 - int(first)
	if first < -120 {
		size = -119 - int(first)
	}
	if len(b) < size {
		return 0, nil, fmt.Errorf("%w: truncated", ErrBadToken)
	}
	var v int64
	for _, c := range b[1:size] {
		v = v<<8 | int64(c)
	}
	if first < -120 {
		v ^= -1
	}
	return v, b[size:], nil
}

// UserTokenOwner returns the user a user token names, without checking
// it (only the metadata service can: it verifies the token on every call
// that carries it). For gateways that must know the user beforehand (the
// owner of a file a WebHDFS CREATE records).
func UserTokenOwner(tok string) (string, error) {
	t, err := DecodeTokenURL(tok)
	if err != nil {
		return "", err
	}
	// version u8 (2) | flags u8 | user length u8 | renewer length u8 | 5 × 8 | user | renewer | access key binding
	const fixed = 4 + 5*8
	id := t.Identifier
	if len(id) < fixed || id[0] != 2 || len(id) < fixed+int(id[2])+int(id[3]) || id[2] == 0 {
		return "", fmt.Errorf("%w: not a Basalt user token", ErrBadToken)
	}
	u := id[fixed : fixed+int(id[2])]
	if !utf8.Valid(u) {
		return "", fmt.Errorf("%w: invalid user name", ErrBadToken)
	}
	return string(u), nil
}
