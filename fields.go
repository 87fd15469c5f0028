package dedup

import (
	"bytes"
	"fmt"
	"slices"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

// Field selection: a single pass over the payload that validates it as JSON,
// remembers where each selected path's value lies, and never builds maps.
// The selected values are then written in a canonical, prefix-free byte
// encoding (see appendCanonical) that feeds the key hash.

const (
	maxFields = 64  // paths per rule: one bit each in a uint64 mask
	maxDepth  = 512 // nesting bound, so hostile payloads cannot exhaust the stack
)

// fieldSet is a compiled, sorted, de-duplicated list of JSON paths. The order
// the user lists fields in does not change the key.
type fieldSet struct {
	paths []string   // sorted, as given ("report.kind")
	segs  [][]string // paths split on '.'
}

func compileFields(paths []string) (*fieldSet, error) {
	if len(paths) == 0 {
		return nil, nil
	}
	ps := slices.Clone(paths)
	slices.Sort(ps)
	ps = slices.Compact(ps)
	if len(ps) > maxFields {
		return nil, fmt.Errorf("%w: %d fields selected, at most %d", ErrInvalidOption, len(ps), maxFields)
	}
	fs := &fieldSet{paths: ps, segs: make([][]string, len(ps))}
	for i, p := range ps {
		segs := strings.Split(p, ".")
		for _, s := range segs {
			if s == "" {
				return nil, fmt.Errorf("%w: field path %q has an empty segment", ErrInvalidOption, p)
			}
		}
		fs.segs[i] = segs
	}
	return fs, nil
}

// span is the byte range of one JSON value inside the payload; end == 0 means
// the path was not found.
type span struct{ start, end int }

// jsonError describes malformed JSON; it never includes payload bytes.
type jsonError struct {
	off int
	msg string
}

func (e *jsonError) Error() string { return fmt.Sprintf("invalid JSON at offset %d: %s", e.off, e.msg) }

// scanner walks a JSON document once. It records the spans of the selected
// paths and validates everything else by skipping it.
type scanner struct {
	b     []byte
	pos   int
	fs    *fieldSet
	spans *[maxFields]span
}

// selectFields validates payload as one JSON value and returns the spans of
// every selected path (last occurrence wins for duplicate member names, as in
// encoding/json).
func selectFields(payload []byte, fs *fieldSet, spans *[maxFields]span) error {
	s := scanner{b: payload, fs: fs, spans: spans}
	var all uint64
	if n := len(fs.paths); n == 64 {
		all = ^uint64(0)
	} else {
		all = 1<<uint(n) - 1
	}
	s.ws()
	if err := s.value(0, all); err != nil {
		return err
	}
	s.ws()
	if s.pos != len(s.b) {
		return &jsonError{s.pos, "data after the top-level value"}
	}
	return nil
}

func (s *scanner) fail(msg string) error { return &jsonError{s.pos, msg} }

func (s *scanner) ws() {
	b, i := s.b, s.pos
	for i < len(b) && (b[i] == ' ' || b[i] == '\n' || b[i] == '\t' || b[i] == '\r') {
		i++
	}
	s.pos = i
}

// plainStr marks the bytes a string can hold without ending or escaping:
// the scanner skips runs of them in a tight loop.
var plainStr = func() (t [256]bool) {
	for c := 0x20; c < 256; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

// value scans one value at depth; active is the set of paths that pass
// through this value and continue below it.
func (s *scanner) value(depth int, active uint64) error {
	if depth > maxDepth {
		return s.fail("nesting too deep")
	}
	if s.pos >= len(s.b) {
		return s.fail("unexpected end of input")
	}
	switch c := s.b[s.pos]; {
	case c == '{':
		return s.object(depth, active)
	case c == '[':
		return s.array(depth)
	case c == '"':
		_, _, err := s.str()
		return err
	case c == '-' || (c >= '0' && c <= '9'):
		return s.number()
	case c == 't':
		return s.lit("true")
	case c == 'f':
		return s.lit("false")
	case c == 'n':
		return s.lit("null")
	default:
		return s.fail("unexpected character") // never quote payload bytes
	}
}

func (s *scanner) lit(word string) error {
	if len(s.b)-s.pos < len(word) || string(s.b[s.pos:s.pos+len(word)]) != word {
		return s.fail("invalid literal")
	}
	s.pos += len(word)
	return nil
}

// str scans a string and returns its raw contents (between the quotes) and
// whether it contains escapes.
func (s *scanner) str() (raw []byte, escaped bool, err error) {
	s.pos++ // opening quote
	start := s.pos
	for s.pos < len(s.b) {
		i, b := s.pos, s.b
		for i < len(b) && plainStr[b[i]] {
			i++
		}
		s.pos = i
		if i == len(b) {
			break
		}
		c := b[i]
		switch {
		case c == '"':
			raw = s.b[start:s.pos]
			s.pos++
			return raw, escaped, nil
		case c == '\\':
			escaped = true
			if s.pos+1 >= len(s.b) {
				return nil, false, s.fail("unterminated escape")
			}
			switch s.b[s.pos+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				s.pos += 2
			case 'u':
				if s.pos+6 > len(s.b) {
					return nil, false, s.fail("short \\u escape")
				}
				for _, h := range s.b[s.pos+2 : s.pos+6] {
					if unhex(h) < 0 {
						return nil, false, s.fail("invalid \\u escape")
					}
				}
				s.pos += 6
			default:
				return nil, false, s.fail("invalid escape")
			}
		case c < 0x20:
			return nil, false, s.fail("control character in string")
		default:
			s.pos++
		}
	}
	return nil, false, s.fail("unterminated string")
}

func (s *scanner) number() error {
	start := s.pos
	if s.b[s.pos] == '-' {
		s.pos++
	}
	switch {
	case s.pos < len(s.b) && s.b[s.pos] == '0':
		s.pos++
	case s.pos < len(s.b) && s.b[s.pos] >= '1' && s.b[s.pos] <= '9':
		s.digits()
	default:
		return s.fail("invalid number")
	}
	if s.pos < len(s.b) && s.b[s.pos] == '.' {
		s.pos++
		if s.digits() == 0 {
			return s.fail("invalid number fraction")
		}
	}
	if s.pos < len(s.b) && (s.b[s.pos] == 'e' || s.b[s.pos] == 'E') {
		s.pos++
		if s.pos < len(s.b) && (s.b[s.pos] == '+' || s.b[s.pos] == '-') {
			s.pos++
		}
		if s.digits() == 0 {
			return s.fail("invalid number exponent")
		}
	}
	_ = start
	return nil
}

func (s *scanner) digits() int {
	n := 0
	for s.pos < len(s.b) && s.b[s.pos] >= '0' && s.b[s.pos] <= '9' {
		s.pos++
		n++
	}
	return n
}

func (s *scanner) array(depth int) error {
	s.pos++
	s.ws()
	if s.pos < len(s.b) && s.b[s.pos] == ']' {
		s.pos++
		return nil
	}
	for {
		s.ws()
		if err := s.value(depth+1, 0); err != nil {
			return err
		}
		s.ws()
		if s.pos >= len(s.b) {
			return s.fail("unterminated array")
		}
		switch s.b[s.pos] {
		case ',':
			s.pos++
		case ']':
			s.pos++
			return nil
		default:
			return s.fail("expected ',' or ']'")
		}
	}
}

func (s *scanner) object(depth int, active uint64) error {
	s.pos++
	s.ws()
	if s.pos < len(s.b) && s.b[s.pos] == '}' {
		s.pos++
		return nil
	}
	for {
		s.ws()
		if s.pos >= len(s.b) || s.b[s.pos] != '"' {
			return s.fail("expected member name")
		}
		key, esc, err := s.str()
		if err != nil {
			return err
		}
		s.ws()
		if s.pos >= len(s.b) || s.b[s.pos] != ':' {
			return s.fail("expected ':'")
		}
		s.pos++
		s.ws()
		var ends, deeper uint64
		if active != 0 {
			ends, deeper = s.match(depth, active, key, esc)
		}
		// A repeated member name replaces what an earlier one selected.
		for m := ends | deeper; m != 0; m &= m - 1 {
			i := trailingZeros(m)
			if len(s.fs.segs[i]) > depth {
				s.spans[i] = span{}
			}
		}
		start := s.pos
		if err := s.value(depth+1, deeper); err != nil {
			return err
		}
		for m := ends; m != 0; m &= m - 1 {
			s.spans[trailingZeros(m)] = span{start, s.pos}
		}
		s.ws()
		if s.pos >= len(s.b) {
			return s.fail("unterminated object")
		}
		switch s.b[s.pos] {
		case ',':
			s.pos++
		case '}':
			s.pos++
			return nil
		default:
			return s.fail("expected ',' or '}'")
		}
	}
}

// match returns which active paths name key at this depth, split into those
// that end here and those that continue into the member's value.
func (s *scanner) match(depth int, active uint64, key []byte, esc bool) (ends, deeper uint64) {
	var decoded []byte
	if esc || !isPlainASCII(key) {
		var buf [64]byte
		decoded = appendUnescaped(buf[:0], key)
		key = decoded
	}
	for m := active; m != 0; m &= m - 1 {
		i := trailingZeros(m)
		segs := s.fs.segs[i]
		if string(key) != segs[depth] {
			continue
		}
		if depth == len(segs)-1 {
			ends |= 1 << uint(i)
		} else {
			deeper |= 1 << uint(i)
		}
	}
	return ends, deeper
}

func trailingZeros(m uint64) int {
	n := 0
	for m&1 == 0 {
		m >>= 1
		n++
	}
	return n
}

func unhex(c byte) int {
	switch {
	case c >= '0' && c <= '9':
		return int(c - '0')
	case c >= 'a' && c <= 'f':
		return int(c-'a') + 10
	case c >= 'A' && c <= 'F':
		return int(c-'A') + 10
	}
	return -1
}

// appendUnescaped decodes the raw contents of a valid JSON string. Like
// encoding/json, invalid UTF-8 and lone surrogates become U+FFFD, so two
// strings encoding/json decodes equally decode equally here.
func appendUnescaped(dst, raw []byte) []byte {
	for i := 0; i < len(raw); {
		c := raw[i]
		if c == '\\' {
			switch raw[i+1] {
			case '"', '\\', '/':
				dst = append(dst, raw[i+1])
			case 'b':
				dst = append(dst, '\b')
			case 'f':
				dst = append(dst, '\f')
			case 'n':
				dst = append(dst, '\n')
			case 'r':
				dst = append(dst, '\r')
			case 't':
				dst = append(dst, '\t')
			case 'u':
				r := hex4(raw[i+2:])
				i += 6
				if utf16.IsSurrogate(r) {
					if i+6 <= len(raw) && raw[i] == '\\' && raw[i+1] == 'u' {
						if r2 := utf16.DecodeRune(r, hex4(raw[i+2:])); r2 != utf8.RuneError {
							dst = utf8.AppendRune(dst, r2)
							i += 6
							continue
						}
					}
					r = utf8.RuneError
				}
				dst = utf8.AppendRune(dst, r)
				continue
			}
			i += 2
			continue
		}
		if c < utf8.RuneSelf {
			dst = append(dst, c)
			i++
			continue
		}
		r, size := utf8.DecodeRune(raw[i:])
		if r == utf8.RuneError && size == 1 {
			dst = utf8.AppendRune(dst, utf8.RuneError)
		} else {
			dst = append(dst, raw[i:i+size]...)
		}
		i += size
	}
	return dst
}

func hex4(b []byte) rune {
	return rune(unhex(b[0])<<12 | unhex(b[1])<<8 | unhex(b[2])<<4 | unhex(b[3]))
}

// Canonical encoding tags. The encoding is prefix-free, so a sequence of
// encoded values can be hashed without length prefixes.
const (
	tagNull   = 'z'
	tagTrue   = 't'
	tagFalse  = 'f'
	tagNumber = 'n'
	tagString = 's'
	tagArray  = 'a'
	tagObject = 'o'
	tagEnd    = 0xff // closes arrays and objects; never starts a value
)

// appendCanonical appends the canonical encoding of the valid JSON value v:
//   - strings: decoded (escapes resolved, invalid UTF-8 as U+FFFD), with 0x00
//     and 0x01 escaped, then a 0x00 terminator;
//   - numbers: exact decimal — sign, significant digits without leading or
//     trailing zeros, and a base-10 exponent; -0 and 0 are equal;
//   - objects: members sorted by decoded name, duplicate names keep the last;
//   - arrays: elements in order; white space never matters.
func appendCanonical(dst, v []byte) ([]byte, error) {
	s := scanner{b: v}
	return s.canon(dst)
}

func (s *scanner) canon(dst []byte) ([]byte, error) {
	s.ws()
	c := s.b[s.pos]
	switch {
	case c == '"':
		raw, esc, err := s.str()
		if err != nil {
			return nil, err
		}
		return appendCanonString(dst, raw, esc), nil
	case c == '-' || (c >= '0' && c <= '9'):
		start := s.pos
		if err := s.number(); err != nil {
			return nil, err
		}
		return appendCanonNumber(dst, s.b[start:s.pos])
	case c == 't':
		s.pos += 4
		return append(dst, tagTrue), nil
	case c == 'f':
		s.pos += 5
		return append(dst, tagFalse), nil
	case c == 'n':
		s.pos += 4
		return append(dst, tagNull), nil
	case c == '[':
		dst = append(dst, tagArray)
		s.pos++
		for {
			s.ws()
			if s.b[s.pos] == ']' {
				s.pos++
				return append(dst, tagEnd), nil
			}
			if s.b[s.pos] == ',' {
				s.pos++
				continue
			}
			var err error
			if dst, err = s.canon(dst); err != nil {
				return nil, err
			}
		}
	case c == '{':
		// Members are encoded one after another into scratch and sorted as
		// offsets. canon stays self-recursive and stores no slice of its
		// results: either would make dst escape, moving fingerprint's stack
		// buffer to the heap.
		type member struct{ key, val, end int } // scratch[key:val] name, [val:end] value
		var members []member
		var scratch []byte
		s.pos++
		for {
			s.ws()
			switch s.b[s.pos] {
			case '}':
				s.pos++
				// Stable sort keeps source order among equal names; keep the last.
				slices.SortStableFunc(members, func(a, b member) int {
					return bytes.Compare(scratch[a.key:a.val], scratch[b.key:b.val])
				})
				dst = append(dst, tagObject)
				for i, m := range members {
					if i+1 < len(members) {
						if n := members[i+1]; bytes.Equal(scratch[n.key:n.val], scratch[m.key:m.val]) {
							continue
						}
					}
					dst = append(dst, scratch[m.key:m.end]...)
				}
				return append(dst, tagEnd), nil
			case ',':
				s.pos++
				continue
			}
			raw, esc, err := s.str()
			if err != nil {
				return nil, err
			}
			m := member{key: len(scratch)}
			scratch = appendCanonString(scratch, raw, esc)
			m.val = len(scratch)
			s.ws()
			s.pos++ // ':'
			if scratch, err = s.canon(scratch); err != nil {
				return nil, err
			}
			m.end = len(scratch)
			members = append(members, m)
		}
	}
	return nil, s.fail("unexpected character")
}

func appendCanonString(dst, raw []byte, esc bool) []byte {
	if esc || !isPlainASCII(raw) {
		var buf [128]byte
		raw = appendUnescaped(buf[:0], raw)
	}
	return appendStringBytes(dst, raw)
}

// appendStringBytes writes s verbatim in the string encoding: tagString, s
// with 0x00 and 0x01 escaped, then a 0x00 terminator. Task types and field
// paths are written this way: they are not JSON, so nothing is unescaped.
func appendStringBytes[S string | []byte](dst []byte, s S) []byte {
	dst = append(dst, tagString)
	for i := 0; i < len(s); i++ {
		switch c := s[i]; c {
		case 0x00:
			dst = append(dst, 0x01, 0x01)
		case 0x01:
			dst = append(dst, 0x01, 0x02)
		default:
			dst = append(dst, c)
		}
	}
	return append(dst, 0x00)
}

func isPlainASCII(b []byte) bool {
	for _, c := range b {
		if c >= utf8.RuneSelf {
			return false
		}
	}
	return true
}

// maxExponent bounds the decimal exponent of a selected number: far beyond
// float64's range, small enough that exponent arithmetic cannot overflow.
const maxExponent = 1_000_000_000

// appendCanonNumber writes a valid JSON number as exact decimal: value =
// sign × digits × 10^exp with digits free of leading and trailing zeros.
func appendCanonNumber(dst, n []byte) ([]byte, error) {
	neg := n[0] == '-'
	if neg {
		n = n[1:]
	}
	mant := n
	var exp int64
	if i := indexAny(n, 'e', 'E'); i >= 0 {
		mant = n[:i]
		e := n[i+1:]
		eneg := false
		if e[0] == '+' || e[0] == '-' {
			eneg = e[0] == '-'
			e = e[1:]
		}
		for _, c := range e {
			exp = exp*10 + int64(c-'0')
			if exp > maxExponent {
				return nil, fmt.Errorf("number exponent out of range (|exp| > %d)", maxExponent)
			}
		}
		if eneg {
			exp = -exp
		}
	}
	intPart, frac := mant, []byte(nil)
	if i := indexAny(mant, '.', '.'); i >= 0 {
		intPart, frac = mant[:i], mant[i+1:]
	}
	exp -= int64(len(frac))
	// Digits are intPart followed by frac; find the significant range.
	total := len(intPart) + len(frac)
	at := func(i int) byte {
		if i < len(intPart) {
			return intPart[i]
		}
		return frac[i-len(intPart)]
	}
	lead, trail := 0, total-1
	for lead < total && at(lead) == '0' {
		lead++
	}
	if lead == total {
		return append(dst, tagNumber, '0', 0x00), nil
	}
	for at(trail) == '0' {
		trail--
	}
	exp += int64(total - 1 - trail)
	dst = append(dst, tagNumber)
	if neg {
		dst = append(dst, '-')
	}
	for i := lead; i <= trail; i++ {
		dst = append(dst, at(i))
	}
	dst = append(dst, 'e')
	dst = appendInt(dst, exp)
	return append(dst, 0x00), nil
}

func indexAny(b []byte, x, y byte) int {
	for i, c := range b {
		if c == x || c == y {
			return i
		}
	}
	return -1
}

func appendInt(dst []byte, v int64) []byte {
	if v < 0 {
		dst = append(dst, '-')
		v = -v
	}
	var buf [20]byte
	i := len(buf)
	for {
		i--
		buf[i] = byte('0' + v%10)
		v /= 10
		if v == 0 {
			break
		}
	}
	return append(dst, buf[i:]...)
}
