// Package keyrec decodes encoded KeyInfo messages (the key records the
// metadata service stores, and the keys of its lookup answers) without
// proto.Unmarshal's reflection for the shapes lookups see most: a plain
// key's record (names, sizes, times, blocks) and an S3 object's
// attributes (ObjectMeta). Decode agrees with proto.Unmarshal on every
// input (TestDecodeMatchesUnmarshal and FuzzDecode here, and the
// namespace package's TestDecodeRecordMatchesUnmarshal and
// FuzzDecodeRecord); any other shape goes through proto.Unmarshal. Used
// by the lookup cache (internal/meta/namespace) and the metadata
// client's lookups (internal/meta/metaclient), issue 15.
package keyrec

import (
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/basalt-store/basalt/internal/meta/metapb"
)

// Names are strings a record likely holds (its volume, bucket and name):
// a decoded record's equal strings are these, not copies.
type Names struct{ Volume, Bucket, Name string }

// recordBlock is one block of a decoded record.
type recordBlock struct {
	kb metapb.KeyBlock
	id metapb.BlockID
}

// blockOne is a decoded record's only block and its slice, in one
// allocation.
type blockOne struct {
	blk [1]recordBlock
	ptr [1]*metapb.KeyBlock
}

// recordOne is a decoded record of at most one block in one allocation.
type recordOne struct {
	ki metapb.KeyInfo
	blockOne
}

// Decode decodes an encoded KeyInfo in b (a stored record, or a key in a
// lookup's answer) as proto.Unmarshal does (TestDecodeMatchesUnmarshal,
// FuzzDecode), keeping no part of b. A record of the shapes DecodeOwn
// accepts is decoded by it; any other field (ACLs, locations, file
// attributes, unknown fields), or an encoding DecodeOwn does not expect,
// goes through proto.Unmarshal.
func Decode(b []byte, names Names) (*metapb.KeyInfo, error) {
	if ki, ok := DecodeOwn(b, names); ok {
		return ki, nil
	}
	ki := &metapb.KeyInfo{}
	return ki, proto.Unmarshal(b, ki)
}

// DecodeOwn decodes b as proto.Unmarshal would if it holds only the
// fields keyrec decodes itself, and returns false (having allocated
// nothing) otherwise. A record of the fields lookups of plain keys carry
// (names, sizes, times, blocks of ids and lengths) is decoded in one
// allocation for one block, plus one per string not in names; an S3
// object's attributes (ObjectMeta without upload_acls) in two more (the
// message and one copy of its strings) plus a map for each of user,
// tags, checksums present (5 for a small PUT's record, proto.Unmarshal
// 18).
func DecodeOwn(b []byte, names Names) (*metapb.KeyInfo, bool) {
	nb, ok := scan(b)
	if !ok {
		return nil, false
	}
	return decodePlain(nil, b, nb, names), true
}

// DecodeOwnInto is DecodeOwn into ki, which it resets first; it leaves
// ki untouched and returns false if b holds a field keyrec does not
// decode itself. A record of one block costs one allocation fewer than
// DecodeOwn's.
func DecodeOwnInto(ki *metapb.KeyInfo, b []byte, names Names) bool {
	nb, ok := scan(b)
	if !ok {
		return false
	}
	proto.Reset(ki)
	decodePlain(ki, b, nb, names)
	return true
}

// str is v as a string: known if equal.
func str(v []byte, known string) string {
	if string(v) == known {
		return known
	}
	return string(v)
}

