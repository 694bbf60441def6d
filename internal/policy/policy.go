// Package policy parses, validates and evaluates S3 bucket policies: the
// subset of the IAM JSON policy language that docs/SECURITY.md lists.
// It is pure (no I/O, no clock): the caller passes the request, the time
// included.
//
// A document is parsed once (Parse), checked against the bucket it is for
// (Policy.CheckBucket), and then evaluated per request (Evaluate): an
// explicit Deny wins over any Allow; without a matching statement the
// answer is NotApplicable and the caller's ACLs decide.
package policy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// Limits of a document (S3 allows 20 KiB per bucket policy).
const (
	MaxBytes      = 20 << 10
	MaxStatements = 100
	maxList       = 100 // values of one Principal/Action/Resource/condition key
	maxString     = 1024
)

// Decision is what a policy says about a request.
type Decision int

const (
	NotApplicable Decision = iota // no statement matches
	Allow
	Deny
)

func (d Decision) String() string {
	switch d {
	case Allow:
		return "Allow"
	case Deny:
		return "Deny"
	}
	return "NotApplicable"
}

// Policy is a parsed, validated document.
type Policy struct {
	Version    string
	ID         string
	Statements []*Statement
	keys       map[string]bool // condition keys used
}

// UsesKey reports whether some condition tests key (lower-cased): a
// caller need not compute the others.
func (p *Policy) UsesKey(key string) bool { return p.keys[key] }

// Statement is one parsed statement.
type Statement struct {
	Sid          string
	Deny         bool // Effect "Deny"; else "Allow"
	Principal    *Principals
	NotPrincipal *Principals
	Actions      []string // lower-cased patterns
	NotActions   []string
	Resources    []string // patterns
	NotResources []string
	Conditions   []Condition
}

// Principals: "*" (everyone, anonymous included), or AWS user ARNs or
// names, or Basalt user names and "group:<name>".
type Principals struct {
	Any    bool
	Users  []string
	Groups []string
}

// Condition is one operator applied to one key.
type Condition struct {
	Op       string // canonical operator name, without IfExists
	IfExists bool
	Key      string // lower-cased condition key
	Values   []string
	ips      []netip.Prefix
	nums     []float64
	times    []time.Time
}

// Request is what Evaluate decides on.
type Request struct {
	User      string   // the authenticated user ("" when Anonymous)
	Groups    []string // the user's groups
	Anonymous bool
	Action    string // e.g. "s3:GetObject"
	Resource  string // "arn:aws:s3:::bucket" or "arn:aws:s3:::bucket/key"
	// Context holds condition keys' values, keys lower-cased
	// ("aws:sourceip", "s3:prefix"); a key absent is absent.
	Context map[string]string
}

// Error is a validation failure, its message meant for the user.
type Error struct{ Msg string }

func (e *Error) Error() string { return "invalid bucket policy: " + e.Msg }

func errf(format string, args ...any) error { return &Error{Msg: fmt.Sprintf(format, args...)} }

// ConditionKeys are the condition keys understood, lower-cased.
var ConditionKeys = map[string]string{
	"aws:sourceip":        "ip",
	"aws:securetransport": "bool",
	"aws:currenttime":     "date",
	"aws:epochtime":       "date",
	"aws:useragent":       "string",
	"aws:referer":         "string",
	"aws:username":        "string",
	"aws:principaltype":   "string",
	"s3:prefix":           "string",
	"s3:delimiter":        "string",
	"s3:max-keys":         "numeric",
}

// operators: canonical name by lower-cased name, and the value type each
// expects ("" = any string).
var operators = map[string]struct{ name, typ string }{}

