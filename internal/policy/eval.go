package policy

import (
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Evaluate decides req: Deny if any matching statement denies, else
// Allow if any allows, else NotApplicable.
func (p *Policy) Evaluate(req *Request) Decision {
	d := NotApplicable
	for _, s := range p.Statements {
		if !s.matches(req) {
			continue
		}
		if s.Deny {
			return Deny
		}
		d = Allow
	}
	return d
}

func (s *Statement) matches(req *Request) bool {
	if s.Principal != nil && !s.Principal.matches(req) {
		return false
	}
	if s.NotPrincipal != nil && s.NotPrincipal.matches(req) {
		return false
	}
	action := strings.ToLower(req.Action)
	if s.Actions != nil && !slices.ContainsFunc(s.Actions, func(p string) bool { return Match(p, action) }) {
		return false
	}
	if s.NotActions != nil && slices.ContainsFunc(s.NotActions, func(p string) bool { return Match(p, action) }) {
		return false
	}
	if s.Resources != nil && !slices.ContainsFunc(s.Resources, func(p string) bool { return Match(p, req.Resource) }) {
		return false
	}
	if s.NotResources != nil && slices.ContainsFunc(s.NotResources, func(p string) bool { return Match(p, req.Resource) }) {
		return false
	}
	for i := range s.Conditions {
		if !s.Conditions[i].holds(req.Context) {
			return false
		}
	}
	return true
}

func (p *Principals) matches(req *Request) bool {
	if p.Any {
		return true
	}
	if req.Anonymous {
		return false
	}
	if slices.Contains(p.Users, req.User) {
		return true
	}
	for _, g := range p.Groups {
		if slices.Contains(req.Groups, g) {
			return true
		}
	}
	return false
}

// holds evaluates the condition on the request's context. Positive
// operators are false for an absent key and true if any value matches;
// negated ones true for an absent key and true if no value matches;
// ...IfExists makes an absent key true.
func (c *Condition) holds(ctx map[string]string) bool {
	v, present := ctx[c.Key]
	if c.Op == "Null" {
		want := c.Values[0] == "true"
		return want == !present
	}
	if !present {
		return c.IfExists || negated(c.Op)
	}
	hit := false
	switch c.Op {
	case "StringEquals", "StringNotEquals":
		hit = slices.Contains(c.Values, v)
	case "StringEqualsIgnoreCase", "StringNotEqualsIgnoreCase":
		hit = slices.ContainsFunc(c.Values, func(x string) bool { return strings.EqualFold(x, v) })
	case "StringLike", "StringNotLike":
		hit = slices.ContainsFunc(c.Values, func(x string) bool { return Match(x, v) })
	case "IpAddress", "NotIpAddress":
		a, err := netip.ParseAddr(v)
		if err != nil {
			return negated(c.Op)
		}
		a = a.Unmap()
		hit = slices.ContainsFunc(c.ips, func(p netip.Prefix) bool { return p.Contains(a) })
	case "Bool":
		hit = slices.ContainsFunc(c.Values, func(x string) bool { return strings.EqualFold(x, v) })
	case "DateEquals", "DateNotEquals", "DateLessThan", "DateLessThanEquals", "DateGreaterThan", "DateGreaterThanEquals":
		t, err := parseTime(v)
		if err != nil {
			return negated(c.Op)
		}
		hit = slices.ContainsFunc(c.times, func(x time.Time) bool { return compare(c.Op, t.Compare(x)) })
	default: // Numeric*
		n, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return negated(c.Op)
		}
		hit = slices.ContainsFunc(c.nums, func(x float64) bool {
			cmp := 0
			if n < x {
				cmp = -1
			} else if n > x {
				cmp = 1
			}
			return compare(c.Op, cmp)
		})
	}
	if negated(c.Op) {
		return !hit
	}
	return hit
}

// compare applies a Date/Numeric operator to cmp (request value against
// policy value: -1, 0, 1). Negated operators test equality here.
func compare(op string, cmp int) bool {
	switch {
	case strings.HasSuffix(op, "LessThanEquals"):
		return cmp <= 0
	case strings.HasSuffix(op, "LessThan"):
		return cmp < 0
	case strings.HasSuffix(op, "GreaterThanEquals"):
		return cmp >= 0
	case strings.HasSuffix(op, "GreaterThan"):
		return cmp > 0
	}
	return cmp == 0 // Equals, NotEquals (negated by the caller)
}

// IsPublic reports whether the policy is public as S3 defines it for
// Block Public Access and PolicyStatus: some Allow statement grants to
// everyone ("*" or a NotPrincipal) without a condition that pins it to
// fixed values of a narrowing key — here aws:SourceIp ranges no wider
// than /8 (IPv4) or /32 (IPv6), or aws:username with StringEquals.
func (p *Policy) IsPublic() bool {
	for _, s := range p.Statements {
		if s.Deny {
			continue
		}
		if s.NotPrincipal == nil && !s.Principal.Any {
			continue
		}
		if !s.narrowed() {
			return true
		}
	}
	return false
}

func (s *Statement) narrowed() bool {
	for _, c := range s.Conditions {
		if c.IfExists {
			continue
		}
		switch {
		case c.Op == "IpAddress" && c.Key == "aws:sourceip":
			ok := true
			for _, p := range c.ips {
				if p.Addr().Is4() && p.Bits() < 8 || !p.Addr().Is4() && p.Bits() < 32 {
					ok = false
				}
			}
			if ok {
				return true
			}
		case (c.Op == "StringEquals" || c.Op == "StringEqualsIgnoreCase") && c.Key == "aws:username":
			return true
		}
	}
	return false
}