// decodePlain decodes b, which scan accepted (nb blocks), into ki (a
// reset message) or, if ki is nil, a new one.
func decodePlain(ki *metapb.KeyInfo, b []byte, nb int, names Names) *metapb.KeyInfo {
	var blocks []recordBlock
	var ptrs []*metapb.KeyBlock
	switch {
	case nb <= 1 && ki == nil:
		one := &recordOne{}
		ki = &one.ki
		blocks, ptrs = one.blk[:nb], one.ptr[:nb]
	case nb == 1:
		one := &blockOne{}
		blocks, ptrs = one.blk[:], one.ptr[:]
	case nb > 1:
		blocks = make([]recordBlock, nb)
		ptrs = make([]*metapb.KeyBlock, nb)
	}
	if ki == nil {
		ki = &metapb.KeyInfo{}
	}
	if nb > 0 {
		for i := range blocks {
			ptrs[i] = &blocks[i].kb
		}
		ki.Blocks = ptrs
	}
	j := 0
	for p := 0; p < len(b); {
		num, typ, n := protowire.ConsumeTag(b[p:])
		p += n
		if typ == protowire.BytesType {
			v, n := protowire.ConsumeBytes(b[p:])
			p += n
			switch num {
			case 13:
				ki.Meta = decodeObjectMeta(v)
			case 1:
				ki.Volume = str(v, names.Volume)
			case 2:
				ki.Bucket = str(v, names.Bucket)
			case 3:
				ki.Name = str(v, names.Name)
			case 10:
				kb := ki.Blocks[j]
				j++
				for q := 0; q < len(v); {
					_, bt, n := protowire.ConsumeTag(v[q:])
					q += n
					if bt == protowire.BytesType {
						w, n := protowire.ConsumeBytes(v[q:])
						q += n
						id := &blocks[j-1].id
						kb.Id = id
						for r := 0; r < len(w); {
							in, _, n := protowire.ConsumeTag(w[r:])
							r += n
							x, n := protowire.ConsumeVarint(w[r:])
							r += n
							if in == 1 {
								id.ContainerId = x
							} else {
								id.LocalId = x
							}
						}
						continue
					}
					x, n := protowire.ConsumeVarint(v[q:])
					q += n
					kb.Length = x // field 2
				}
			}
			continue
		}
		x, n := protowire.ConsumeVarint(b[p:])
		p += n
		switch num {
		case 4:
			ki.Size = x
		case 5:
			ki.Replication = metapb.Replication(int32(x))
		case 6:
			ki.ChecksumType = metapb.ChecksumType(int32(x))
		case 7:
			ki.BytesPerChecksum = uint32(x)
		case 8:
			ki.CreatedUnixMs = int64(x)
		case 9:
			ki.ModifiedUnixMs = int64(x)
		case 12:
			ki.ObjectId = x
		}
	}
	return ki
}

// scan checks that b holds only what DecodeOwn decodes itself,
// each field once at most within a block, and counts the blocks.
func scan(b []byte) (blocks int, ok bool) {
	meta := false
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return 0, false
		}
		b = b[n:]
		switch {
		case typ == protowire.BytesType && (num == 1 || num == 2 || num == 3 || num == 10):
			v, n := protowire.ConsumeBytes(b)
			// Strings must be UTF-8 (proto.Unmarshal's error otherwise).
			if n < 0 || num == 10 && !scanBlock(v) || num != 10 && !utf8.Valid(v) {
				return 0, false
			}
			if num == 10 {
				blocks++
			}
			b = b[n:]
		case typ == protowire.BytesType && num == 13 && !meta:
			// An S3 object's attributes (ObjectMeta), once: a second
			// would be merged into the first.
			v, n := protowire.ConsumeBytes(b)
			if n < 0 || !scanObjectMeta(v) {
				return 0, false
			}
			meta = true
			b = b[n:]
		case typ == protowire.VarintType && (num >= 4 && num <= 9 || num == 12):
			_, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return 0, false
			}
			b = b[n:]
		default:
			return 0, false
		}
	}
	return blocks, true
}

// scanObjectMeta checks an ObjectMeta for decodeObjectMeta: its strings
// (fields 1-7) valid UTF-8, its maps' entries (user, tags, checksums:
// fields 8-10) of a UTF-8 key and value each at most once, parts_count
// (11) a varint; any other field (upload_acls, unknown fields) or wire
// type is left to proto.Unmarshal.
func scanObjectMeta(b []byte) bool {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		switch {
		case typ == protowire.BytesType && num >= 1 && num <= 10:
			v, n := protowire.ConsumeBytes(b)
			if n < 0 || num <= 7 && !utf8.Valid(v) || num >= 8 && !scanMapEntry(v) {
				return false
			}
			b = b[n:]
		case typ == protowire.VarintType && num == 11:
			_, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return false
			}
			b = b[n:]
		default:
			return false
		}
	}
	return true
}