func init() {
	for _, o := range []struct{ name, typ string }{
		{"StringEquals", "string"}, {"StringNotEquals", "string"},
		{"StringEqualsIgnoreCase", "string"}, {"StringNotEqualsIgnoreCase", "string"},
		{"StringLike", "string"}, {"StringNotLike", "string"},
		{"IpAddress", "ip"}, {"NotIpAddress", "ip"},
		{"Bool", "bool"},
		{"DateEquals", "date"}, {"DateNotEquals", "date"},
		{"DateLessThan", "date"}, {"DateLessThanEquals", "date"},
		{"DateGreaterThan", "date"}, {"DateGreaterThanEquals", "date"},
		{"NumericEquals", "numeric"}, {"NumericNotEquals", "numeric"},
		{"NumericLessThan", "numeric"}, {"NumericLessThanEquals", "numeric"},
		{"NumericGreaterThan", "numeric"}, {"NumericGreaterThanEquals", "numeric"},
		{"Null", "null"},
	} {
		operators[strings.ToLower(o.name)] = o
	}
}

// negated operators are true when the key is absent and when no value
// matches.
func negated(op string) bool {
	return strings.Contains(op, "Not") && op != "Null"
}

// Parse validates doc and returns the policy. Errors are *Error with a
// message that names the offending part.
func Parse(doc []byte) (*Policy, error) {
	if len(doc) == 0 {
		return nil, errf("empty document")
	}
	if len(doc) > MaxBytes {
		return nil, errf("document is %d bytes, at most %d", len(doc), MaxBytes)
	}
	if !utf8.Valid(doc) {
		return nil, errf("document is not valid UTF-8")
	}
	var raw map[string]json.RawMessage
	if err := strictUnmarshal(doc, &raw); err != nil {
		return nil, errf("not a JSON object: %v", err)
	}
	p := &Policy{}
	for k, v := range raw {
		switch k {
		case "Version":
			if err := strictUnmarshal(v, &p.Version); err != nil {
				return nil, errf("Version must be a string")
			}
		case "Id":
			if err := strictUnmarshal(v, &p.ID); err != nil || len(p.ID) > maxString {
				return nil, errf("Id must be a string of at most %d bytes", maxString)
			}
		case "Statement":
		default:
			return nil, errf("unknown element %q (want Version, Id, Statement)", clip(k))
		}
	}
	if p.Version != "2012-10-17" && p.Version != "2008-10-17" {
		return nil, errf("Version %q: want \"2012-10-17\" (or \"2008-10-17\")", clip(p.Version))
	}
	st, ok := raw["Statement"]
	if !ok {
		return nil, errf("no Statement")
	}
	var stmts []json.RawMessage
	if bytes.HasPrefix(bytes.TrimSpace(st), []byte("{")) {
		stmts = []json.RawMessage{st}
	} else if err := strictUnmarshal(st, &stmts); err != nil {
		return nil, errf("Statement must be an object or a list of objects")
	}
	if len(stmts) == 0 {
		return nil, errf("Statement is empty")
	}
	if len(stmts) > MaxStatements {
		return nil, errf("%d statements, at most %d", len(stmts), MaxStatements)
	}
	budget := maxMatchCost
	sids := map[string]bool{}
	for i, s := range stmts {
		ps, err := parseStatement(s)
		if err != nil {
			return nil, errf("statement %d: %s", i+1, err.(*Error).Msg)
		}
		if ps.Sid != "" {
			if sids[ps.Sid] {
				return nil, errf("statement %d: duplicate Sid %q", i+1, clip(ps.Sid))
			}
			sids[ps.Sid] = true
		}
		p.Statements = append(p.Statements, ps)
		if budget -= ps.matchCost(); budget < 0 {
			return nil, errf("the wildcard patterns are too complex to evaluate per request (statement %d: long literal runs after '*'; use shorter patterns or fewer of them)", i+1)
		}
		for _, c := range ps.Conditions {
			if p.keys == nil {
				p.keys = map[string]bool{}
			}
			p.keys[c.Key] = true
		}
	}
	return p, nil
}

func strictUnmarshal(b []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(b))
	if err := d.Decode(v); err != nil {
		return err
	}
	if d.More() {
		return fmt.Errorf("trailing data")
	}
	var extra json.RawMessage
	if err := d.Decode(&extra); err == nil {
		return fmt.Errorf("trailing data")
	}
	return nil
}

func clip(s string) string {
	if len(s) > 64 {
		s = s[:64] + "…"
	}
	return strings.ToValidUTF8(s, "?")
}

func parseStatement(b json.RawMessage) (*Statement, error) {
	var raw map[string]json.RawMessage
	if err := strictUnmarshal(b, &raw); err != nil {
		return nil, errf("not a JSON object")
	}
	s := &Statement{}
	var err error
	for k, v := range raw {
		switch k {
		case "Sid":
			if strictUnmarshal(v, &s.Sid) != nil || len(s.Sid) > maxString {
				return nil, errf("Sid must be a string of at most %d bytes", maxString)
			}
		case "Effect":
			var e string
			if strictUnmarshal(v, &e) != nil || e != "Allow" && e != "Deny" {
				return nil, errf("Effect must be \"Allow\" or \"Deny\"")
			}
			s.Deny = e == "Deny"
		case "Principal":
			s.Principal, err = parsePrincipal(v)
		case "NotPrincipal":
			s.NotPrincipal, err = parsePrincipal(v)
		case "Action":
			s.Actions, err = parseActions(v)
		case "NotAction":
			s.NotActions, err = parseActions(v)
		case "Resource":
			s.Resources, err = parseResources(v)
		case "NotResource":
			s.NotResources, err = parseResources(v)
		case "Condition":
			s.Conditions, err = parseConditions(v)
		default:
			return nil, errf("unknown element %q", clip(k))
		}
		if err != nil {
			return nil, errf("%s: %s", k, err.(*Error).Msg)
		}
	}
	if _, ok := raw["Effect"]; !ok {
		return nil, errf("no Effect")
	}
	if (s.Principal == nil) == (s.NotPrincipal == nil) {
		return nil, errf("exactly one of Principal and NotPrincipal is required in a bucket policy")
	}
	if s.NotPrincipal != nil && s.NotPrincipal.Any {
		return nil, errf("NotPrincipal \"*\" matches nobody")
	}
	if (s.Actions == nil) == (s.NotActions == nil) {
		return nil, errf("exactly one of Action and NotAction is required")
	}
	if (s.Resources == nil) == (s.NotResources == nil) {
		return nil, errf("exactly one of Resource and NotResource is required")
	}
	return s, nil
}

// stringList reads a string or a non-empty list of strings.
func stringList(v json.RawMessage) ([]string, error) {
	var one string
	if strictUnmarshal(v, &one) == nil {
		return []string{one}, nil
	}
	var many []string
	if err := strictUnmarshal(v, &many); err != nil {
		return nil, errf("want a string or a list of strings")
	}
	if len(many) == 0 {
		return nil, errf("empty list")
	}
	if len(many) > maxList {
		return nil, errf("%d values, at most %d", len(many), maxList)
	}
	return many, nil
}

func checkString(s string) error {
	if s == "" {
		return errf("empty value")
	}
	if len(s) > maxString {
		return errf("value of %d bytes, at most %d", len(s), maxString)
	}
	return nil
}