// scanMapEntry checks a map<string, string> entry: a key (1) and a value
// (2), each UTF-8 and at most once (either may be absent: "").
func scanMapEntry(b []byte) bool {
	var seen [3]bool
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || typ != protowire.BytesType || (num != 1 && num != 2) || seen[num] {
			return false
		}
		seen[num] = true
		b = b[n:]
		v, n := protowire.ConsumeBytes(b)
		if n < 0 || !utf8.Valid(v) {
			return false
		}
		b = b[n:]
	}
	return true
}

// decodeObjectMeta decodes b, which scanObjectMeta accepted, as
// proto.Unmarshal does (map entries in order: a repeated key's last value
// wins), with one copy of b for all its strings (each a substring of it)
// instead of proto.Unmarshal's string, and reflect.New'd key and value,
// per field and entry (issue 15: an S3 HEAD's lookup decoded its record
// through proto.Unmarshal, 11 of the ~84 allocations of a HEAD).
func decodeObjectMeta(b []byte) *metapb.ObjectMeta {
	m := &metapb.ObjectMeta{}
	s := string(b) // (b is the arena's: the strings must not alias it)
	p := 0
	sub := func(v []byte, at int) string { return s[at : at+len(v)] }
	for p < len(b) {
		num, typ, n := protowire.ConsumeTag(b[p:])
		p += n
		if typ == protowire.VarintType {
			x, n := protowire.ConsumeVarint(b[p:])
			p += n
			m.PartsCount = uint32(x) // field 11
			continue
		}
		v, n := protowire.ConsumeBytes(b[p:])
		at := p + n - len(v) // v's offset in b (and s)
		p += n
		switch num {
		case 1:
			m.Etag = sub(v, at)
		case 2:
			m.ContentType = sub(v, at)
		case 3:
			m.ContentEncoding = sub(v, at)
		case 4:
			m.ContentDisposition = sub(v, at)
		case 5:
			m.ContentLanguage = sub(v, at)
		case 6:
			m.CacheControl = sub(v, at)
		case 7:
			m.Expires = sub(v, at)
		case 8, 9, 10:
			var key, val string
			for q := 0; q < len(v); {
				en, _, n := protowire.ConsumeTag(v[q:])
				q += n
				w, n := protowire.ConsumeBytes(v[q:])
				wat := at + q + n - len(w)
				q += n
				if en == 1 {
					key = sub(w, wat)
				} else {
					val = sub(w, wat)
				}
			}
			mp := &m.User
			switch num {
			case 9:
				mp = &m.Tags
			case 10:
				mp = &m.Checksums
			}
			if *mp == nil {
				*mp = make(map[string]string, 1)
			}
			(*mp)[key] = val
		}
	}
	return m
}

// scanBlock checks a KeyBlock: an id (container and local id, varints)
// and a length, each at most once.
func scanBlock(b []byte) bool {
	var seen [3]bool
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return false
		}
		b = b[n:]
		switch {
		case num == 1 && typ == protowire.BytesType && !seen[1]:
			seen[1] = true
			v, n := protowire.ConsumeBytes(b)
			if n < 0 || !scanID(v) {
				return false
			}
			b = b[n:]
		case num == 2 && typ == protowire.VarintType:
			_, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return false
			}
			b = b[n:]
		default:
			return false
		}
	}
	return true
}

func scanID(b []byte) bool {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || typ != protowire.VarintType || num != 1 && num != 2 {
			return false
		}
		b = b[n:]
		_, n = protowire.ConsumeVarint(b)
		if n < 0 {
			return false
		}
		b = b[n:]
	}
	return true
}