func parsePrincipal(v json.RawMessage) (*Principals, error) {
	var star string
	if strictUnmarshal(v, &star) == nil {
		if star != "*" {
			return nil, errf("a string principal must be \"*\" (else {\"AWS\": ...} or {\"Basalt\": ...})")
		}
		return &Principals{Any: true}, nil
	}
	var m map[string]json.RawMessage
	if err := strictUnmarshal(v, &m); err != nil || len(m) == 0 {
		return nil, errf("want \"*\" or an object {\"AWS\": ...} / {\"Basalt\": ...}")
	}
	p := &Principals{}
	for k, raw := range m {
		vals, err := stringList(raw)
		if err != nil {
			return nil, errf("%s: %s", clip(k), err.(*Error).Msg)
		}
		for _, s := range vals {
			if err := checkString(s); err != nil {
				return nil, errf("%s: %s", clip(k), err.(*Error).Msg)
			}
			switch k {
			case "AWS":
				switch {
				case s == "*":
					p.Any = true
				case strings.HasPrefix(s, "arn:aws:iam::"):
					rest := s[len("arn:aws:iam::"):]
					i := strings.Index(rest, ":user/")
					if i < 0 || i+len(":user/") == len(rest) {
						return nil, errf("AWS principal %q: want \"*\", a user name or arn:aws:iam::<account>:user/<name>", clip(s))
					}
					p.Users = append(p.Users, rest[i+len(":user/"):])
				case strings.Contains(s, ":"):
					return nil, errf("AWS principal %q: want \"*\", a user name or arn:aws:iam::<account>:user/<name>", clip(s))
				default:
					p.Users = append(p.Users, s)
				}
			case "Basalt":
				switch {
				case s == "*":
					p.Any = true
				case strings.HasPrefix(s, "group:") && len(s) > len("group:"):
					p.Groups = append(p.Groups, s[len("group:"):])
				case strings.HasPrefix(s, "user:") && len(s) > len("user:"):
					p.Users = append(p.Users, s[len("user:"):])
				default:
					p.Users = append(p.Users, s)
				}
			default:
				return nil, errf("principal type %q not supported (want AWS or Basalt)", clip(k))
			}
		}
	}
	return p, nil
}

// Actions is every S3 action a policy may name (lower-cased, without the
// "s3:" prefix); wildcards must match at least one.
var Actions = func() map[string]bool {
	m := map[string]bool{}
	for _, a := range []string{
		"GetObject", "PutObject", "DeleteObject", "ListBucket", "GetObjectAcl", "PutObjectAcl",
		"GetBucketAcl", "PutBucketAcl", "GetBucketPolicy", "PutBucketPolicy", "DeleteBucketPolicy",
		"GetBucketPolicyStatus", "GetBucketPublicAccessBlock", "PutBucketPublicAccessBlock",
		"AbortMultipartUpload", "ListMultipartUploadParts", "ListBucketMultipartUploads",
		"CreateBucket", "DeleteBucket", "GetBucketLocation", "ListAllMyBuckets", "GetObjectVersion",
		"DeleteObjectVersion", "GetObjectTagging", "PutObjectTagging", "DeleteObjectTagging",
		"GetBucketTagging", "PutBucketTagging", "GetBucketVersioning", "PutBucketVersioning",
		"GetLifecycleConfiguration", "PutLifecycleConfiguration", "GetBucketCORS", "PutBucketCORS",
		"GetEncryptionConfiguration", "PutEncryptionConfiguration", "GetObjectAttributes",
		"ListBucketVersions", "GetBucketOwnershipControls", "PutBucketOwnershipControls", "RestoreObject",
	} {
		m[strings.ToLower(a)] = true
	}
	return m
}()

func parseActions(v json.RawMessage) ([]string, error) {
	vals, err := stringList(v)
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(vals))
	for _, a := range vals {
		if err := checkString(a); err != nil {
			return nil, err
		}
		la := strings.ToLower(a)
		if la == "*" {
			out = append(out, la)
			continue
		}
		name, ok := strings.CutPrefix(la, "s3:")
		if !ok {
			return nil, errf("action %q: only s3 actions (s3:...) apply to a bucket", clip(a))
		}
		known := false
		if strings.ContainsAny(name, "*?") {
			for k := range Actions {
				if Match(name, k) {
					known = true
					break
				}
			}
		} else {
			known = Actions[name]
		}
		if !known {
			return nil, errf("action %q matches no S3 action", clip(a))
		}
		out = append(out, la)
	}
	return out, nil
}

const arnPrefix = "arn:aws:s3:::"

func parseResources(v json.RawMessage) ([]string, error) {
	vals, err := stringList(v)
	if err != nil {
		return nil, err
	}
	for _, r := range vals {
		if err := checkString(r); err != nil {
			return nil, err
		}
		if r == "*" {
			continue
		}
		rest, ok := strings.CutPrefix(r, arnPrefix)
		if !ok || rest == "" {
			return nil, errf("resource %q: want arn:aws:s3:::<bucket> or arn:aws:s3:::<bucket>/<key pattern>", clip(r))
		}
	}
	return vals, nil
}

// CheckBucket reports a resource that names another bucket than bucket
// (S3 refuses such a policy: "Policy has invalid resource").
func (p *Policy) CheckBucket(bucket string) error {
	for i, s := range p.Statements {
		for _, r := range append(append([]string(nil), s.Resources...), s.NotResources...) {
			if r == "*" {
				continue
			}
			rest := strings.TrimPrefix(r, arnPrefix)
			b, _, _ := strings.Cut(rest, "/")
			if b != bucket && !(strings.ContainsAny(b, "*?") && Match(b, bucket)) {
				return errf("statement %d: resource %q is not in bucket %q", i+1, clip(r), clip(bucket))
			}
		}
	}
	return nil
}

func parseConditions(v json.RawMessage) ([]Condition, error) {
	var m map[string]map[string]json.RawMessage
	if err := strictUnmarshal(v, &m); err != nil {
		return nil, errf("want {\"Operator\": {\"key\": value(s)}}")
	}
	var out []Condition
	for opName, keys := range m {
		lo := strings.ToLower(opName)
		if strings.HasPrefix(lo, "forallvalues:") || strings.HasPrefix(lo, "foranyvalue:") {
			return nil, errf("set operators (%s) are not supported", clip(opName))
		}
		ifExists := false
		if base, ok := strings.CutSuffix(lo, "ifexists"); ok && base != "null" {
			lo, ifExists = base, true
		}
		op, ok := operators[lo]
		if !ok {
			return nil, errf("unknown condition operator %q", clip(opName))
		}
		if len(keys) == 0 {
			return nil, errf("%s: no condition keys", op.name)
		}
		for key, raw := range keys {
			lk := strings.ToLower(key)
			ktyp, ok := ConditionKeys[lk]
			if !ok {
				return nil, errf("%s: condition key %q not supported", op.name, clip(key))
			}
			vals, err := condValues(raw)
			if err != nil {
				return nil, errf("%s: %s: %s", op.name, clip(key), err.(*Error).Msg)
			}
			c := Condition{Op: op.name, IfExists: ifExists, Key: lk, Values: vals}
			if err := c.compile(op.typ, ktyp); err != nil {
				return nil, errf("%s: %s: %s", op.name, clip(key), err.(*Error).Msg)
			}
			out = append(out, c)
		}
	}
	return out, nil
}

// condValues reads a value or list of values (strings, numbers, booleans).
func condValues(raw json.RawMessage) ([]string, error) {
	var vals []any
	if bytes.HasPrefix(bytes.TrimSpace(raw), []byte("[")) {
		if err := strictUnmarshal(raw, &vals); err != nil {
			return nil, errf("want a value or a list of values")
		}
	} else {
		var one any
		if err := strictUnmarshal(raw, &one); err != nil {
			return nil, errf("want a value or a list of values")
		}
		vals = []any{one}
	}
	if len(vals) == 0 {
		return nil, errf("empty list")
	}
	if len(vals) > maxList {
		return nil, errf("%d values, at most %d", len(vals), maxList)
	}
	out := make([]string, 0, len(vals))
	for _, v := range vals {
		switch x := v.(type) {
		case string:
			if len(x) > maxString {
				return nil, errf("value of %d bytes, at most %d", len(x), maxString)
			}
			out = append(out, x)
		case bool:
			out = append(out, strconv.FormatBool(x))
		case float64:
			out = append(out, strconv.FormatFloat(x, 'f', -1, 64))
		default:
			return nil, errf("values must be strings, numbers or booleans")
		}
	}
	return out, nil
}

func (c *Condition) compile(opTyp, keyTyp string) error {
	switch opTyp {
	case "null":
		for _, v := range c.Values {
			if v != "true" && v != "false" {
				return errf("Null takes true or false, not %q", clip(v))
			}
		}
		return nil
	case "string":
		if keyTyp == "ip" || keyTyp == "bool" {
			return errf("a %s key needs a %s operator", keyTyp, map[string]string{"ip": "IpAddress", "bool": "Bool"}[keyTyp])
		}
		return nil
	case "ip":
		if keyTyp != "ip" {
			return errf("IP operators apply to aws:SourceIp only")
		}
		for _, v := range c.Values {
			p, err := netip.ParsePrefix(v)
			if err != nil {
				a, err2 := netip.ParseAddr(v)
				if err2 != nil {
					return errf("%q is not an IP address or CIDR range", clip(v))
				}
				p = netip.PrefixFrom(a, a.BitLen())
			}
			c.ips = append(c.ips, p.Masked())
		}
	case "bool":
		if keyTyp != "bool" {
			return errf("Bool applies to boolean keys (aws:SecureTransport)")
		}
		for _, v := range c.Values {
			if !strings.EqualFold(v, "true") && !strings.EqualFold(v, "false") {
				return errf("%q is not true or false", clip(v))
			}
		}
	case "date":
		if keyTyp != "date" {
			return errf("Date operators apply to aws:CurrentTime and aws:EpochTime")
		}
		for _, v := range c.Values {
			t, err := parseTime(v)
			if err != nil {
				return errf("%q is not a date (RFC 3339 or epoch seconds)", clip(v))
			}
			c.times = append(c.times, t)
		}
	case "numeric":
		if keyTyp != "numeric" {
			return errf("Numeric operators apply to numeric keys (s3:max-keys)")
		}
		for _, v := range c.Values {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				return errf("%q is not a number", clip(v))
			}
			c.nums = append(c.nums, f)
		}
	}
	return nil
}

func parseTime(v string) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339, v); err == nil {
		return t, nil
	}
	if t, err := time.Parse("2006-01-02", v); err == nil {
		return t, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 || n > 1<<40 {
		return time.Time{}, fmt.Errorf("not a time")
	}
	return time.Unix(n, 0), nil
}

// maxMatchCost bounds what Match may cost per request over a whole
// policy, in byte comparisons: Match backtracks at most over the literal
// run after the last '*', so a pattern costs at most that run's length
// times the subject's (a resource of at most maxSubject bytes). About
// 3 ms on this project's VM; real policies stay far below it.
const (
	maxMatchCost = 4_000_000
	maxSubject   = 1100 // arn:aws:s3::: + bucket + "/" + a 1 KiB key
)

// globCost is the worst-case comparisons of matching pattern against a
// subject of maxSubject bytes, beyond the linear scan.
func globCost(pattern string) int {
	i := strings.IndexByte(pattern, '*')
	if i < 0 {
		return 0
	}
	longest := 0
	for _, seg := range strings.Split(pattern[i+1:], "*") {
		longest = max(longest, len(seg))
	}
	return longest * maxSubject
}

func (s *Statement) matchCost() int {
	n := 0
	for _, l := range [][]string{s.Actions, s.NotActions, s.Resources, s.NotResources} {
		for _, p := range l {
			n += globCost(p)
		}
	}
	for _, c := range s.Conditions {
		if c.Op == "StringLike" || c.Op == "StringNotLike" {
			for _, v := range c.Values {
				n += globCost(v)
			}
		}
	}
	return n
}

// Match reports whether s matches pattern, where * matches any run of
// characters and ? any one (IAM's wildcards). One backtrack point: at
// most len(s) times the literal run after the last '*' (see globCost).
func Match(pattern, s string) bool {
	p, i := 0, 0
	starP, starI := -1, 0
	for i < len(s) {
		switch {
		case p < len(pattern) && pattern[p] == '*':
			starP, starI = p, i
			p++
		case p < len(pattern) && (pattern[p] == '?' || pattern[p] == s[i]):
			p++
			i++
		case starP >= 0:
			starI++
			p, i = starP+1, starI
		default:
			return false
		}
	}
	for p < len(pattern) && pattern[p] == '*' {
		p++
	}
	return p == len(pattern)
}
